"""Tool calling: OpenAI ``tools`` on a model whose template knows nothing of tools.

:mod:`llamax.tools` renders the tool schemas into the system turn, builds a grammar that
only lets the model write a call whose ``arguments`` match its function's JSON schema, and
parses the reply into OpenAI ``tool_calls``. Here the model calls ``get_weather``, we run
the function, send the result back as a ``role: "tool"`` message and get the final answer;
then the same call is streamed as OpenAI ``delta.tool_calls``.

    python examples/tool_calling.py
"""

from __future__ import annotations

import json
from typing import Any

import llamax
from llamax.tools import (
    ToolCallStreamParser,
    ToolPlan,
    parse_tool_calls,
    prepare_tools,
    tool_call_grammar,
    tool_prompt_tokens,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "location": {"type": "string", "description": "The city, e.g. Paris"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["location", "unit"],
            },
        },
    }
]


def get_weather(location: str, unit: str) -> dict[str, Any]:
    """The 'real' function the model asks us to run."""
    return {"location": location, "temperature": 21 if unit == "celsius" else 70, "unit": unit}


def ask(ctx: llamax.Context, messages: list[dict[str, Any]], plan: ToolPlan) -> dict[str, Any]:
    """One assistant turn: render, generate under the tool grammar, parse."""
    params = llamax.SamplingParams(grammar=tool_call_grammar(plan), temperature=0, max_tokens=48)
    done = ctx.add_request(tool_prompt_tokens(ctx, messages, plan), params).result()
    reply = parse_tool_calls(done.text, plan, str(done.finish_reason))
    print(f"  finish_reason={reply.finish_reason!r}")
    return reply.message()


def main() -> None:
    with llamax.Context(n_ctx=2048, n_seq_max=2) as ctx:
        messages: list[dict[str, Any]] = [
            {"role": "user", "content": "What is the weather like in Paris?"}
        ]
        print("1. the model calls the tool (tool_choice='required'):")
        message = ask(ctx, messages, prepare_tools(TOOLS, "required", parallel_tool_calls=False))
        messages.append(message)
        for call in message["tool_calls"]:
            arguments = json.loads(call["function"]["arguments"])
            print(f"  {call['id']}: {call['function']['name']}({arguments})")
            result = get_weather(**arguments)
            messages.append(
                {"role": "tool", "tool_call_id": call["id"], "content": json.dumps(result)}
            )

        print("2. the model answers from the tool result (tool_choice='none'):")
        answer = ask(ctx, messages, prepare_tools(TOOLS, "none"))
        print(f"  {answer['content']!r}")

        print("3. the same call, streamed as OpenAI deltas:")
        plan = prepare_tools(TOOLS, "required", parallel_tool_calls=False)
        params = llamax.SamplingParams(grammar=tool_call_grammar(plan), temperature=0)
        parser = ToolCallStreamParser(plan)
        for event in ctx.add_request(tool_prompt_tokens(ctx, messages[:1], plan), params):
            for delta in parser.feed(event.text):
                print(f"  {delta}")
        print(f"  finish_reason={parser.finish_reason('stop')!r}")


if __name__ == "__main__":
    main()
