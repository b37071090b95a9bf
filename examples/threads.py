"""Many threads, one context: ``add_request`` is thread-safe and never blocks on inference.

Eight worker threads submit a prompt each at the same time. The engine batches all of them
into one ``llama_decode`` per step. The main thread collects every ``handle.future`` (a
``concurrent.futures.Future[Completion]``) and waits for them with
``concurrent.futures.wait``.

    python examples/threads.py
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, wait

import llamax

QUESTIONS = [
    "Name a primary colour.",
    "What is 2 + 2?",
    "Name a planet.",
    "What do bees make?",
    "Name a musical instrument.",
    "What is the opposite of hot?",
    "Name a fruit that is yellow.",
    "What animal says moo?",
]


def chatml(user: str) -> str:
    """One user turn in ChatML, ready for the assistant's reply."""
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def main() -> None:
    params = llamax.SamplingParams(max_tokens=24, temperature=0.0)
    futures: dict[Future[llamax.Completion], str] = {}
    lock = threading.Lock()
    with llamax.Context(n_ctx=2048, n_seq_max=8) as ctx:

        def submit(question: str) -> None:  # runs in a worker thread
            handle = ctx.add_request(chatml(question), params)
            with lock:
                futures[handle.future] = question

        start = time.perf_counter()
        workers = [threading.Thread(target=submit, args=(q,)) for q in QUESTIONS]
        for w in workers:
            w.start()
        for w in workers:
            w.join()  # submitting returns at once; generation runs in the background
        done, not_done = wait(futures, timeout=120)
        elapsed = time.perf_counter() - start
        for future, question in futures.items():
            print(f"{question:<30} -> {future.result().text.strip()!r}")
        tokens = sum(f.result().usage.completion_tokens for f in done)
        print(f"{len(done)} done, {len(not_done)} pending; {tokens} tokens in {elapsed:.2f} s")


if __name__ == "__main__":
    main()
