"""Issue 59 part 5 probe: one conversation's decode steps on the hybrid 350M shape.

The agent runs' wall time (1 conversation: 1.11x llama-server's with TTFT at 0.99x) points
at the decode steps. One sequence, a ~300-token prompt, 128 greedy tokens
(end-of-generation ignored); the decode time is from the first token to the last, per token:
- ``raw``: the raw llama.cpp loop (``benchmarks/_loops.RawLoop``), one context of
  ``n_seq_max`` sequences (unified), greedy sampler chain;
- ``llamax``: ``llamax.Context(n_ctx, n_seq_max, n_threads=2)``, default layout; the token
  iterator's times;
- ``llama_server``: ``-np n_seq_max -c n_ctx``, non-streamed ``/completion``, its own
  ``timings.predicted_per_token_ms`` (and our wall from request to reply minus its prompt_ms).
Repeats alternate the systems. Prints JSON.

Usage, from the repository root::

    .venv/bin/python .../hybrid_decode_probe.py --llama-server PATH [--n-seq-max 4] > out.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))  # benchmarks/

from _common import N_THREADS, cpu_description, filler_sentences, load_script, model_path
from _loops import RawLoop
from _peers import LlamaServerPeer

import llamax

TOKENS = 128


def prompt_text() -> str:
    sentences = filler_sentences("Note")
    return "Summarise these notes.\n" + " ".join(next(sentences) for _ in range(10))


def run_llamax(ctx: llamax.Context, prompt: str) -> dict[str, float]:
    params = llamax.SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    handle = ctx.add_request(prompt, params)
    times = [time.perf_counter() for _ in handle]
    handle.result(timeout=600)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    return {"ttft_s": times[0] - start, "decode_ms_per_token": 1000 * (times[-1] - times[0]) /
            (len(times) - 1), "median_gap_ms": 1000 * statistics.median(gaps),
            "tokens": len(times)}  # fmt: skip


def run_raw(loop: RawLoop, prompt: str) -> dict[str, float]:
    start = time.perf_counter()
    out = loop.generate([prompt], TOKENS)
    total = time.perf_counter() - start
    ttft = out.ttft_s[0]
    return {"ttft_s": ttft, "decode_ms_per_token": 1000 * (total - ttft) / (TOKENS - 1)}


def run_server(peer: LlamaServerPeer, prompt: str) -> dict[str, float]:
    body = peer._body(prompt, TOKENS, False)
    start = time.perf_counter()
    status, data = peer._request("POST", "/completion", body)
    wall = time.perf_counter() - start
    if status != 200:
        raise RuntimeError(f"llama-server answered {status}")
    timings = json.loads(data)["timings"]
    return {"ttft_s": timings["prompt_ms"] / 1000,
            "decode_ms_per_token": timings["predicted_per_token_ms"],
            "wall_minus_prompt_ms_per_token": (1000 * wall - timings["prompt_ms"]) / TOKENS,
            "tokens": timings["predicted_n"]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--llama-server", type=Path, required=True)
    parser.add_argument("--n-seq-max", type=int, default=1)
    parser.add_argument("--n-ctx", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    smol = model_path(None)
    prompt = prompt_text()
    with tempfile.TemporaryDirectory() as folder:
        path = load_script("make_memory_model").write_memory_model(
            Path(folder) / "hybrid_350m.gguf", kind="hybrid_350m", tokenizer_from=smol
        )
        samples: dict[str, list[dict[str, float]]] = {"raw": [], "llamax": [], "llama_server": []}
        for repeat in range(args.repeats):
            order = ["raw", "llamax", "llama_server"]
            order = order[repeat % 3 :] + order[: repeat % 3]
            for system in order:
                if system == "raw":
                    loop = RawLoop(path, n_ctx=args.n_ctx, n_seq_max=args.n_seq_max, n_batch=512)
                    try:
                        run_raw(loop, prompt)  # warm
                        samples[system].append(run_raw(loop, prompt))
                    finally:
                        loop.close()
                elif system == "llamax":
                    with llamax.Context(path, n_ctx=args.n_ctx, n_seq_max=args.n_seq_max,
                                        n_threads=N_THREADS) as ctx:  # fmt: skip
                        run_llamax(ctx, prompt)
                        samples[system].append(run_llamax(ctx, prompt))
                else:
                    peer = LlamaServerPeer(args.llama_server, path, n_parallel=args.n_seq_max,
                                           n_ctx=args.n_ctx)  # fmt: skip
                    try:
                        run_server(peer, prompt)
                        samples[system].append(run_server(peer, prompt))
                    finally:
                        peer.close()
                print(system, samples[system][-1], file=sys.stderr, flush=True)
    medians = {s: statistics.median(r["decode_ms_per_token"] for r in rows)
               for s, rows in samples.items()}  # fmt: skip
    print(json.dumps({"cpu": cpu_description()["model"], "n_seq_max": args.n_seq_max,
                      "n_ctx": args.n_ctx, "tokens": TOKENS, "median_decode_ms": medians,
                      "samples": samples}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
