"""Manual mode: ``Context(autostart=False)`` starts no thread; the caller drives the loop.

Each ``ctx.process()`` runs one step (schedule, one ``llama_decode``, sample, emit) in the
calling thread. This suits applications that already own a loop (a game loop, a GUI idle
handler) or tests that want determinism. Requests can still be added from any thread; only
one thread may call ``process()`` at a time (others get :class:`llamax.LoopOwnershipError`,
as does any thread of an autostarted context).

    python examples/manual_loop.py
"""

from __future__ import annotations

import llamax


def chatml(user: str) -> str:
    """One user turn in ChatML, ready for the assistant's reply."""
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def main() -> None:
    params = llamax.SamplingParams(max_tokens=32, temperature=0.0)
    with llamax.Context(n_ctx=2048, autostart=False) as ctx:
        handles = [
            ctx.add_request(chatml("Say hello in French."), params),
            ctx.add_request(chatml("Say hello in Spanish."), params),
            ctx.add_request("The three primary colours are", params),  # plain text completion
        ]
        steps = 0
        while ctx.has_work():
            ctx.process()  # one batched decode for every running request
            steps += 1
        for handle in handles:
            completion = handle.result(timeout=0)  # already done: nothing else runs the loop
            print(f"{completion.text.strip()!r}  ({completion.finish_reason})")
        print(f"{steps} steps; stats: {ctx.stats()}")


if __name__ == "__main__":
    main()
