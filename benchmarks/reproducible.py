"""Which rules a reproducible mode needs (issue 60): is a reply's every token and logprob
bit-identical to a cold run of the same prompt when the prompt is chunked at other points,
when a chunk shares its decode with other sequences' decode rows, when a prefix is reused
from the KV cache or the host-RAM tier (at a chunk boundary or not, from a prompt or from a
reply), or when the thread count differs?

Every case runs one prompt (token ids) greedily with logprobs in a context with
``kv_layout="streams"``, ``max_step_ms=None`` (fixed ``n_batch`` chunks) and fixed threads,
and compares it with a *reference*: the same prompt alone on a fresh context, prefix cache
off, chunked at multiples of ``--chunk``. Output: JSON (machine first), one entry a case:
``equal`` (tokens and every logprob bit-equal), ``tokens_equal``, ``max_abs_diff`` (nats).

    python benchmarks/reproducible.py --json-out benchmarks/results/issue60/rules.json
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _common import add_common_args, emit_report, filler_sentences, log, model_path

import llamax

TIMEOUT = 600.0


def reply(ctx: llamax.Context, prompt: Sequence[int], max_tokens: int) -> dict[str, Any]:
    """The greedy reply to ``prompt``: its token ids and logprobs."""
    params = llamax.SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=1
    )
    done = ctx.add_request(list(prompt), params).result(TIMEOUT)
    assert done.logprobs is not None
    return {"tokens": list(done.token_ids), "logprobs": [lp.logprob for lp in done.logprobs]}


def compare(name: str, got: dict[str, Any], ref: dict[str, Any], **about: Any) -> dict[str, Any]:
    """A case's verdict against its reference."""
    diffs = [abs(a - b) for a, b in zip(got["logprobs"], ref["logprobs"], strict=False)]
    first = next((i for i, d in enumerate(diffs) if d), None)
    out = {
        "case": name,
        "equal": got == ref,
        "tokens_equal": got["tokens"] == ref["tokens"],
        "max_abs_diff": max(diffs, default=0.0),
        "first_diff_at": first,
        **about,
    }
    log(f"{name}: equal={out['equal']} max_abs_diff={out['max_abs_diff']:.3g}")
    return out


class Bench:
    def __init__(
        self,
        model: Path,
        threads: int,
        chunk: int,
        max_tokens: int,
        flash_attn: bool | None,
        kv_type_v: str | None = None,
    ) -> None:
        self.flash_attn = flash_attn
        self.kv_type_v = kv_type_v
        self.model = model
        self.threads = threads
        self.chunk = chunk
        self.max_tokens = max_tokens

    def context(self, **options: Any) -> llamax.Context:
        base: dict[str, Any] = {
            "n_ctx": 8192,
            "n_seq_max": 8,
            "n_ctx_seq": 1024,
            "kv_layout": "streams",
            "max_step_ms": None,
            "n_batch": self.chunk,
            "n_threads": self.threads,
            "prefix_cache": False,
            "calibrate": False,
            "flash_attn": self.flash_attn,
        }
        if self.kv_type_v is not None:
            base["kv_type_v"] = self.kv_type_v
        base.update(options)
        return llamax.Context(self.model, **base)

    def cold(self, prompt: Sequence[int], **options: Any) -> dict[str, Any]:
        with self.context(**options) as ctx:
            return reply(ctx, prompt, self.max_tokens)


