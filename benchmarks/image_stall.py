"""Does an image freeze the streams already running? (issue 42)

A request with an image is read, tokenized and **encoded on the caller's thread** (off the
engine's step), then its embeddings are prefilled in the step's chunks like a prompt. This
measures what a stream that is already generating sees meanwhile, against what it sees
while a text prompt of the same number of positions is prefilled:

- a stream generates ``--max-tokens`` greedy tokens on SmolLM2; after its 60th token a
  second thread sends either an image request (a random-weight projector of a real ViT's
  size: ``janus_pro`` head, 448x448 input, 12 blocks 768 wide, 784 image positions, ~330
  MB; written once under ``~/.cache/llamax/vision``) or a text prompt of as many positions;
- reported per run: the stream's median gap between tokens before (``base_p50_ms``) and
  while the second request is in flight until its first token (``window_p50_ms``,
  ``window_max_ms``, ``window_tokens``), and that request's time to its first token.

``python benchmarks/image_stall.py [--repeats 3] [--json-out FILE]`` (needs the ``bench``
extra: ``gguf``). JSON on stdout, with the machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from _common import N_THREADS, emit_report, load_script, log

import llamax

SIZE, WIDTH, BLOCKS, FF, HEADS = 448, 768, 12, 3072, 12  # a ViT-B/16 at 448 px
STREAM = "<|im_start|>user\nCount slowly to a thousand.<|im_end|>\n<|im_start|>assistant\n"
INJECT_AT = 60


def big_projector() -> Path:
    """The real-size random projector, written once (its file name says its shape)."""
    script = load_script("make_vision_model")
    out = Path.home() / ".cache/llamax/vision" / f"janus_pro_{SIZE}px_{BLOCKS}x{WIDTH}.gguf"
    if not out.exists():
        script.IMAGE_SIZE, script.N_EMBD, script.N_LAYER = SIZE, WIDTH, BLOCKS
        script.N_FF, script.N_HEAD = FF, HEADS
        out.parent.mkdir(parents=True, exist_ok=True)
        part = out.with_suffix(".part")
        script.write_vision_model(part, projector="janus_pro")
        part.rename(out)
    return out


def text_prompt(ctx: llamax.Context, positions: int, seed: int) -> str:
    """A user turn of about ``positions`` tokens, unlike any other run's."""
    words, text = 0, ""
    while len(ctx.tokenize(text)) < positions:
        words += 8
        text = "<|im_start|>user\n" + " ".join(f"w{seed}x{i}" for i in range(words))
    return text + "<|im_end|>\n<|im_start|>assistant\n"


def one_run(ctx: llamax.Context, kind: str, seed: int, max_tokens: int) -> dict[str, Any]:
    script = load_script("make_vision_model")
    first = llamax.SamplingParams(max_tokens=1, temperature=0)
    if kind == "image":
        image = llamax.Image(script.pixels(seed, SIZE, SIZE))
        other: Any = [
            "<|im_start|>user\n",
            image,
            " What is it?<|im_end|>\n<|im_start|>assistant\n",
        ]
    else:
        other = text_prompt(ctx, SIZE // 16 * (SIZE // 16) + 12, seed)
    ttft: list[float] = []

    def send() -> None:
        start = time.perf_counter()
        ctx.add_request(other, first).result()
        ttft.append(time.perf_counter() - start)

    times: list[float] = []
    sender = threading.Thread(target=send)
    params = llamax.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for _ in ctx.add_request(STREAM, params):
        times.append(time.perf_counter())
        if len(times) == INJECT_AT:
            sender.start()
    sender.join()
    gaps = np.diff(times) * 1e3
    injected = times[INJECT_AT - 1]
    window = [g for t, g in zip(times[1:], gaps, strict=True) if injected < t <= injected + ttft[0]]
    return {
        "kind": kind,
        "base_p50_ms": round(float(np.median(gaps[10 : INJECT_AT - 1])), 1),
        "window_p50_ms": round(float(np.median(window)), 1) if window else None,
        "window_max_ms": round(float(max(window)), 1) if window else None,
        "window_tokens": len(window),
        "other_ttft_s": round(ttft[0], 2),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args(argv)
    projector = big_projector()
    log(f"projector {projector} ({projector.stat().st_size >> 20} MB)")
    ctx = llamax.Context(
        llamax.default_model_path(),
        mmproj=str(projector),
        n_ctx=4096,
        n_seq_max=4,
        n_threads=N_THREADS,
    )
    runs: list[dict[str, Any]] = []
    try:
        for repeat in range(args.repeats):
            for kind in ("image", "text"):
                run = one_run(ctx, kind, 2 * repeat + (kind == "text"), args.max_tokens)
                log(str(run))
                runs.append(run)
                ctx.clear_cache()
    finally:
        ctx.close()
    summary = {
        kind: {
            name: statistics.median(r[name] for r in runs if r["kind"] == kind)
            for name in ("base_p50_ms", "window_p50_ms", "window_max_ms", "other_ttft_s")
        }
        for kind in ("image", "text")
    }
    report = {
        "config": {**vars(args), "n_threads": N_THREADS, "projector": projector.name},
        "runs": runs,
        "medians": summary,
    }
    emit_report(report, sys.stdout, args.json_out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
