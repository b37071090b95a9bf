"""Images in the batch: 16 concurrent chats, each with one image and a short question.

A third of the chats (5 of 16) share one image; the others each have their own. Every chat
is a ChatML prompt with the image between the user turn's opening and its question, and
generates ``--max-tokens`` greedy tokens (end of generation banned). The model is SmolLM2
(or ``--model``) with a random projector of ``scripts/make_vision_model.py``
(``--projector``: ``gemma3``, non-causal image attention, or ``janus_pro``, causal); each
image is a 64x64 PNG, the projector's input size, sent as the same bytes to both systems.

Systems, a fresh one for every repeat (nothing cached from the last: llamax keeps image
embeddings and prefixes, llama-server its slots' prompts), alternated:

``llamax``
    ``llamax.Context(model, mmproj=..., n_seq_max=16)``; the 16 requests submitted at once,
    each from its own thread (``add_request([head, Image(png), question])``: the image is
    read and encoded on the caller's thread, as ``llamax serve`` does off its event loop),
    streamed.
``llama_server``
    ``llama-server --mmproj ... -np 16`` of the same vendored llama.cpp (``peers.sh``), its
    default prompt cache on, 16 concurrent streamed ``/completion`` requests with
    ``{"prompt_string": ..., "multimodal_data": [base64]}`` prompts (the media marker its
    ``/props`` names, random per start, where the image goes).

Reported per system, each repeat and the median: ``tok_s`` (generated tokens over the
time from the first request to the last token), ``ttft_p50_s``, ``ttft_p95_s``; for llamax
also the images encoded and the prompt tokens served from cache. Targets: llamax >= 1.0x
llama-server on throughput and on p50 TTFT.

::

    .venv/bin/python benchmarks/images.py --json-out images.json
"""

from __future__ import annotations

import argparse
import base64
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _common import (
    TokenTimes,
    add_common_args,
    base_config,
    emit_report,
    greedy,
    in_fresh_thread,
    load_average,
    load_script,
    log,
    model_path,
    percentile,
    ratio,
    stdout_to_stderr,
    targets,
)
from _peers import LlamaServerPeer, default_llama_server

import llamax

N_CHATS = 16
N_SHARED = N_CHATS // 3  # chats that share image 0
CELLS_PER_CHAT = 256
SYSTEM = "You are a careful assistant who describes pictures briefly."
QUESTIONS = [
    "What is in this picture?",
    "Describe the colours you see.",
    "Is there a person here?",
    "What mood does this image have?",
    "Name one object in the image.",
    "Where might this photo be taken?",
    "Is it day or night?",
    "Count the shapes, roughly.",
]
LLAMAX, SERVER = "llamax", "llama_server"
Result = dict[str, Any]


vision_model = load_script("make_vision_model")  # the projector, and test images


def chats() -> list[tuple[str, bytes, str]]:
    """Each chat's text before the image, the image (PNG bytes) and the text after it."""
    head = f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n"
    out = []
    for i in range(N_CHATS):
        image = 0 if i < N_SHARED else i
        picture = vision_model.png(vision_model.pixels(1000 + image, 64, 64))
        tail = f"\n{QUESTIONS[i % len(QUESTIONS)]}<|im_end|>\n<|im_start|>assistant\n"
        out.append((head, picture, tail))
    return out


def summarize(first: list[float], tokens: int, start: float, end: float) -> Result:
    return {
        "tok_s": round(tokens / (end - start), 2),
        "ttft_p50_s": round(percentile(first, 0.5), 4),
        "ttft_p95_s": round(percentile(first, 0.95), 4),
        "generated_tokens": tokens,
        "wall_s": round(end - start, 3),
    }


def run_llamax(model: Path, projector: Path, max_tokens: int) -> Result:
    """One fresh context, the 16 chats at once."""
    with llamax.Context(
        model, mmproj=projector, n_seq_max=N_CHATS, n_ctx=N_CHATS * CELLS_PER_CHAT
    ) as ctx:
        params = greedy(max_tokens)
        work = chats()
        ctx.add_request([work[-1][0], llamax.Image(work[-1][1]), "Hi"], greedy(1)).result()
        ctx.clear_cache()  # warmed up (graphs, the projector) with nothing left to reuse
        before = ctx.stats()
        times: list[TokenTimes | None] = [None] * N_CHATS
        go = threading.Event()

        def submit(i: int) -> None:
            head, picture, tail = work[i]
            go.wait()
            handle = ctx.add_request([head, llamax.Image(picture), tail], params)
            times[i] = TokenTimes(handle)

        threads = [threading.Thread(target=submit, args=(i,)) for i in range(N_CHATS)]
        for thread in threads:
            thread.start()
        start = time.perf_counter()
        go.set()
        for thread in threads:
            thread.join()
        arrivals = [t.wait() for t in times if t is not None]
        after = ctx.stats()
    end = max(a[-1] for a in arrivals)
    result = summarize([a[0] - start for a in arrivals], sum(map(len, arrivals)), start, end)
    result["cached_tokens"] = after.num_cached_tokens - before.num_cached_tokens
    return result


