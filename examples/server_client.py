"""Serve the default model over HTTP in-process and talk to it with the ``openai`` client.

Needs ``pip install '.[server]' openai``. From a shell the same server is
``llamax serve`` (or ``python -m llamax.server``), with a chat page at http://127.0.0.1:8000/.
"""

from __future__ import annotations

import openai
from openai.types.chat import ChatCompletionMessageParam

import llamax
from llamax.server import BackgroundServer, create_app


def main() -> None:
    with (
        llamax.Context(n_ctx=2048, n_seq_max=4, n_threads=2) as ctx,
        BackgroundServer(create_app(ctx)) as server,  # a free port on 127.0.0.1
    ):
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
        messages: list[ChatCompletionMessageParam] = [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name three colours."},
        ]
        reply = client.chat.completions.create(
            model=ctx.model_name, messages=messages, max_tokens=32, temperature=0
        )
        print("whole reply:", reply.choices[0].message.content)
        print("streamed:   ", end="")
        stream = client.chat.completions.create(
            model=ctx.model_name, messages=messages, max_tokens=32, temperature=0, stream=True
        )
        for chunk in stream:
            if chunk.choices:
                print(chunk.choices[0].delta.content or "", end="", flush=True)
        print()
        print("models:     ", [model.id for model in client.models.list()])


if __name__ == "__main__":
    main()