def prompts(ctx: llamax.Context) -> tuple[list[int], list[int], list[int]]:
    """A long shared head and two tails: ``head + a`` and ``head + b`` diverge right after
    ``head``."""
    lines = filler_sentences()
    text = "\n".join(next(lines) for _ in range(40))
    head = ctx.tokenize(text)
    a = ctx.tokenize("\nQuestion: what does the first guideline say? Answer:", add_special=False)
    b = ctx.tokenize("\nQuestion: which guideline is the longest? Answer:", add_special=False)
    return head, a, b


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=64, help="the reference's chunk size")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(
        "--flash-attn",
        choices=("auto", "on", "off"),
        default="auto",
        help="flash attention in every context (auto: llama.cpp decides)",
    )
    parser.add_argument(
        "--kv-type-v",
        default=None,
        help="the V cache's type in every context (q8_0 with --flash-attn on: ggml's "
        "row-by-row flash attention)",
    )
    args = parser.parse_args()
    real_stdout, sys.stdout = sys.stdout, sys.stderr
    path = model_path(args.model)
    flash_attn = {"auto": None, "on": True, "off": False}[args.flash_attn]
    bench = Bench(path, args.threads, args.chunk, args.max_tokens, flash_attn, args.kv_type_v)
    c = args.chunk
    with bench.context() as probe:
        head, a, b = prompts(probe)
    # a head of 5.5 chunks: a reuse of the whole head is not at a boundary
    head_off = head[: 5 * c + c // 2]
    head_on = head[: 5 * c]
    p_a, p_b = head_off + a, head_off + b
    ref_b = bench.cold(p_b)
    cases: list[dict[str, Any]] = []

    # (a) the same prompt chunked at other points
    for n_batch in (c * 8, c // 2 + 1, 100, c + 8):
        got = bench.cold(p_b, n_batch=n_batch)
        cases.append(compare(f"a: chunks of {n_batch}", got, ref_b, group="chunking"))
    got = bench.cold(p_b, n_batch=c * 8, n_ubatch=c)
    cases.append(compare(f"a: n_batch {c * 8}, n_ubatch {c}", got, ref_b, group="chunking"))
    got = bench.cold(p_b, n_batch=c * 8, n_ubatch=c // 2)
    cases.append(compare(f"a: n_batch {c * 8}, n_ubatch {c // 2}", got, ref_b, group="chunking"))

    # (b) a prompt chunk in the same decode as other sequences' decode rows: 3 sequences
    # decode while it prefills; n_batch = chunk + 3 so the budget keeps its chunks at c
    with bench.context(n_batch=c + 3) as ctx:
        params = llamax.SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        others = [ctx.add_request(f"Story {i}:", params) for i in range(3)]
        streams = [iter(h) for h in others]
        for it in streams:
            next(it)  # each other sequence has decoded a token: all three are decoding
        got = reply(ctx, p_b, bench.max_tokens)
        steps = ctx.stats()
        for h in others:
            h.cancel()
    cases.append(
        compare(
            "b: chunks of 64 beside 3 decode rows",
            got,
            ref_b,
            group="mixing",
            num_steps=getattr(steps, "num_steps", None),
        )
    )
    # (b') its decode rows beside other decode rows only: prompt alone, then others join
    with bench.context() as ctx:
        params = llamax.SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
        stream = ctx.add_request(
            list(p_b),
            llamax.SamplingParams(
                temperature=0.0, max_tokens=bench.max_tokens, ignore_eos=True, logprobs=1
            ),
        )
        it = iter(stream)
        next(it)
        others = [ctx.add_request(f"Story {i}:", params) for i in range(5)]
        done = stream.result(TIMEOUT)
        for h in others:
            h.result(TIMEOUT)
    assert done.logprobs is not None
    got = {"tokens": list(done.token_ids), "logprobs": [lp.logprob for lp in done.logprobs]}
    cases.append(
        compare("b': decode rows beside others' prompts and rows", got, ref_b, group="mixing")
    )

    # (c) prefix reuse: from the KV cache (retained slot), at a non-boundary position
    with bench.context(prefix_cache=True) as ctx:
        reply(ctx, p_a, 4)
        got = reply(ctx, p_b, bench.max_tokens)
        cached = ctx.stats().num_cached_tokens
    cases.append(
        compare("c: KV prefix reuse, not at a boundary", got, ref_b, group="reuse", cached=cached)
    )
    # ... at a boundary
    q_a, q_b = head_on + a, head_on + b
    ref_qb = bench.cold(q_b)
    with bench.context(prefix_cache=True) as ctx:
        reply(ctx, q_a, 4)
        got = reply(ctx, q_b, bench.max_tokens)
        cached = ctx.stats().num_cached_tokens
    cases.append(
        compare("c: KV prefix reuse at a boundary", got, ref_qb, group="reuse", cached=cached)
    )
    # ... the source's prompt ended past the boundary (its last chunk was partial there)
    with bench.context(prefix_cache=True) as ctx:
        reply(ctx, head_on[: 4 * c] + head_on[4 * c : 4 * c + c // 2] + a, 4)
        got = reply(ctx, head_on[: 4 * c + c // 2] + b, bench.max_tokens)
    ref = bench.cold(head_on[: 4 * c + c // 2] + b)
    cases.append(compare("c: KV reuse of a source's partial last chunk", got, ref, group="reuse"))
    # ... from the host-RAM tier: the source is evicted by other requests (2 ids)
    with bench.context(prefix_cache=True, n_seq_max=2, n_ctx=2048, prefix_ram_bytes=1 << 28) as ctx:
        reply(ctx, q_a, 4)
        for i in range(4):
            reply(ctx, ctx.tokenize(f"Unrelated prompt {i}: " * 20), 2)
        got = reply(ctx, q_b, bench.max_tokens)
        ram = ctx.stats()
    cases.append(
        compare(
            "c: RAM tier restore at a boundary",
            got,
            ref_qb,
            group="reuse",
            ram_restored_tokens=ram.prefix_ram.num_restored_tokens,
        )
    )
    with bench.context(prefix_cache=True, n_seq_max=2, n_ctx=2048, prefix_ram_bytes=1 << 28) as ctx:
        reply(ctx, p_a, 4)
        for i in range(4):
            reply(ctx, ctx.tokenize(f"Unrelated prompt {i}: " * 20), 2)
        got = reply(ctx, p_b, bench.max_tokens)
        ram = ctx.stats()
    cases.append(
        compare(
            "c: RAM tier restore, not at a boundary",
            got,
            ref_b,
            group="reuse",
            ram_restored_tokens=ram.prefix_ram.num_restored_tokens,
        )
    )
    # ... reuse of a reply's cells (computed one by one) as the next prompt's prefix
    with bench.context(prefix_cache=True) as ctx:
        first = reply(ctx, q_a, 2 * c)
        turn2 = q_a + first["tokens"] + b
        got = reply(ctx, turn2, bench.max_tokens)
        cached = ctx.stats().num_cached_tokens
    ref = bench.cold(turn2)
    cases.append(
        compare("c: reuse of a reply's cells (next turn)", got, ref, group="reuse", cached=cached)
    )
    with bench.context(prefix_cache=True) as ctx:
        first = reply(ctx, q_a, 2 * c)
        turn2 = q_a + first["tokens"] + b
        # a reply of 2 tokens: the next turn reuses its prompt and those 2 decoded cells
        ctx.clear_cache()
        reply(ctx, q_a, 2)
        got = reply(ctx, turn2, bench.max_tokens)
    cases.append(compare("c: next turn reusing a 2-token reply's cells", got, ref, group="reuse"))

    # (d) threads
    for threads in (1, 3):
        got = bench.cold(p_b, n_threads=threads)
        cases.append(
            compare(f"d: {threads} threads vs {args.threads}", got, ref_b, group="threads")
        )
    got = bench.cold(p_b, kv_layout="unified", n_ctx=8192, n_ctx_seq=None)
    cases.append(compare("e: unified layout, alone", got, ref_b, group="layout"))

    report = {
        "model": path.name,
        "threads": args.threads,
        "chunk": c,
        "flash_attn": args.flash_attn,
        "kv_type_v": args.kv_type_v,
        "max_tokens": args.max_tokens,
        "prompt_tokens": len(p_b),
        "cases": cases,
    }
    emit_report(report, real_stdout, args.json_out)


if __name__ == "__main__":
    main()
