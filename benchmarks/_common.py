"""What every benchmark script shares: progress on stderr, JSON-only stdout, the model,
load averages, ratios and percentiles, token timing, and the report's common ``config``.

Only the public llamax API is used here and in every script (``import llamax``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import itertools
import json
import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO, TypeVar

import llama_cpp

import llamax
from llamax.backend.platform import cpu_description

__all__ = [
    "CORES",
    "TokenTimes",
    "add_common_args",
    "agreement",
    "base_config",
    "busy_processes",
    "common_prefix_len",
    "cpu_advertises_amx",
    "emit_report",
    "filler_sentences",
    "greedy",
    "in_fresh_thread",
    "load_average",
    "log",
    "machine",
    "model_path",
    "percentile",
    "ratio",
    "short_prompts",
    "spread",
    "stats_delta",
    "stdout_to_stderr",
    "targets",
    "text_of_tokens",
]

CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
"""The cores this process may run on."""

N_THREADS = int(os.environ.get("LLAMAX_BENCH_THREADS", "2"))
"""Threads of every system (2, the cores of the machines these benchmarks were written on).
``LLAMAX_BENCH_THREADS=1`` runs everything on one core: a slower machine of the same
kind, for checking that a policy learned its speed rather than carrying it."""
T = TypeVar("T")


REPO = Path(__file__).resolve().parent.parent


def load_module(path: Path) -> Any:
    """The Python file at ``path`` as a module named after it, loaded once per process and
    registered in ``sys.modules`` (a dataclass in it looks its module up)."""
    name = path.stem
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]


def load_script(name: str) -> Any:
    """``scripts/{name}.py`` (the test-model writers) as a module."""
    return load_module(REPO / "scripts" / f"{name}.py")


def log(message: str) -> None:
    """Progress, on stderr (stdout holds only the JSON report)."""
    print(message, file=sys.stderr, flush=True)


def load_average() -> list[float]:
    """1, 5 and 15 minute load averages (2 cores: anything above ~2 means contention)."""
    return [round(x, 2) for x in os.getloadavg()]


def cpu_ticks() -> tuple[int, int] | None:
    """``(steal, total)`` clock ticks of every CPU since boot (``/proc/stat``), or None."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return (fields[7] if len(fields) > 7 else 0), sum(fields[:8])


_TICKS_AT_START = cpu_ticks()


def steal_share() -> float | None:
    """The share of CPU time the hypervisor gave to others (steal) since this process
    started: on a VM, a run whose share is not near 0 shared its cores with another
    guest, however quiet the load average looked (2026-12-03: 14% in one sitting, where
    the same runs moved 10-35% without any drafts)."""
    now = cpu_ticks()
    if now is None or _TICKS_AT_START is None or now[1] <= _TICKS_AT_START[1]:
        return None
    return round((now[0] - _TICKS_AT_START[0]) / (now[1] - _TICKS_AT_START[1]), 4)


def ratio(num: float | None, den: float | None) -> float | None:
    """``num / den`` rounded to 4 digits, or None when either is missing."""
    return round(num / den, 4) if num is not None and den else None


