"""One sequence's decode at ~2,700 cells on the hybrid: the raw loop against llama-server.

``raw``: ``benchmarks/_loops.RawLoop`` (llama.cpp through llama-cpp-python's bindings, no
llamax), a 2,690-token prompt then 48 greedy tokens, three times in one context (cleared
between), each ``llama_decode`` timed; the median of the last 40. ``--flash-attn 0/1``
forces flash attention (default: llama.cpp's auto). ``server``: ``llama-server -np 1``
(``--llama-server PATH``, extra arguments after ``--``), the same prompt three times without
the prompt cache, its ``timings.predicted_per_token_ms``. Prints one line a repeat.

Usage, from the repository root::

    .venv/bin/python benchmarks/results/issue59/long-context-decode/decode_at_length.py \
        raw --model hybrid_350m.gguf [--flash-attn 0] [--n-ctx 16384]
    .venv/bin/python .../decode_at_length.py server --model hybrid_350m.gguf \
        --llama-server PATH [-- -fa on]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # benchmarks/

import llama_cpp.llama_cpp as C
from _loops import RawLoop
from _peers import LlamaServerPeer

PROMPT = " ".join(f"word{i}" for i in range(700))  # 2,690 SmolLM2 tokens


def raw(model: Path, n_ctx: int, flash_attn: int | None) -> None:
    spent: list[float] = []
    decode, defaults = C.llama_decode, C.llama_context_default_params

    def timed(ctx: Any, batch: Any) -> int:
        start = time.perf_counter()
        status = int(decode(ctx, batch))
        spent.append(time.perf_counter() - start)
        return status

    def params() -> Any:
        p = defaults()
        if flash_attn is not None:
            p.flash_attn_type = flash_attn
        return p

    C.llama_decode, C.llama_context_default_params = timed, params
    loop = RawLoop(model, n_ctx=n_ctx, n_seq_max=1, n_batch=4096)
    try:
        for _ in range(3):
            loop.generate([PROMPT], 48)
            C.llama_memory_clear(C.llama_get_memory(loop.ctx), True)
            print(f"raw decode ms a token (median of the last 40): "
                  f"{1000 * statistics.median(spent[-40:]):.2f}")  # fmt: skip
        perf = C.llama_perf_context(loop.ctx)
        print(f"graphs reused {perf.n_reused} of {perf.n_eval}")
    finally:
        loop.close()


def server(model: Path, binary: Path, extra: list[str]) -> None:
    peer = LlamaServerPeer(binary, model, n_parallel=1, n_ctx=16384, cache_prompt=False,
                           extra_args=extra)  # fmt: skip
    try:
        for _ in range(3):
            body = {"prompt": PROMPT, "n_predict": 48, "temperature": 0, "ignore_eos": True,
                    "cache_prompt": False}  # fmt: skip
            request = urllib.request.Request(
                f"http://127.0.0.1:{peer.port}/completion",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=600) as reply:
                timings = json.load(reply)["timings"]
            print(f"llama-server prompt {timings['prompt_n']} tokens, decode ms a token "
                  f"{timings['predicted_per_token_ms']:.2f}")  # fmt: skip
    finally:
        peer.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("system", choices=("raw", "server"))
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--n-ctx", type=int, default=16384)
    parser.add_argument("--flash-attn", type=int, choices=(0, 1))
    parser.add_argument("--llama-server", type=Path)
    parser.add_argument("extra", nargs="*", help="llama-server arguments, after --")
    args = parser.parse_args()
    if args.system == "raw":
        raw(args.model, args.n_ctx, args.flash_attn)
    else:
        server(args.model, args.llama_server, args.extra)


if __name__ == "__main__":
    main()
