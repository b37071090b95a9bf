"""Speculative prompt-lookup decoding: faster output when it copies from the prompt.

With ``speculative=llamax.PromptLookup()`` on the context, each decoding sequence looks
its last few tokens up in its own prompt and output and appends the tokens that followed
there, as a draft, to its entry of the batched step; one decode checks them all, and the
sequence keeps the ones its own sampler confirms. The output is the same as without
speculation; only the speed changes, and only when the text repeats what came before
(quoting, code edits, reformatting). ``Usage.drafted_tokens`` and
``Usage.accepted_tokens`` say how it went.

    python examples/speculative.py
"""

from __future__ import annotations

import time

import llamax

PASSAGE = (
    "The lighthouse at Point Carrow was built in 1871 from granite quarried on the island "
    "itself. Its first keeper, Thomas Avery, kept a log of every ship that passed, and the "
    "log survives in the county archive. The light was first fuelled by whale oil, then by "
    "paraffin, and was finally electrified in 1934. The station was automated in 1987, and "
    "the last keepers left in the spring of that year."
)
PROMPT = (
    "<|im_start|>user\nRead this passage:\n\n"
    f"{PASSAGE}\n\nQuote the passage above word for word.<|im_end|>\n<|im_start|>assistant\n"
)


def timed(ctx: llamax.Context, params: llamax.SamplingParams) -> tuple[llamax.Completion, float]:
    """One completion of ``PROMPT`` and its wall time (the prefix cache cleared first)."""
    ctx.clear_cache()
    start = time.perf_counter()
    completion = ctx.add_request(PROMPT, params).result(timeout=120)
    return completion, time.perf_counter() - start


def main() -> None:
    # Every request drafts unless it says otherwise (the default is off: speculative=None).
    with llamax.Context(n_ctx=2048, speculative=llamax.PromptLookup()) as ctx:
        ctx.add_request("Hello", llamax.SamplingParams(max_tokens=4)).result(timeout=60)  # warm-up
        # speculative=False turns it off for one request (True turns it on, and a
        # PromptLookup(max_draft=..., ngram_max=..., ngram_min=...) picks the settings).
        plain_params = llamax.SamplingParams(max_tokens=200, temperature=0.0, speculative=False)
        plain, plain_s = timed(ctx, plain_params)
        fast, fast_s = timed(ctx, llamax.SamplingParams(max_tokens=200, temperature=0.0))

        usage = fast.usage
        print(fast.text)
        print(
            f"\nwith speculation:    {usage.completion_tokens} tokens in {fast_s:.2f} s; "
            f"{usage.accepted_tokens} of {usage.drafted_tokens} drafted tokens accepted"
        )
        print(f"without speculation: {plain.usage.completion_tokens} tokens in {plain_s:.2f} s")
        print(f"same tokens: {fast.token_ids == plain.token_ids}")
        stats = ctx.stats()
        drafts = stats.speculation
        print(f"context: {drafts.num_accepted_tokens}/{drafts.num_drafted_tokens} drafts accepted")


if __name__ == "__main__":
    main()
