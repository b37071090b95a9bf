"""The openai client's Responses API against llamax: a server on the default model in this
process, then a reply, a follow-up through previous_response_id, a stream and a function
call through the client.

Needs the extras: pip install '.[server]' openai"""

import json

import openai
from openai.types.responses import FunctionToolParam

import llamax
from llamax.server import BackgroundServer, create_app

WEATHER: FunctionToolParam = {
    "type": "function",
    "strict": False,
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


def main() -> None:
    with (
        llamax.Context(n_ctx=2048, n_seq_max=4) as ctx,
        BackgroundServer(create_app(ctx)) as server,
    ):
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="-")
        reply = client.responses.create(
            model="local",
            instructions="Answer briefly.",
            input="Name three colours of the rainbow.",
            max_output_tokens=48,
            temperature=0,
        )
        print(reply.output_text)
        follow = client.responses.create(
            model="local",
            instructions="Answer briefly.",
            previous_response_id=reply.id,
            input="And one more?",
            max_output_tokens=48,
            temperature=0,
        )
        print(follow.output_text)
        if follow.usage is not None:
            cached = follow.usage.input_tokens_details.cached_tokens
            print(f"follow-up: {follow.usage.input_tokens} prompt tokens, {cached} cached")
        stream = client.responses.create(
            model="local", input="Say hello.", max_output_tokens=32, stream=True
        )
        for event in stream:
            if event.type == "response.output_text.delta":
                print(event.delta, end="", flush=True)
        print()
        call = client.responses.create(
            model="local",
            input="What is the weather in Paris?",
            tools=[WEATHER],
            tool_choice="required",
            max_output_tokens=64,
            temperature=0,
        )
        for item in call.output:
            if item.type == "function_call":
                print("call:", item.name, json.loads(item.arguments))
                answer = client.responses.create(
                    model="local",
                    previous_response_id=call.id,
                    input=[
                        {"type": "function_call_output", "call_id": item.call_id, "output": "sunny"}
                    ],
                    tools=[WEATHER],
                    max_output_tokens=48,
                    temperature=0,
                )
                print("answer:", answer.output_text)


if __name__ == "__main__":
    main()
