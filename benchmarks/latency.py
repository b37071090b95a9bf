"""Latency under a long prompt: do running streams stall while a ~3,400-token prompt prefills?

Workload, on llamax (and with ``--llama-server PATH`` on llama-server too), 2 threads:

1. *Lone prefill*: the long prompt (about 3,400 tokens of varied sentences) alone on an
   idle context, 1 greedy token; its time to first token. Run before and after step 2;
   the report keeps the median.
2. Four greedy streams on short distinct prompts (end-of-generation ignored, up to 1,024
   tokens each). Once each has produced 8 tokens, the long prompt is submitted (1 token).
   When its first token arrives, the streams run a little longer, then are cancelled.

``--busy N`` runs every system beside N Python busy loops (issue 37), and ``--adaptive``
adds ``llamax_adaptive``: llamax with its default threads, adapting them to the load.

Reported per system: the long prompt's TTFT under load against its lone prefill
(``ttft_over_lone``, target <= 1.35), and the inter-token gaps of the 4 streams during the
long prompt's prefill (every gap that overlaps the interval from its submission to its
first token): worst and p95 (target: worst <= 0.5 s, issue 59; 0.6 s before), with the
streams' median gap before the submission for reference.

llamax: ``llamax.Context(n_ctx=8192, n_seq_max=8, n_threads=2)``, the prefix cache cleared
before each phase; once with time-budgeted steps (``max_step_ms=250``, the default) and once
with fixed ``n_batch`` chunks (``max_step_ms=None``, the engine before issue 9).
llama-server: ``-np 5 -c 20480 -t 2`` (4,096 cells per slot, so the long prompt fits a
slot), ``cache_prompt: false``.

::

    .venv/bin/python benchmarks/latency.py --json-out latency.json
    .venv/bin/python benchmarks/latency.py --llama-server auto --repeats 3
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import _common as bench
from _peers import LlamaServerPeer, default_llama_server

import llamax

LONG_TOKENS, N_STREAMS, STREAM_MAX_TOKENS, WARM_TOKENS = 3400, 4, 1024, 8
AFTER_S = 0.5  # streams keep running this long after the long prompt's first token
N_CTX, N_SEQ_MAX = 8192, 8
LLAMAX_OPTIONS: dict[str, Any] = {}  # more Context options for llamax's runs (--llamax-option)
SERVER_SLOTS, SERVER_CELLS_PER_SLOT = 5, 4096
LIMITS_MAX = {"worst_gap_s": 0.5, "ttft_over_lone": 1.35}
HEAD = "Read the notes below carefully, then summarise the three most important ones."


class StepTrace(logging.Handler):
    """Every step llamax measures (``llamax.engine.timing.step_budget`` debug records), with
    phase marks: tokens, attention (all, and row by row), predicted and measured seconds,
    and when it was observed."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.rows: list[dict[str, Any]] = []
        logger = logging.getLogger("llamax.engine.timing.step_budget")
        logger.setLevel(logging.DEBUG)
        logger.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        args = cast(tuple[int, int, int, int, float, float], record.args)
        tokens, attention, row_attention, tile_waste, predicted, measured = args
        self.rows.append(
            {
                "t": time.perf_counter(),
                "tokens": tokens,
                "attention": attention,
                "row_attention": row_attention,
                "tile_waste": tile_waste,
                "predicted": round(predicted, 4),
                "measured": round(measured, 4),
            }
        )

    def mark(self, name: str) -> None:
        self.rows.append({"t": time.perf_counter(), "mark": name})


TRACE: StepTrace | None = None


def mark(name: str) -> None:
    if TRACE is not None:
        TRACE.mark(name)


# A driver starts a stream (prompt, max_tokens) -> (token times, stop function).
Start = Callable[[str, int], tuple[bench.TokenTimes, Callable[[], None]]]


def llamax_driver(ctx: llamax.Context) -> Start:
    def start(prompt: str, max_tokens: int) -> tuple[bench.TokenTimes, Callable[[], None]]:
        handle = ctx.add_request(prompt, bench.greedy(max_tokens))
        return bench.TokenTimes(handle), handle.cancel

    return start


def server_driver(server: LlamaServerPeer) -> Start:
    def start(prompt: str, max_tokens: int) -> tuple[bench.TokenTimes, Callable[[], None]]:
        stop = threading.Event()
        return bench.TokenTimes(server.stream(prompt, max_tokens, stop)), stop.set

    return start


