"""Generation throughput of llamax against raw loops, llama-cpp-python and llama-server.

For each N in ``--n`` (default 1, 16, 64), N distinct short prompts are completed with 64
greedy tokens each, end-of-generation tokens banned, so every request makes 64 tokens.
The score is generated tokens / wall time, from the first submit (tokenization included)
to the last token. Systems, in one process (llama-server in its own), 2 threads each:

``raw`` / ``raw_streams``
    ``_loops.RawLoop``: every prompt in one batch, then one token per sequence per step;
    ``raw`` with one unified KV buffer, ``raw_streams`` with one KV stream per sequence.
``llamax``
    One ``llamax.Context`` (background loop) built for the largest N; N ``add_request``
    calls at once, then ``handle.result()`` for each. The cache is cleared before each run.
    Its default layout, ``auto``: one KV stream per sequence while each fits its stream
    (here, always), so any sequence may still grow to ``n_ctx`` (docs/kv-cache.md).
``llamax_unified``
    The same with ``kv_layout="unified"``: one KV buffer all sequences share.
``llama_cpp_python``
    ``Llama.create_completion`` N times, one after another (``--quick``: not at N=64).
``llama_server``
    ``llama-server -np N -c 8192 -t 2`` (one process per N), N concurrent HTTP requests
    (``--llama-server PATH``; by default the binary ``peers.sh`` built, if any).
``llamax_noop_processor`` / ``llamax_logprobs5`` / ``llamax_warm_cache`` (N=16 only)
    A numpy processor that changes nothing, ``logprobs=5``, and llamax keeping the prefixes
    retained by earlier runs.

Every system is warmed up; each repeat runs every (N, system), the system order rotating
between repeats. The report holds medians, every sample, the ratios and the targets.

::

    .venv/bin/python benchmarks/throughput.py --repeats 3 --json-out out.json
    .venv/bin/python benchmarks/throughput.py --n 16 --repeats 1 --llama-server none
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _common import (
    add_common_args,
    base_config,
    emit_report,
    greedy,
    load_average,
    log,
    model_path,
    ratio,
    short_prompts,
    stdout_to_stderr,
    targets,
)
from _loops import RawLoop
from _peers import LlamaCppPythonPeer, LlamaServerPeer, default_llama_server

import llamax

MAX_TOKENS = 64
N_BATCH = 1024  # the raw loops prefill all prompts in one batch: 64 prompts x ~11 tokens
N_CTX = 8192
LCP_N_CTX = 512
WARMUP_TOKENS = 8
THRESHOLD = 0.95
FEATURE_N = 16
FEATURE_THRESHOLD = 0.85
RAW, STREAMS, LLAMAX, LLAMAX_UNIFIED, LCP, SERVER = (
    "raw",
    "raw_streams",
    "llamax",
    "llamax_unified",
    "llama_cpp_python",
    "llama_server",
)
NOOP, LOGPROBS, WARM = "llamax_noop_processor", "llamax_logprobs5", "llamax_warm_cache"


def noop_processor(token_ids: Any, logits: Any) -> None:
    """A numpy logits processor that reads the row and changes nothing."""
    logits.max()


@dataclass(frozen=True)
class RunResult:
    """One timed run of one system on N requests."""

    tokens: int
    seconds: float
    token_ids: tuple[tuple[int, ...], ...] = ()
    steps: int | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    def sample(self) -> dict[str, float | int]:
        extra = {} if self.steps is None else {"steps": self.steps}
        return {
            "tokens": self.tokens,
            "seconds": round(self.seconds, 4),
            "tokens_per_s": round(self.tokens_per_s, 2),
            **extra,
        }


@dataclass
class System:
    """A named way of completing N prompts at once; ``only`` limits the N it runs at."""

    name: str
    run: Callable[[Sequence[str], int], RunResult]
    only: Callable[[int], bool] = lambda n: True


def llamax_run(ctx: llamax.Context, *, cold: bool = True, **extra: Any) -> Callable[..., RunResult]:
    """Runs on the llamax context, with extra SamplingParams fields on every request."""

    def run(prompts: Sequence[str], max_tokens: int) -> RunResult:
        params = dataclasses.replace(greedy(max_tokens), **extra)
        if cold:
            ctx.clear_cache()  # untimed: start from an empty KV cache, as the raw loops do
        steps = ctx.stats().num_steps
        start = time.perf_counter()
        handles = [ctx.add_request(p, params) for p in prompts]
        completions = [h.result() for h in handles]
        seconds = time.perf_counter() - start
        tokens = sum(c.usage.completion_tokens for c in completions)
        ids = tuple(c.token_ids for c in completions)
        return RunResult(tokens, seconds, ids, ctx.stats().num_steps - steps)

    return run


def raw_run(loop: RawLoop) -> Callable[..., RunResult]:
    def run(prompts: Sequence[str], max_tokens: int) -> RunResult:
        start = time.perf_counter()
        out = loop.generate(prompts, max_tokens)
        seconds = time.perf_counter() - start
        return RunResult(sum(len(t) for t in out.token_ids), seconds, out.token_ids)

    return run


def lcp_run(peer: LlamaCppPythonPeer) -> Callable[..., RunResult]:
    def run(prompts: Sequence[str], max_tokens: int) -> RunResult:
        start = time.perf_counter()
        tokens = 0
        for prompt in prompts:
            peer.reset()  # no prompt-prefix reuse (llamax's cache is cleared too)
            tokens += peer.complete(prompt, max_tokens, start).generated_tokens
        return RunResult(tokens, time.perf_counter() - start)

    return run


def server_run(servers: dict[int, LlamaServerPeer]) -> Callable[..., RunResult]:
    def run(prompts: Sequence[str], max_tokens: int) -> RunResult:
        start = time.perf_counter()
        tokens = servers[len(prompts)].run_batch(prompts, max_tokens)
        return RunResult(tokens, time.perf_counter() - start)

    return run


def build(
    args: argparse.Namespace, ns: Sequence[int], closers: list[Callable[[], None]]
) -> list[System]:
    """Load every system (llamax first: it routes native logs to Python logging)."""
    n_seq_max, model = max(ns), args.model
    log(f"loading systems: n_ctx={N_CTX} n_seq_max={n_seq_max} n_batch={N_BATCH}")
    ctx = llamax.Context(
        model,
        n_ctx=N_CTX,
        n_seq_max=n_seq_max,
        n_batch=N_BATCH,
        n_threads=2,
        reproducible=args.reproducible,
    )
    closers.append(ctx.close)
    unified = llamax.Context(
        model,
        n_ctx=N_CTX,
        n_seq_max=n_seq_max,
        n_batch=N_BATCH,
        n_threads=2,
        kv_layout="unified",
        reproducible=False,
    )
    closers.append(unified.close)
    systems = [System(LLAMAX, llamax_run(ctx)), System(LLAMAX_UNIFIED, llamax_run(unified))]
    for name, unified in ((RAW, True), (STREAMS, False)):
        loop = RawLoop(model, n_ctx=N_CTX, n_seq_max=n_seq_max, n_batch=N_BATCH, kv_unified=unified)
        closers.append(loop.close)
        systems.append(System(name, raw_run(loop)))
    lcp = LlamaCppPythonPeer(model, LCP_N_CTX)
    closers.append(lcp.close)
    systems.append(System(LCP, lcp_run(lcp), lambda n: not (args.quick and n >= 64)))
    if args.llama_server:
        servers = {}
        for n in ns:
            servers[n] = LlamaServerPeer(args.llama_server, model, n_parallel=n, n_ctx=N_CTX)
            closers.append(servers[n].close)
        systems.append(System(SERVER, server_run(servers)))
    feature = lambda n: n == FEATURE_N  # noqa: E731
    systems += [
        System(NOOP, llamax_run(ctx, logits_processors=[noop_processor]), feature),
        System(LOGPROBS, llamax_run(ctx, logprobs=5), feature),
        System(WARM, llamax_run(ctx, cold=False), feature),
    ]
    return [s for s in systems if s.name not in args.skip]


def measure(
    systems: Sequence[System], ns: Sequence[int], repeats: int
) -> dict[str, dict[int, list[RunResult]]]:
    """Warm up, then every (repeat, N, system), interleaved; the order rotates per repeat."""
    for system in systems:
        for n in ns if system.name == SERVER else [min(2, max(ns))]:  # one server per N
            if system.only(n):
                system.run(short_prompts(n), WARMUP_TOKENS)
        log(f"warmed up {system.name}")
    runs: dict[str, dict[int, list[RunResult]]] = {s.name: {} for s in systems}
    for repeat in range(repeats):
        order = [*systems[repeat % len(systems) :], *systems[: repeat % len(systems)]]
        for n in ns:
            for system in (s for s in order if s.only(n)):
                result = system.run(short_prompts(n), MAX_TOKENS)
                if result.tokens != n * MAX_TOKENS:
                    log(f"  warning: {system.name} generated {result.tokens} != {n * MAX_TOKENS}")
                runs[system.name].setdefault(n, []).append(result)
                log(
                    f"repeat {repeat + 1}/{repeats} N={n:<3} {system.name:<22} "
                    f"{result.tokens_per_s:8.1f} tok/s ({result.seconds:.2f} s)"
                )
    return runs


def report(
    runs: dict[str, dict[int, list[RunResult]]], ns: Sequence[int], config: dict[str, Any]
) -> dict[str, Any]:
    def med(name: str, n: int) -> float | None:
        results = runs.get(name, {}).get(n)
        return statistics.median(r.tokens_per_s for r in results) if results else None

    def best_raw(n: int) -> float | None:
        values = [v for v in (med(RAW, n), med(STREAMS, n)) if v is not None]
        return max(values) if values else None

    def per_n(
        num: Callable[[int], float | None], den: Callable[[int], float | None]
    ) -> dict[str, float | None]:
        return {str(n): ratio(num(n), den(n)) for n in ns}

    lx = lambda n: med(LLAMAX, n)  # noqa: E731
    lxu = lambda n: med(LLAMAX_UNIFIED, n)  # noqa: E731
    ratios = {
        "llamax_unified_over_raw": per_n(lxu, lambda n: med(RAW, n)),
        "llamax_unified_over_llama_server": per_n(lxu, lambda n: med(SERVER, n)),
        "llamax_over_llamax_unified": per_n(lx, lxu),
        "llamax_over_raw": per_n(lx, lambda n: med(RAW, n)),
        "llamax_over_raw_streams": per_n(lx, lambda n: med(STREAMS, n)),
        "llamax_over_best_raw": per_n(lx, best_raw),
        "llamax_over_llama_server": per_n(lx, lambda n: med(SERVER, n)),
        "llamax_over_llama_cpp_python": per_n(lx, lambda n: med(LCP, n)),
        "llamax_warm_cache_over_llamax": per_n(lambda n: med(WARM, n), lx),
    }
    values = {
        **{f"llamax_vs_best_raw_N{n}": ratios["llamax_over_best_raw"][str(n)] for n in ns},
        **{f"llamax_vs_llama_server_N{n}": ratios["llamax_over_llama_server"][str(n)] for n in ns},
        "llamax_vs_llama_cpp_python_N1": ratios["llamax_over_llama_cpp_python"].get("1"),
        **{
            f"{f}_vs_llamax_N{FEATURE_N}": ratio(med(f, FEATURE_N), lx(FEATURE_N))
            for f in (NOOP, LOGPROBS)
        },
    }
    limits = {f"llamax_vs_best_raw_N{n}": THRESHOLD for n in (16, 64)}
    limits |= {f"llamax_vs_llama_server_N{n}": 1.0 for n in (16, 64)}
    limits |= {"llamax_vs_llama_cpp_python_N1": THRESHOLD}
    limits |= {f"{f}_vs_llamax_N{FEATURE_N}": FEATURE_THRESHOLD for f in (NOOP, LOGPROBS)}
    agree: dict[str, dict[str, float]] = {}
    # llamax runs in streams here (kv_layout="auto", short prompts): the raw streams loop
    # has its batch composition; the unified raw loop does not (llama.cpp is not
    # batch-invariant on every CPU)
    for label, reference in (
        ("llamax_tokens_equal_raw", RAW),
        ("llamax_tokens_equal_raw_streams", STREAMS),
    ):
        for n in ns:
            raw, lxr = runs.get(reference, {}).get(n), runs.get(LLAMAX, {}).get(n)
            if raw and lxr:
                pairs = zip(raw[0].token_ids, lxr[0].token_ids, strict=True)
                agree.setdefault(label, {})[str(n)] = sum(a == b for a, b in pairs) / n
    return {
        "config": config,
        "median_tokens_per_s": {
            name: {str(n): round(v, 2) for n in ns if (v := med(name, n)) is not None}
            for name in runs
        },
        "ratios": ratios,
        "targets": targets(values, limits, at_least=True),
        "agreement": agree,
        "samples": {
            name: {str(n): [r.sample() for r in rs] for n, rs in by_n.items()}
            for name, by_n in runs.items()
        },
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    add_common_args(parser)
    parser.add_argument("--n", type=int, nargs="+", default=[1, 16, 64], help="N values")
    parser.add_argument("--repeats", type=int, default=3, help="runs per system and N (median)")
    parser.add_argument("--quick", action="store_true", help="skip llama-cpp-python at N=64")
    parser.add_argument("--skip", nargs="*", default=[], help="system names not to run")
    parser.add_argument(
        "--reproducible",
        action="store_true",
        help="llamax (not llamax_unified) in the reproducible mode (docs/reproducible.md)",
    )
    parser.add_argument(
        "--llama-server",
        default="auto",
        help="llama-server binary, 'auto' (peers.sh's build, if any) or 'none'",
    )
    args = parser.parse_args(argv)
    if args.repeats < 1 or any(n < 1 for n in args.n):
        parser.error("--repeats and --n values must be >= 1")
    args.model = model_path(args.model)
    choice = args.llama_server
    args.llama_server = (
        None if choice == "none" else default_llama_server() if choice == "auto" else Path(choice)
    )
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    ns = sorted(set(args.n))
    load = load_average()
    log(f"load average: {load}")
    closers: list[Callable[[], None]] = []
    with stdout_to_stderr() as stdout:
        try:
            runs = measure(build(args, ns, closers), ns, args.repeats)
        finally:
            for close in reversed(closers):
                close()
        settings = {"max_tokens": MAX_TOKENS, "n_batch": N_BATCH, "n_ctx": N_CTX}
        config = base_config(args, load, **settings, n_seq_max=max(ns))
        emit_report(report(runs, ns, config), stdout, args.json_out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
