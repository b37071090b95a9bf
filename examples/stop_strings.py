"""Stop strings: end generation when the text contains one of ``SamplingParams.stop``.

The match is on text, not tokens, so it works however the tokenizer splits the string.
The stop string is trimmed from ``completion.text`` (and never streamed: text that may be
the start of a stop string is held back until it is known not to be), while
``completion.token_ids`` still hold the tokens that spelled it. ``finish_reason`` is
``"stop"``.

    python examples/stop_strings.py
"""

from __future__ import annotations

import llamax


def main() -> None:
    with llamax.Context(n_ctx=2048) as ctx:
        params = llamax.SamplingParams(max_tokens=60, temperature=0.0, stop=[", 9"])
        completion = ctx.add_request("1, 2, 3, 4, 5,", params).result(timeout=60)
        print(f"text:      {completion.text!r}  ({completion.finish_reason})")
        print(f"token_ids: {ctx.detokenize(completion.token_ids)!r} (still spell the stop)")

        # Only the first line: stop at a newline. Any number of stop strings may be given.
        one_line = llamax.SamplingParams(max_tokens=60, temperature=0.0, stop=["\n", "4."])
        prompt = (
            "<|im_start|>user\nList three fruits, one per line.<|im_end|>\n<|im_start|>assistant\n"
        )
        streamed = [event.text for event in ctx.add_request(prompt, one_line)]
        print(f"streamed:  {''.join(streamed)!r}")


if __name__ == "__main__":
    main()
