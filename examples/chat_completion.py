"""OpenAI-shaped chat completions: a whole ``chat.completion`` dict, then a stream of chunks.

The dicts have the shapes of OpenAI's Chat Completions API (``openai.types.chat`` validates
them). The reply stops at the template's end-of-turn token (``<|im_end|>`` for SmolLM2).
"""

import json

import llamax

MESSAGES = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "Name three primary colors."},
]


def main() -> None:
    with llamax.Context(n_ctx=2048, n_seq_max=4) as ctx:
        response = ctx.chat_completion(MESSAGES, max_tokens=48, temperature=0)
        print(json.dumps(response, indent=2))

        print("streaming:", end=" ", flush=True)
        for chunk in ctx.chat_completion(
            MESSAGES,
            max_tokens=48,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        ):
            if chunk["choices"]:
                choice = chunk["choices"][0]
                print(choice["delta"].get("content", ""), end="", flush=True)
                if choice["finish_reason"]:
                    print(f"  [finish_reason={choice['finish_reason']}]")
            else:  # the last chunk: no choices, only usage
                print("usage:", chunk["usage"])

        text = ctx.completion("The three primary colors are", max_tokens=12, temperature=0)
        print("text completion:", repr(text["choices"][0]["text"]))


if __name__ == "__main__":
    main()