def percentile(values: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) with linear interpolation between order statistics."""
    s = sorted(values)
    k = (len(s) - 1) * q
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def targets(
    values: dict[str, float | None], limits: dict[str, float], *, at_least: bool
) -> dict[str, dict[str, Any]]:
    """For each limit: the value, the limit and whether it is met (None when not measured)."""
    out = {}
    for key, limit in limits.items():
        v = values.get(key)
        met = None if v is None else (v >= limit if at_least else v <= limit)
        out[key] = {"ratio": v, "min" if at_least else "max": limit, "met": met}
    return out


def spread(prefix: str, values: Sequence[float]) -> dict[str, float]:
    """``{prefix}_p50_s``, ``_p95_s``, ``_min_s`` and ``_max_s`` of ``values`` (seconds)."""
    points = {"p50": percentile(values, 0.5), "p95": percentile(values, 0.95)}
    points |= {"min": min(values), "max": max(values)}
    return {f"{prefix}_{k}_s": round(v, 4) for k, v in points.items()}


def stats_delta(before: Any, after: Any, names: Sequence[str]) -> dict[str, int]:
    """``after.num_<name> - before.num_<name>`` of two ``ctx.stats()`` snapshots."""
    return {n: getattr(after, f"num_{n}") - getattr(before, f"num_{n}") for n in names}


def agreement(a: Sequence[Sequence[Any]], b: Sequence[Sequence[Any]]) -> dict[str, Any]:
    """Identical outputs (over the shorter list); for the others, where they first differ."""
    n = min(len(a), len(b))
    differ = {i: common_prefix_len(a[i], b[i]) for i in range(n) if tuple(a[i]) != tuple(b[i])}
    return {"identical": n - len(differ), "of": n, "first_difference_at": differ}


def common_prefix_len(a: Sequence[Any], b: Sequence[Any]) -> int:
    """Length of the longest common prefix of two sequences."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def cpu_advertises_amx() -> bool:
    """Whether /proc/cpuinfo lists AMX (llamax then turns ggml's extra buffer types off)."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(
                line.startswith("flags") and " amx" in line for line in f.read().splitlines()
            )
    except OSError:
        return False


SIMD_FLAGS = (
    "sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl",
    "avx512_vnni", "avx512_bf16", "avx512vbmi", "amx_tile", "amx_int8", "amx_bf16",
    "asimd", "sve", "neon",
)  # fmt: skip
"""The /proc/cpuinfo flags that decide which ggml kernels run (x86 and Arm)."""


def machine() -> dict[str, Any]:
    """What every figure depends on: the CPU model, its SIMD flags (as /proc/cpuinfo lists
    them, like ``scripts/cmake_flags.sh`` reads them), the cores, and what the loaded
    llama.cpp was built for (``llama_print_system_info``; a build may use fewer
    instructions than the CPU has)."""
    cpu = cpu_description()
    flags = set(str(cpu["flags"]).split())
    system_info = llama_cpp.llama_print_system_info()
    return {
        "cpu_model": cpu["model"],
        "simd_flags": [f for f in SIMD_FLAGS if f in flags],
        "cores": os.cpu_count(),
        "llama_cpp_system_info": (
            system_info.decode(errors="replace") if isinstance(system_info, bytes) else system_info
        ).strip(),
        "llama_cpp_lib_path": os.environ.get("LLAMA_CPP_LIB_PATH"),
    }


def greedy(max_tokens: int, *, ignore_eos: bool = True) -> llamax.SamplingParams:
    """Greedy sampling; with ``ignore_eos`` every request makes exactly ``max_tokens``."""
    return llamax.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)


def model_path(arg: Path | None) -> Path:
    """The ``--model`` argument, or llamax's default model."""
    return arg or llamax.default_model_path()


def short_prompts(n: int) -> list[str]:
    """N distinct short prompts: the throughput workload (W1) of throughput.py."""
    return [f"Write a short story about topic number {i}:" for i in range(n)]


_SUBJECTS = (
    "Every support agent",
    "A new customer",
    "The night-shift keeper",
    "Our billing team",
    "The warehouse in Brest",
    "Any technician on call",
    "The regional manager",
    "A returning visitor",
    "The safety officer",
)
_ACTIONS = (
    "must confirm the order number before discussing",
    "should politely summarise",
    "is expected to double-check",
    "may only escalate questions about",
    "needs written approval to change",
    "keeps a detailed log of",
    "is never allowed to guess about",
    "can offer a small voucher for delays in",
)
_TOPICS = (
    "refunds for lamps damaged in transit",
    "the rotating Fresnel lens assembly",
    "solar charging kits and their batteries",
    "monthly and annual membership plans",
    "guided tours booked by schools",
    "fog horn maintenance schedules",
    "warranty claims filed after ninety days",
    "loyalty points earned on gift cards",
    "installation manuals in foreign languages",
    "privacy questions about location data",
    "storm alerts sent through the mobile app",
)
_ENDINGS = (
    ", and the answer must stay short and friendly.",
    " whenever the customer sounds confused.",
    " before the end of the same business day.",
    ", unless a supervisor has already replied.",
    " in plain language without internal jargon.",
    ", citing the relevant page of the handbook.",
    " and then thank the customer for their patience.",
)


def filler_sentences(label: str = "Guideline") -> Iterator[str]:
    """An endless stream of varied, numbered sentences (deterministic), for long prompts."""
    for i in itertools.count(1):
        subject = _SUBJECTS[i % len(_SUBJECTS)]
        action = _ACTIONS[(i * 3) % len(_ACTIONS)]
        topic = _TOPICS[(i * 5) % len(_TOPICS)]
        ending = _ENDINGS[(i * 2) % len(_ENDINGS)]
        yield f"{label} {i}: {subject} {action} {topic}{ending}"


