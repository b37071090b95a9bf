"""Basic completion: submit one prompt with ``add_request`` and wait for its result.

``add_request`` returns a :class:`llamax.RequestHandle` at once; ``handle.result()`` blocks
until the :class:`llamax.Completion` is ready. SmolLM2 is an instruct model, so the prompt
uses its ChatML chat format.

    python examples/basic_completion.py
"""

from __future__ import annotations

import llamax


def chatml(user: str) -> str:
    """One user turn in ChatML, ready for the assistant's reply."""
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def main() -> None:
    params = llamax.SamplingParams(max_tokens=48, temperature=0.0)  # greedy: reproducible
    with llamax.Context(n_ctx=2048) as ctx:  # no path: $LLAMAX_MODEL or SmolLM2-135M
        handle = ctx.add_request(chatml("What is the capital of France?"), params)
        completion = handle.result(timeout=60)
    print(completion.text)
    print(f"finish_reason={completion.finish_reason}  usage={completion.usage}")


if __name__ == "__main__":
    main()
