"""Logprobs: each generated token's log-probability and its most likely alternatives.

``SamplingParams(logprobs=k)`` (0..20) fills ``Choice.logprobs`` and every
``TokenEvent.logprobs`` with a :class:`llamax.TokenLogprob` per token: a log-softmax over
that request's own logits row (after its logits processors), never ``logits_all``.
``chat_completion(logprobs=True, top_logprobs=k)`` returns them in OpenAI's shape.

    python examples/logprobs.py
"""

from __future__ import annotations

import math

import llamax


def chatml(user: str) -> str:
    """One user turn in ChatML, ready for the assistant's reply."""
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def main() -> None:
    with llamax.Context(n_ctx=2048) as ctx:
        params = llamax.SamplingParams(max_tokens=8, temperature=0, logprobs=3)
        handle = ctx.add_request(chatml("What is the capital of Italy?"), params)
        for event in handle:  # logprobs stream with the tokens
            for lp in event.logprobs:
                others = ", ".join(
                    f"{t.token!r} {math.exp(t.logprob):.0%}" for t in lp.top_logprobs
                )
                print(f"{lp.token!r:>12} p={math.exp(lp.logprob):.2f}   top: {others}")

        response = ctx.chat_completion(
            [{"role": "user", "content": "Name a fruit."}],
            logprobs=True,
            top_logprobs=2,
            temperature=0,
            max_tokens=6,
        )
        content = response["choices"][0]["logprobs"]["content"]
        print("chat:", [(entry["token"], round(entry["logprob"], 3)) for entry in content])


if __name__ == "__main__":
    main()
