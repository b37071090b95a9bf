"""OpenAI's Responses API without a server: a reply, a follow-up through
previous_response_id (its prompt prefix comes from the cache), and a stream of events, on
the default model."""

import llamax
from llamax.openai import ResponseStore, create_response


def main() -> None:
    store = ResponseStore()
    with llamax.Context(n_ctx=2048, n_seq_max=4) as ctx:
        first = create_response(
            ctx,
            {
                "instructions": "Answer briefly.",
                "input": "Name three colours of the rainbow.",
                "max_output_tokens": 48,
                "temperature": 0,
            },
            store=store,
        )
        assert isinstance(first, dict)
        print(first["output"][-1]["content"][0]["text"])
        follow = create_response(
            ctx,
            {
                "instructions": "Answer briefly.",
                "previous_response_id": first["id"],
                "input": "And one more?",
                "max_output_tokens": 48,
                "temperature": 0,
            },
            store=store,
        )
        assert isinstance(follow, dict)
        usage = follow["usage"]
        print(follow["output"][-1]["content"][0]["text"])
        cached = usage["input_tokens_details"]["cached_tokens"]
        print(f"follow-up: {usage['input_tokens']} prompt tokens, {cached} from the cache")
        events = create_response(
            ctx, {"input": "Say hello.", "max_output_tokens": 32, "stream": True}
        )
        assert not isinstance(events, dict)
        for event in events:
            if event["type"] == "response.output_text.delta":
                print(event["delta"], end="", flush=True)
            elif event["type"] in ("response.completed", "response.incomplete"):
                print(f"\n{event['type']}: {event['response']['usage']['output_tokens']} tokens")


if __name__ == "__main__":
    main()
