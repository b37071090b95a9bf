"""The reasoning split: a thinking model's <think>...</think> goes to reasoning_content.

The default model does not think, so the first part feeds a thinking model's reply to the
splitter in small pieces, as a stream would; the second asks the default model with the
options a thinking model would take, and shows that a reply without thinking is all
content."""

import llamax
from llamax.reasoning import ReasoningSplitter, split_reasoning

GPT_OSS = (
    "<|channel|>analysis<|message|>17 * 23 = 391.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>391"
)
REPLY = "<think>\nThe user asks for 17 * 23. 17 * 20 = 340, 17 * 3 = 51.\n</think>\n\n391"


def main() -> None:
    splitter = ReasoningSplitter()
    reasoning = content = ""
    for start in range(0, len(REPLY), 3):  # pieces of 3 characters cut the tags anywhere
        r, c = splitter.feed(REPLY[start : start + 3])
        reasoning, content = reasoning + r, content + c
    r, c = splitter.flush()
    print(f"reasoning_content: {reasoning + r!r}")
    print(f"content:           {content + c!r}")
    print(f"gpt-oss channels:  {split_reasoning(GPT_OSS)!r}")

    with llamax.Context(n_ctx=1024, n_seq_max=1) as ctx:
        response = ctx.chat_completion(
            [{"role": "user", "content": "What is 17 * 23?"}],
            max_tokens=24,
            temperature=0,
            reasoning_format="auto",
            enable_thinking=False,  # SmolLM2's template ignores it
        )
        message = response["choices"][0]["message"]
        has = "reasoning_content" in message
        print(f"default model: {message['content']!r}, reasoning_content: {has}")


if __name__ == "__main__":
    main()