def run_server(binary: Path, model: Path, projector: Path, max_tokens: int) -> Result:
    """One fresh llama-server, the 16 chats at once over /completion."""
    peer = LlamaServerPeer(
        binary,
        model,
        n_parallel=N_CHATS,
        n_ctx=N_CHATS * CELLS_PER_CHAT,
        extra_args=["--mmproj", str(projector), "--no-warmup"],
        cache_prompt=True,
    )
    try:
        work = chats()
        marker = str(peer.props()["media_marker"])
        first = [0.0] * N_CHATS
        last = [0.0] * N_CHATS
        counts = [0] * N_CHATS
        errors: list[BaseException] = []
        go = threading.Event()

        def one(i: int) -> None:
            head, picture, tail = work[i]
            prompt = {
                "prompt_string": head + marker + tail,
                "multimodal_data": [base64.b64encode(picture).decode()],
            }
            go.wait()
            try:
                for made in peer.stream_progress(prompt, max_tokens):
                    now = time.perf_counter()
                    if made and not first[i]:
                        first[i] = now
                    counts[i], last[i] = made, now
            except BaseException as exc:  # re-raised below
                errors.append(exc)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(N_CHATS)]
        for thread in threads:
            thread.start()
        start = time.perf_counter()
        go.set()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
    finally:
        peer.close()
    return summarize([f - start for f in first], sum(counts), start, max(last))


def median_of(samples: list[Result]) -> Result:
    keys = ("tok_s", "ttft_p50_s", "ttft_p95_s")
    return {k: round(statistics.median(s[k] for s in samples), 4) for k in keys}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser)
    parser.add_argument("--projector", choices=["gemma3", "janus_pro"], default="gemma3")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--llama-server", type=Path, help="binary (default: peers.sh's build)")
    parser.add_argument("--no-llama-server", action="store_true")
    args = parser.parse_args()
    load_at_start = load_average()
    model = model_path(args.model)
    projector = vision_model.cached_vision_model(projector=args.projector)
    binary = None if args.no_llama_server else args.llama_server or default_llama_server()
    runs: dict[str, Callable[[], Result]] = {
        LLAMAX: lambda: in_fresh_thread(lambda: run_llamax(model, projector, args.max_tokens))
    }
    if binary is not None:
        runs[SERVER] = lambda: run_server(binary, model, projector, args.max_tokens)
    samples: dict[str, list[Result]] = {name: [] for name in runs}
    with stdout_to_stderr() as stdout:
        for repeat in range(args.repeats):
            for name, run in runs.items():
                result = run()
                samples[name].append(result)
                log(f"repeat {repeat + 1} {name}: {result}")
        systems = {name: {"median": median_of(s), "samples": s} for name, s in samples.items()}
        report: dict[str, Any] = {
            "config": base_config(
                args,
                load_at_start,
                n_chats=N_CHATS,
                n_shared_image=N_SHARED,
                projector_path=str(projector),
                llama_server=str(binary) if binary else None,
            ),
            "systems": systems,
        }
        if SERVER in systems:
            ours, theirs = systems[LLAMAX]["median"], systems[SERVER]["median"]
            report["llamax_over_llama_server"] = {
                "tok_s": ratio(ours["tok_s"], theirs["tok_s"]),
                "ttft_p50": ratio(theirs["ttft_p50_s"], ours["ttft_p50_s"]),
                "ttft_p95": ratio(theirs["ttft_p95_s"], ours["ttft_p95_s"]),
            }
            over = report["llamax_over_llama_server"]
            report["targets"] = targets(
                {"tok_s": over["tok_s"], "ttft_p50": over["ttft_p50"]},
                {"tok_s": 1.0, "ttft_p50": 1.0},
                at_least=True,
            )
        emit_report(report, stdout, args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
