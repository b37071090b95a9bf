"""The reproducible mode: a reply does not depend on what else runs.

``reproducible=True`` makes every request's tokens and logprobs bit-identical to the same
request run alone on a fresh context with the same options, on the same machine and build
(docs/reproducible.md). Here one question runs alone on a fresh context, then again beside a
burst of other requests that share its system prompt; the two replies are compared bit for
bit, logprobs included.

    python examples/reproducible.py
"""

from __future__ import annotations

import llamax

SYSTEM = "<|im_start|>system\nYou are a museum guide. Answer in one short sentence.<|im_end|>\n"
QUESTIONS = ["What is a sundial?", "Who invented the telescope?", "What is a fossil?"]


def chatml(question: str) -> str:
    """The system prompt and one user turn in ChatML, ready for the assistant's reply."""
    return f"{SYSTEM}<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


def reply(done: llamax.Completion) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """A reply's token ids and every token's logprob."""
    assert done.logprobs is not None
    return done.token_ids, tuple(lp.logprob for lp in done.logprobs)


def context() -> llamax.Context:
    """The same options every time: that is part of the guarantee."""
    return llamax.Context(n_ctx=2048, n_seq_max=4, n_threads=2, reproducible=True)


def main() -> None:
    params = llamax.SamplingParams(max_tokens=24, temperature=0.0, logprobs=1)
    prompt = chatml("How does a pendulum clock keep time?")
    with context() as ctx:
        alone = reply(ctx.add_request(prompt, params).result())
    with context() as ctx:
        others = [ctx.add_request(chatml(q), params) for q in QUESTIONS]
        done = ctx.add_request(prompt, params).result()
        for handle in others:
            handle.result()
        print(f"layout: {ctx.kv_layout}, reproducible: {ctx.config.is_reproducible}")
    beside = reply(done)
    print(f"reply: {done.text!r}")
    print(f"alone and beside {len(QUESTIONS)} others, bit for bit the same: {alone == beside}")
    assert alone == beside


if __name__ == "__main__":
    main()