def lone_prefill(start: Start, long_prompt: str) -> float:
    """Time to first token of the long prompt alone."""
    t0 = time.perf_counter()
    times, _ = start(long_prompt, 1)
    return times.wait()[0] - t0


def wait_for(condition: Callable[[], bool], timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("the streams did not start")
        time.sleep(0.005)


def under_load(start: Start, long_prompt: str) -> dict[str, Any]:
    """Four streams, then the long prompt: its TTFT and the streams' gaps meanwhile."""
    streams = [
        start(f"Tell me a long story about lighthouse keeper number {i}:", STREAM_MAX_TOKENS)
        for i in range(N_STREAMS)
    ]
    wait_for(lambda: all(len(t.times) >= WARM_TOKENS for t, _ in streams))
    mark("long prompt submitted")
    t0 = time.perf_counter()
    long_times, _ = start(long_prompt, 1)
    t1 = long_times.wait()[0]
    mark("long prompt's first token")
    time.sleep(AFTER_S)
    for _, stop in streams:
        stop()
    during: list[float] = []
    before: list[float] = []
    outlived = True
    for times, _ in streams:
        arrivals = times.wait()
        outlived &= bool(arrivals) and arrivals[-1] > t1
        for a, b in itertools.pairwise(arrivals):
            if b > t0 and a < t1:
                during.append(b - a)
            elif b <= t0:
                before.append(b - a)
    return {
        "ttft_s": round(t1 - t0, 4),
        "worst_gap_s": round(max(during), 4) if during else None,
        "p95_gap_s": round(bench.percentile(during, 0.95), 4) if during else None,
        "gaps_during_prefill": len(during),
        "median_gap_before_s": round(statistics.median(before), 4) if before else None,
        "streams_outlived_prefill": outlived,
    }


def measure(
    start: Start, long_prompt: str, repeats: int, reset: Callable[[], None]
) -> dict[str, Any]:
    """Lone prefill, then the loaded run, ``repeats`` times; medians and every sample."""
    lone, loaded = [], []
    start("Hello there!", WARM_TOKENS)[0].wait()  # warm-up
    for repeat in range(repeats):
        reset()
        mark(f"repeat {repeat + 1}: lone prefill")
        lone.append(lone_prefill(start, long_prompt))
        reset()
        loaded.append(under_load(start, long_prompt))
        reset()
        lone.append(lone_prefill(start, long_prompt))
        bench.log(
            f"  repeat {repeat + 1}/{repeats}: lone {lone[-2]:.3f}/{lone[-1]:.3f} s, {loaded[-1]}"
        )
    lone_s = statistics.median(lone)
    out: dict[str, Any] = {"lone_prefill_s": round(lone_s, 4)}
    for key in ("ttft_s", "worst_gap_s", "p95_gap_s", "median_gap_before_s"):
        values = [s[key] for s in loaded if s[key] is not None]
        out[key] = round(statistics.median(values), 4) if values else None
    out["ttft_over_lone"] = bench.ratio(out["ttft_s"], lone_s)
    out["targets"] = bench.targets(out, LIMITS_MAX, at_least=False)
    return out | {"lone_samples_s": [round(x, 4) for x in lone], "samples": loaded}


def run_llamax(
    model: Path, long_text: str, repeats: int, max_step_ms: float | None, *, adaptive: bool = False
) -> dict[str, Any]:
    threads: dict[str, Any] = (
        {"adapt_threads": True} if adaptive else {"n_threads": bench.N_THREADS}
    )
    options = {"n_ctx": N_CTX, "n_seq_max": N_SEQ_MAX, "max_step_ms": max_step_ms, **threads}
    with llamax.Context(model, **(options | LLAMAX_OPTIONS)) as ctx:
        out = measure(llamax_driver(ctx), long_text, repeats, ctx.clear_cache)
        stats = ctx.stats()
        return out | {
            "n_threads_after": stats.n_threads,
            "num_thread_changes": stats.num_thread_changes,
        }


def run_server(binary: Path, model: Path, long_text: str, repeats: int) -> dict[str, Any]:
    n_ctx = SERVER_SLOTS * SERVER_CELLS_PER_SLOT
    server = LlamaServerPeer(binary, model, n_parallel=SERVER_SLOTS, n_ctx=n_ctx)
    try:
        return measure(server_driver(server), long_text, repeats, lambda: None)
    finally:
        server.close()


def long_prompt(model: Path, target: int) -> tuple[str, int]:
    """The long prompt (ChatML user turn, about ``target`` tokens) and its token count."""
    with llamax.Context(model, n_ctx=256, n_seq_max=1, n_threads=bench.N_THREADS) as ctx:

        def count(text: str) -> int:
            return len(ctx.tokenize(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"))

        text = bench.text_of_tokens(count, target, HEAD, "Note")
        return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n", count(text)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    bench.add_common_args(parser)
    parser.add_argument("--repeats", type=int, default=1, help="loaded runs per system")
    parser.add_argument("--llama-server", help="also run llama-server: a binary, or 'auto'")
    parser.add_argument("--long-tokens", type=int, default=LONG_TOKENS, help="long prompt size")
    parser.add_argument("--skip-llamax", action="store_true", help="run llama-server only")
    parser.add_argument(
        "--skip-fixed", action="store_true", help="skip llamax with fixed n_batch chunks"
    )
    parser.add_argument("--trace", type=Path, help="write llamax's measured steps here (JSON)")
    parser.add_argument(
        "--busy", type=int, default=0, help="Python busy loops running beside every system"
    )
    parser.add_argument(
        "--adaptive",
        action="store_true",
        help="also run llamax with its default threads, adapting to the load (issue 37)",
    )
    parser.add_argument(
        "--max-step-ms", type=float, default=250.0, help="llamax's max_step_ms (250, the default)"
    )
    parser.add_argument(
        "--llamax-option", action="append", default=[], metavar="NAME=JSON",
        help="one more llamax.Context option for llamax's runs, its value as JSON "
        "(reproducible=true, kv_type_v='\"q8_0\"'); repeatable",
    )  # fmt: skip
    args = parser.parse_args(argv)
    for option in args.llamax_option:
        name, _, value = option.partition("=")
        LLAMAX_OPTIONS[name] = json.loads(value)
    global TRACE
    TRACE = StepTrace() if args.trace else None
    model = bench.model_path(args.model)
    binary = default_llama_server() if args.llama_server == "auto" else args.llama_server
    if args.llama_server and binary is None:
        parser.error("no llama-server found: build it with benchmarks/peers.sh")
    load = bench.load_average()
    with bench.stdout_to_stderr() as stdout:
        text, n_tokens = long_prompt(model, args.long_tokens)
        bench.log(f"long prompt: {n_tokens} tokens")
        systems: dict[str, Any] = {}
        with bench.busy_processes(args.busy, "loop"):
            if not args.skip_llamax:
                bench.log("llamax (time-budgeted steps, the default) ...")
                mark("llamax")
                systems["llamax"] = run_llamax(model, text, args.repeats, args.max_step_ms)
            if args.adaptive and not args.skip_llamax:
                bench.log("llamax adapting its threads (the default threads) ...")
                mark("llamax_adaptive")
                systems["llamax_adaptive"] = run_llamax(
                    model, text, args.repeats, args.max_step_ms, adaptive=True
                )
            if not (args.skip_llamax or args.skip_fixed):
                bench.log("llamax with fixed n_batch chunks (max_step_ms=None) ...")
                mark("llamax_fixed_chunks")
                systems["llamax_fixed_chunks"] = run_llamax(model, text, args.repeats, None)
            if binary:
                bench.log("llama-server ...")
                systems["llama_server"] = run_server(Path(binary), model, text, args.repeats)
        workload = {
            "busy_loops": args.busy,
            "long_prompt_tokens": n_tokens,
            "streams": N_STREAMS,
            "stream_max_tokens": STREAM_MAX_TOKENS,
            "warm_tokens": WARM_TOKENS,
        }
        args.model, args.llama_server = model, binary
        server_args = f"-np {SERVER_SLOTS} -c {SERVER_SLOTS * SERVER_CELLS_PER_SLOT} -t 2"
        config = bench.base_config(
            args,
            load,
            n_ctx=N_CTX,
            n_seq_max=N_SEQ_MAX,
            llama_server_args=server_args,
            llamax_options=LLAMAX_OPTIONS,
        )
        ratios = {}
        if "llamax" in systems and "llama_server" in systems:
            for key in ("worst_gap_s", "p95_gap_s", "ttft_s", "lone_prefill_s"):
                ratios[f"{key}_llamax_over_llama_server"] = bench.ratio(
                    systems["llamax"][key], systems["llama_server"][key]
                )
        report = {"config": config, "workload": workload, "systems": systems, "ratios": ratios}
        bench.emit_report(report, stdout, args.json_out)
    if TRACE is not None:
        args.trace.write_text(json.dumps(TRACE.rows, indent=0) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
