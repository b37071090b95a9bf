"""asyncio: ``await`` a handle for its completion, ``async for`` over it to stream.

Handles are awaitable and async-iterable inside a running event loop; the engine runs in
its own thread, so the event loop is never blocked by inference.

    python examples/asyncio_streaming.py
"""

from __future__ import annotations

import asyncio

import llamax


def chatml(user: str) -> str:
    """One user turn in ChatML, ready for the assistant's reply."""
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


async def stream(ctx: llamax.Context, question: str, params: llamax.SamplingParams) -> None:
    """Print one reply as it arrives."""
    async for event in ctx.add_request(chatml(question), params):
        print(event.text, end="", flush=True)
    print()


async def main() -> None:
    params = llamax.SamplingParams(max_tokens=48, temperature=0.0)
    with llamax.Context(n_ctx=2048) as ctx:
        completion = await ctx.add_request(chatml("What is the capital of Italy?"), params)
        print("awaited:", completion.text)

        print("streamed: ", end="")
        await stream(ctx, "Write one sentence about the moon.", params)

        questions = ["Name a red fruit.", "Name a big animal.", "Name a cold place."]
        completions = await asyncio.gather(*(ctx.add_request(chatml(q), params) for q in questions))
        for question, done in zip(questions, completions, strict=True):
            print(f"gathered: {question} -> {done.text.strip()!r}")


if __name__ == "__main__":
    asyncio.run(main())