def text_of_tokens(count_tokens: Callable[[str], int], target: int, head: str, label: str) -> str:
    """``head`` plus filler sentences, one a line, until ``count_tokens`` reaches ``target``."""
    lines = [head]
    sentences = filler_sentences(label)
    while count_tokens("\n".join(lines)) < target:
        lines.append(next(sentences))
    return "\n".join(lines)


class TokenTimes:
    """Consumes a token stream in a thread and records when each item arrived."""

    def __init__(self, stream: Iterable[Any]) -> None:
        self.times: list[float] = []
        self.error: BaseException | None = None
        self._stream = stream
        self.thread = threading.Thread(target=self._consume, daemon=True)
        self.thread.start()

    def _consume(self) -> None:
        try:
            for _item in self._stream:
                self.times.append(time.perf_counter())
        except BaseException as exc:  # reported by wait()
            self.error = exc

    def wait(self) -> list[float]:
        """Join the thread; return the arrival times (raises what the stream raised)."""
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.times

    def first_after(self, start: float) -> float:
        """Time to the first item, from ``start`` (wait() first)."""
        if not self.times:
            raise RuntimeError("the stream produced nothing")
        return self.times[0] - start


def in_fresh_thread(fn: Callable[[], T]) -> T:
    """Run ``fn`` in a new thread that exits afterwards, and return its result.

    ggml runs its graph on an OpenMP team owned by the calling thread. llamax decodes on
    its own engine thread, so raw loops also decode on a thread of their own, one team at
    a time: libgomp spins at barriers for long only while it manages no more threads than
    there are cores, and under CPU contention that spinning made a loop run 2-7x slower
    when one team was alive than when two were (see ``OMP_WAIT_POLICY``).
    """
    box: list[T] = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            box.append(fn())
        except BaseException as exc:  # re-raised in the caller
            errors.append(exc)

    thread = threading.Thread(target=target, name="benchmark-system")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return box[0]


def base_config(
    args: argparse.Namespace, load_at_start: list[float], **extra: Any
) -> dict[str, Any]:
    """The ``config`` block every report starts with: the command-line options, versions,
    load averages and ``extra`` settings (see benchmarks/README.md)."""
    options = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    return {
        **options,
        "n_threads": N_THREADS,
        "llama_cpp_python_version": llama_cpp.__version__,
        "llamax_version": llamax.__version__,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "load_average_at_start": load_at_start,
        "load_average_at_end": load_average(),
        "cpu_steal_share": steal_share(),
        **extra,
    }


def emit_report(report: dict[str, Any], stdout: TextIO, json_out: Path | None) -> None:
    """Write the JSON report, with the :func:`machine` it ran on first, to the real stdout,
    and to ``json_out`` when given."""
    text = json.dumps({"machine": machine(), **report}, indent=2)
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(text + "\n")
    stdout.write(text + "\n")


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """``--json-out`` and ``--model``, which every script takes."""
    parser.add_argument("--json-out", type=Path, help="also write the JSON report here")
    parser.add_argument("--model", type=Path, help="GGUF file (default: llamax's default model)")


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[TextIO]:
    """Send fd 1 to stderr (native prints included); yield a stream on the real stdout."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    real = os.fdopen(saved, "w")
    try:
        yield real
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        real.close()


BUSY_LOOP = "while True: pass"
MODEL_LOOP = (
    "import llamax\n"
    "ctx = llamax.Context(n_ctx=1024, n_seq_max=4, n_threads={cores})\n"
    "p = llamax.SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)\n"
    "while True:\n"
    "    [h.result() for h in [ctx.add_request(f'Count to {{i}}:', p) for i in range(4)]]\n"
)


@contextlib.contextmanager
def busy_processes(count: int, neighbor: str) -> Iterator[None]:
    """``count`` busy processes, killed on exit: Python busy loops, or (``model``) llamax
    processes decoding 4 streams with ``n_threads=<cores>`` (spinning workers of their own)."""
    code = BUSY_LOOP if neighbor == "loop" else MODEL_LOOP.format(cores=CORES)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        for _ in range(count)
    ]
    try:
        time.sleep((0.5 if neighbor == "loop" else 5.0) if count else 0.0)  # let them start
        yield
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()
