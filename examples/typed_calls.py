"""Typed calls: one checked ``ChatCall``, submitted with ``ctx.submit_chat``, read as typed
parts as the reply streams, or whole.

``ChatCall.of`` takes OpenAI's option names (an unknown one is a ``TypeError``, a bad value
an ``InvalidParameterError``, raised before anything is rendered); ``chat_completion`` and
the server's dialects are built on the same call and the same entry.
"""

import asyncio

import llamax
from llamax.chat import ChatCall
from llamax.chat_stream import ContentDelta, Finished, Started

MESSAGES = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "Name three primary colors."},
]


def main() -> None:
    with llamax.Context(n_ctx=2048, n_seq_max=4) as ctx:
        call = ChatCall.of(MESSAGES, max_tokens=32, temperature=0)
        print("call:", call.params.max_tokens, "tokens,", len(call.messages), "messages")

        chat = ctx.submit_chat(call)
        for part in chat.parts():
            if isinstance(part, Started):
                print("reply:", end=" ", flush=True)
            elif isinstance(part, ContentDelta):
                print(part.text, end="", flush=True)
            elif isinstance(part, Finished):
                print(f"  [finish={part.reason}]")

        try:
            ChatCall.of(MESSAGES, temprature=0.5)
        except TypeError as exc:
            print("refused before rendering:", exc)

        async def whole() -> str:
            handle = await ctx.asubmit_chat(call)  # rendered in a worker thread
            return (await handle.aresult()).text

        print("whole, async:", repr(asyncio.run(whole())))


if __name__ == "__main__":
    main()
