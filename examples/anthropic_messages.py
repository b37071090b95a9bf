"""Anthropic Messages shapes from the library, no server: a reply, a stream, a count."""

import llamax
from llamax.anthropic import count_tokens, messages


def main() -> None:
    request = {
        "max_tokens": 48,
        "temperature": 0,
        "system": "Answer in one sentence.",
        "messages": [{"role": "user", "content": "What is a lighthouse?"}],
    }
    with llamax.Context(n_ctx=1024, n_seq_max=2) as ctx:
        reply = messages(ctx, request)
        assert isinstance(reply, dict)
        print(reply["content"][0]["text"])
        print("stop_reason:", reply["stop_reason"], "usage:", reply["usage"])
        stream = messages(ctx, {**request, "stream": True})
        assert not isinstance(stream, dict)
        for event in stream:
            if event["type"] == "content_block_delta":
                print(event["delta"]["text"], end="", flush=True)
            elif event["type"] == "message_delta":
                print("\nstream stop_reason:", event["delta"]["stop_reason"])
        counted = count_tokens(ctx, {"system": request["system"], "messages": request["messages"]})
        print("count_tokens:", counted)


if __name__ == "__main__":
    main()
