"""Batch generation: run a list of prompts at once and get the completions in input order.

``llamax.batch.generate`` submits every prompt before waiting, so the engine batches them;
a progress bar appears for slow batches when tqdm is installed (``progress=True`` forces
it). With ``return_exceptions=True`` a prompt that fails leaves its error in its place.

    python examples/generate.py
"""

from __future__ import annotations

import asyncio

import llamax
from llamax.batch import agenerate, generate

QUESTIONS = ["What is 2 + 2?", "Name a colour.", "Say hello in French.", "Name a planet."]


def main() -> None:
    params = llamax.SamplingParams(max_tokens=24, temperature=0.0)
    with llamax.Context(n_ctx=2048, n_seq_max=8) as ctx:
        prompts = [ctx.chat_prompt([{"role": "user", "content": q}]) for q in QUESTIONS]
        for question, done in zip(QUESTIONS, generate(ctx, prompts, params), strict=True):
            print(f"{question!r} -> {done.text.strip()!r}")

        too_long = "word " * 5000
        outcomes = generate(ctx, [prompts[0], too_long], params, return_exceptions=True)
        print("kept in place:", [type(o).__name__ for o in outcomes])

        async def in_a_loop() -> list[llamax.Completion]:
            return await agenerate(ctx, prompts[:2], params)

        print("async:", [c.finish_reason.value for c in asyncio.run(in_a_loop())])


if __name__ == "__main__":
    main()
