"""Logits processors: steer sampling from Python, per request or for the whole batch.

A per-request processor is ``fn(token_ids, logits)``: ``token_ids`` is the sequence so far
(prompt plus generated, ``int32``) and ``logits`` a writable, zero-copy ``float32`` view of
its row in llama.cpp's output buffer. Edit it in place (and return ``None``) or return a new
row. Only requests that carry processors pay for them. The batch hook
``Context(batch_logits_processor=fn)`` sees every row of a step at once, as one
``(rows, n_vocab)`` view, for vectorised work.

    python examples/logits_processor.py
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

import llamax


def chatml(user: str) -> str:
    """One user turn in ChatML, ready for the assistant's reply."""
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


class NoDigits:
    """Ban every token whose text holds a digit. The mask is built on the first call."""

    def __init__(self, ctx: llamax.Context) -> None:
        self.ctx = ctx
        self.banned: npt.NDArray[np.bool_] | None = None

    def __call__(self, token_ids: npt.NDArray[np.int32], logits: npt.NDArray[np.float32]) -> None:
        if self.banned is None:  # runs in the engine thread, once
            pieces = (self.ctx.detokenize([t]) for t in range(len(logits)))
            self.banned = np.fromiter((any(c.isdigit() for c in p) for p in pieces), bool)
        logits[self.banned] = -np.inf  # in place: nothing to return


def main() -> None:
    steps: list[int] = []

    def batch_hook(rows: Sequence[llamax.LogitsRow], logits: npt.NDArray[np.float32]) -> None:
        steps.append(len(rows))  # one call per step, one row per sequence being sampled

    with llamax.Context(n_ctx=2048, batch_logits_processor=batch_hook) as ctx:
        question = chatml("Write the year the Second World War ended.")
        plain = llamax.SamplingParams(max_tokens=16, temperature=0)
        steered = llamax.SamplingParams(
            max_tokens=16, temperature=0, logits_processors=[NoDigits(ctx)]
        )
        handles = [ctx.add_request(question, plain), ctx.add_request(question, steered)]
        for name, handle in zip(("plain", "no digits"), handles, strict=True):
            print(f"{name:>9}: {handle.result().text!r}")
    print(f"batch hook: {len(steps)} steps, at most {max(steps)} rows per step")


if __name__ == "__main__":
    main()
