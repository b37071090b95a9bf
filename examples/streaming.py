"""Streaming: iterate a request's handle to get its text token by token.

Each :class:`llamax.TokenEvent` carries the newly complete ``text`` (possibly empty while a
multi-byte character is incomplete) and its ``token_ids``; the last one carries the
``finish_reason``. Joined, the events' texts equal the completion's text.

    python examples/streaming.py
"""

from __future__ import annotations

import llamax


def chatml(user: str) -> str:
    """One user turn in ChatML, ready for the assistant's reply."""
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def main() -> None:
    params = llamax.SamplingParams(max_tokens=80, temperature=0.7, seed=7)
    with llamax.Context(n_ctx=2048) as ctx:
        handle = ctx.add_request(chatml("Tell me a joke about computers."), params)
        for event in handle:  # blocks until the next event; ends after the last one
            print(event.text, end="", flush=True)
            if event.finish_reason is not None:
                print(f"\n[finish_reason={event.finish_reason}]")
        completion = handle.result()  # already done: the stream has ended
    print(f"{completion.usage.completion_tokens} tokens")


if __name__ == "__main__":
    main()
