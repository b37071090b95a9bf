"""Throughput beside busy processes: llamax adapting its threads against fixed threads.

W1 (``--requests`` distinct short prompts, default 16, ``--tokens`` greedy tokens each,
default 64, end-of-generation banned) is run quiet and beside busy processes: one Python
busy loop per entry of ``--busy`` (default: 0, cores - 1 and cores), each started before
the load's runs and killed after them by this script (``--neighbor model``: a llamax
process decoding 4 streams with ``n_threads=<cores>`` instead, whose workers spin too).
Systems, each a fresh
``llamax.Context(n_ctx=4096, n_seq_max=requests)`` per load, warmed up by one short run:

``llamax_adaptive``
    ``adapt_threads=True`` with ``n_threads`` left to llamax (every core, fewer while other
    processes hold some; docs/performance.md).
``llamax_fixed``
    ``n_threads=<cores>``: today's default threads, used as given (no adaptation).
``llamax_one_thread``
    ``n_threads=1``: what the issue's target compares against (quiet).
``llama_server``
    llama-server from the vendored llama.cpp (``--llama-server``, default: the binary
    ``peers.sh`` built, skipped when there is none), ``-np <requests> -t <cores>``, the same
    W1 over its ``/completion``, one client thread per request; started once, before the
    loads.

The score is generated tokens / wall time from the first submit to the last result; each
repeat runs every system, the order rotating. The report holds the medians of the repeats,
every repeat, the ``stats()`` thread fields after each system's runs, and the ratios the
targets name (``adaptive_busy1_over_one_thread_quiet`` >= 0.8 beside one busy process,
``adaptive_quiet_over_fixed_quiet`` >= 0.98, ``adaptive_busy1_over_llama_server_busy1``
>= 5). ``--quick``: 1 repeat of 16 x 16 tokens.

::

    .venv/bin/python benchmarks/contention.py --repeats 3 --json-out out.json
    .venv/bin/python benchmarks/contention.py --quick
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from _common import (
    CORES,
    add_common_args,
    base_config,
    busy_processes,
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
from _peers import LlamaServerPeer, default_llama_server

import llamax

SYSTEMS: dict[str, dict[str, Any]] = {
    "llamax_adaptive": {"adapt_threads": True},
    "llamax_fixed": {"n_threads": CORES},
    "llamax_one_thread": {"n_threads": 1},
}


def w1(ctx: llamax.Context, prompts: list[str], tokens: int) -> float:
    """Tokens/s of one W1 run (the prefix cache cleared first)."""
    ctx.clear_cache()
    start = time.perf_counter()
    handles = [ctx.add_request(p, greedy(tokens)) for p in prompts]
    made = sum(len(h.result().token_ids) for h in handles)
    return made / (time.perf_counter() - start)


def server_w1(server: LlamaServerPeer, prompts: list[str], tokens: int) -> float:
    """Tokens/s of one W1 run on llama-server."""
    start = time.perf_counter()
    made = server.run_batch(prompts, tokens)
    return made / (time.perf_counter() - start)


def run_load(
    args: argparse.Namespace, model: str, busy: int, server: LlamaServerPeer | None
) -> dict[str, Any]:
    prompts = short_prompts(args.requests)
    names = list(SYSTEMS) + (["llama_server"] if server is not None else [])
    samples: dict[str, list[float]] = {name: [] for name in names}
    threads: dict[str, dict[str, Any]] = {}
    with busy_processes(busy, args.neighbor):
        contexts = {
            name: llamax.Context(model, n_ctx=4096, n_seq_max=args.requests, **options)
            for name, options in SYSTEMS.items()
        }
        try:
            for ctx in contexts.values():
                w1(ctx, prompts[:2], 4)  # warm-up
            if server is not None:
                server_w1(server, prompts[:2], 4)
            for repeat in range(args.repeats):
                for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
                    if name == "llama_server":
                        assert server is not None
                        samples[name].append(server_w1(server, prompts, args.tokens))
                    else:
                        samples[name].append(w1(contexts[name], prompts, args.tokens))
                    log(f"busy={busy} {name}: {samples[name][-1]:.1f} tok/s")
            for name, ctx in contexts.items():
                stats = ctx.stats()
                threads[name] = {
                    "n_threads": stats.n_threads,
                    "is_contended": stats.is_contended,
                    "num_thread_changes": stats.num_thread_changes,
                }
        finally:
            for ctx in contexts.values():
                ctx.close()
    return {
        "load_average": load_average(),
        "median_tokens_per_s": {n: statistics.median(s) for n, s in samples.items()},
        "samples": samples,
        "threads_after": threads,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--busy", type=int, nargs="*", default=sorted({0, CORES - 1, CORES}))
    parser.add_argument("--quick", action="store_true", help="1 repeat of 16 x 16 tokens")
    parser.add_argument(
        "--neighbor", choices=["loop", "model"], default="loop",
        help="what a busy process runs: a Python busy loop, or llamax decoding (fixed threads)",
    )  # fmt: skip
    parser.add_argument(
        "--llama-server", default="auto",
        help="llama-server binary, 'auto' (the one peers.sh built, if any) or 'none'",
    )  # fmt: skip
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.tokens = 1, 16
    load_at_start = load_average()
    with stdout_to_stderr() as stdout:
        model = str(model_path(args.model))
        choice = args.llama_server
        binary = (
            None
            if choice == "none"
            else default_llama_server()
            if choice == "auto"
            else Path(choice)
        )
        server = (
            LlamaServerPeer(binary, Path(model), n_parallel=args.requests, n_ctx=4096)
            if binary is not None
            else None
        )
        try:
            loads = {f"busy{b}": run_load(args, model, b, server) for b in args.busy}
        finally:
            if server is not None:
                server.close()
        med = {k: v["median_tokens_per_s"] for k, v in loads.items()}
        get = lambda load, name: med.get(load, {}).get(name)  # noqa: E731
        ratios = {
            "adaptive_busy1_over_one_thread_quiet": ratio(
                get("busy1", "llamax_adaptive"), get("busy0", "llamax_one_thread")
            ),
            "adaptive_quiet_over_fixed_quiet": ratio(
                get("busy0", "llamax_adaptive"), get("busy0", "llamax_fixed")
            ),
            "adaptive_busy1_over_llama_server_busy1": ratio(
                get("busy1", "llamax_adaptive"), get("busy1", "llama_server")
            ),
            **{
                f"adaptive_over_fixed_{load}": ratio(
                    get(load, "llamax_adaptive"), get(load, "llamax_fixed")
                )
                for load in loads
            },
        }
        report = {
            "config": base_config(args, load_at_start, cores=CORES, n_ctx=4096),
            "workload": {"requests": args.requests, "max_tokens": args.tokens},
            "loads": loads,
            "ratios": ratios,
            "targets": targets(
                ratios,
                {
                    "adaptive_busy1_over_one_thread_quiet": 0.8,
                    "adaptive_quiet_over_fixed_quiet": 0.98,
                    "adaptive_busy1_over_llama_server_busy1": 5.0,
                },
                at_least=True,
            ),
        }
        emit_report(report, stdout, args.json_out)


if __name__ == "__main__":
    main()
