"""Constrained output: a JSON schema, a GBNF grammar, and OpenAI's ``response_format``.

``SamplingParams(json_schema=...)`` converts the schema to a GBNF grammar with
llama-cpp-python's converter and adds llama.cpp's grammar sampler to the request's chain,
so every sampled token keeps the text valid. ``grammar=`` takes GBNF directly. A grammar
that does not parse raises :class:`llamax.GrammarError` from ``add_request``.

    python examples/json_schema.py
"""

from __future__ import annotations

import json

import llamax

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer"},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Invent a person. Reply in JSON with a name, age and color."}]


def main() -> None:
    with llamax.Context(n_ctx=2048) as ctx:
        prompt = ctx.chat_prompt(ASK)  # the model's own chat template, tokenized
        params = llamax.SamplingParams(max_tokens=96, temperature=0.8, seed=3, json_schema=SCHEMA)
        person = json.loads(ctx.add_request(prompt, params).result().text)
        print("json_schema:", person)

        yes_no = llamax.SamplingParams(max_tokens=4, grammar='root ::= "yes" | "no"')
        question = ctx.chat_prompt([{"role": "user", "content": "Is the sea salty?"}])
        print("grammar:    ", ctx.add_request(question, yes_no).result().text)

        response = ctx.chat_completion(
            ASK,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": SCHEMA},
            },
            temperature=0,
            max_tokens=96,
        )
        content = response["choices"][0]["message"]["content"]
        assert content is not None  # None only when the reply calls tools
        print("chat:       ", json.loads(content))

        try:
            ctx.add_request(prompt, llamax.SamplingParams(grammar='root ::= "unterminated'))
        except llamax.GrammarError as exc:
            print("rejected:   ", exc)


if __name__ == "__main__":
    main()
