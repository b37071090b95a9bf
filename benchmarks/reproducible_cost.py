"""Where the reproducible mode's cost on W1 goes (issue 60): W1 (N distinct short prompts,
64 greedy tokens each, 2 threads, n_batch 1024) on the default mode, the default mode with
flash attention off, and the reproducible mode (with its F16 KV cache, and with a ``q8_0``
V or a BF16 V, whose flash attention ggml computes row by row), alternated; every run
recorded, with its ``llama_decode`` calls (how many, the prompt-chunk and the one-token-row
decodes, their seconds and tokens), and per mode the time to the first token of one lone
``--prefill-tokens`` prompt (0: none).

    python benchmarks/reproducible_cost.py --repeats 3 \\
        --json-out benchmarks/results/issue60/w1-attribution-rows.json
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from typing import Any

from _common import (
    add_common_args,
    emit_report,
    filler_sentences,
    load_average,
    log,
    model_path,
    short_prompts,
)

import llamax
from llamax.backend.llama_cpp import LlamaCppBackend

MODES: dict[str, dict[str, Any]] = {
    "default": {},
    "default_flash_attn_off": {"flash_attn": False},
    "default_streams": {"kv_layout": "streams"},
    "default_streams_v_q8_0": {"kv_layout": "streams", "kv_type_v": "q8_0"},
    "reproducible": {"reproducible": True},
    "reproducible_v_q8_0": {"reproducible": True, "kv_type_v": "q8_0"},
    "reproducible_kv_q8_0": {"reproducible": True, "kv_type": "q8_0"},
    "reproducible_flash_v_bf16": {"reproducible": True, "kv_type_v": "bf16", "flash_attn": True},
}
DECODES: list[tuple[int, int, float]] = []
"""Every ``llama_decode`` while recording: (items, tokens, seconds)."""


def record_decodes() -> None:
    original = LlamaCppBackend.decode

    def timed(backend: LlamaCppBackend, items: Any, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return original(backend, items, *args, **kwargs)
        finally:
            tokens = sum(len(item.token_ids) for item in items)
            DECODES.append((len(items), tokens, time.perf_counter() - started))

    LlamaCppBackend.decode = timed  # type: ignore[method-assign]


def decode_summary() -> dict[str, Any]:
    chunks = [d for d in DECODES if d[1] > d[0]]
    rows = [d for d in DECODES if d[1] == d[0]]
    return {
        "decodes": len(DECODES),
        "chunk_decodes": len(chunks),
        "chunk_tokens": sum(d[1] for d in chunks),
        "chunk_seconds": round(sum(d[2] for d in chunks), 3),
        "row_decodes": len(rows),
        "rows": sum(d[1] for d in rows),
        "row_seconds": round(sum(d[2] for d in rows), 3),
    }


def run(path: Any, n: int, options: dict[str, Any]) -> dict[str, Any]:
    """Tokens/s of one W1 run on a fresh context (after a warm-up request)."""
    params = llamax.SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    with llamax.Context(path, n_ctx=8192, n_seq_max=n, n_batch=1024, n_threads=2, **options) as ctx:
        ctx.add_request("Warm up:", llamax.SamplingParams(max_tokens=8)).result()
        DECODES.clear()
        started = time.perf_counter()
        handles = [ctx.add_request(p, params) for p in short_prompts(n)]
        tokens = sum(len(h.result().token_ids) for h in handles)
        seconds = time.perf_counter() - started
    return {"tokens_per_s": round(tokens / seconds, 1), **decode_summary()}


def prefill(path: Any, tokens: int, options: dict[str, Any]) -> float:
    """Seconds to the first token of one ``tokens``-token prompt, alone."""
    with llamax.Context(path, n_ctx=tokens + 256, n_seq_max=1, n_batch=1024, n_threads=2,
                        **options) as ctx:  # fmt: skip
        text = "\n".join(itertools.islice(filler_sentences("Note"), tokens // 4))
        ids = ctx.tokenize(text)[:tokens]
        ctx.add_request("Warm up:", llamax.SamplingParams(max_tokens=8)).result()
        started = time.perf_counter()
        ctx.add_request(ids, llamax.SamplingParams(max_tokens=1)).result()
        return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser)
    parser.add_argument("--n", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=list(MODES),
        default=[m for m in MODES if not m.startswith("default_streams") and "kv_q8" not in m],
        help="the default_streams modes (the default mode pinned to streams, with a q8_0 V "
        "or not) tell the layout's and the V type's share of the cost from the mode's",
    )
    parser.add_argument("--prefill-tokens", type=int, default=2000)
    args = parser.parse_args()
    real_stdout, sys.stdout = sys.stdout, sys.stderr
    path = model_path(args.model)
    record_decodes()
    samples: dict[str, dict[int, list[float]]] = {m: {n: [] for n in args.n} for m in args.modes}
    runs: list[dict[str, Any]] = []
    ttft: dict[str, list[float]] = {m: [] for m in args.modes}
    for repeat in range(args.repeats):
        for n in args.n:
            for mode in args.modes:
                load = load_average()
                result = run(path, n, MODES[mode])
                samples[mode][n].append(result["tokens_per_s"])
                runs.append({"repeat": repeat, "n": n, "mode": mode, "load": load, **result})
                log(f"N={n} {mode}: {result}")
        for mode in args.modes if args.prefill_tokens else ():
            ttft[mode].append(round(prefill(path, args.prefill_tokens, MODES[mode]), 3))
            log(f"prefill {args.prefill_tokens} {mode}: {ttft[mode][-1]} s")
    report = {
        "samples_tokens_per_s": samples,
        "prefill_tokens": args.prefill_tokens,
        "prefill_seconds": ttft,
        "runs": runs,
        "modes": {m: MODES[m] for m in args.modes},
    }
    emit_report(report, real_stdout, args.json_out)


if __name__ == "__main__":
    main()
