"""Cancellation: stop a streaming request mid-way from another thread.

``handle.cancel()`` is safe from any thread at any time. The request stops at the next step
boundary, frees its KV cells, and completes normally with ``finish_reason == "cancelled"``
and the text produced so far; the stream ends with that final event.

Cancelling ``handle.future`` itself (the ``concurrent.futures`` way) is different: the
future becomes cancelled and ``result()`` raises ``CancelledError``.

    python examples/cancellation.py
"""

from __future__ import annotations

import threading
from concurrent.futures import CancelledError

import llamax


def chatml(user: str) -> str:
    """One user turn in ChatML, ready for the assistant's reply."""
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def cancel_while_streaming(ctx: llamax.Context) -> None:
    """A watcher thread cancels the request once the consumer has seen 20 events."""
    params = llamax.SamplingParams(max_tokens=500, ignore_eos=True, seed=1)
    handle = ctx.add_request(chatml("Write a long story about a dragon."), params)
    enough = threading.Event()

    def watch() -> None:  # runs in another thread
        enough.wait()
        handle.cancel()

    watcher = threading.Thread(target=watch)
    watcher.start()
    for n, event in enumerate(handle, start=1):
        print(event.text, end="", flush=True)
        if n == 20:
            enough.set()  # the stream keeps going until the engine applies the cancel
    watcher.join()
    completion = handle.result()
    print(
        f"\n-> finish_reason={completion.finish_reason}, "
        f"{completion.usage.completion_tokens} of max 500 tokens kept"
    )


def cancel_the_future(ctx: llamax.Context) -> None:
    """Cancelling the Future itself: result() raises CancelledError; the engine drops it."""
    handle = ctx.add_request(chatml("Hello!"), llamax.SamplingParams(max_tokens=64))
    print("future.cancel() ->", handle.future.cancel())
    try:
        handle.result()
    except CancelledError:
        print("result() raised CancelledError")


def main() -> None:
    with llamax.Context(n_ctx=2048) as ctx:
        cancel_while_streaming(ctx)
        cancel_the_future(ctx)


if __name__ == "__main__":
    main()
