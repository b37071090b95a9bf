"""The anthropic client against llamax's Messages endpoint: a server on the default model
in this process, then a reply, a stream and a token count through the client.

Needs the extras: pip install '.[server]' anthropic"""

import anthropic

import llamax
from llamax.server import BackgroundServer, create_app


def main() -> None:
    with (
        llamax.Context(n_ctx=2048, n_seq_max=4) as ctx,
        BackgroundServer(create_app(ctx)) as server,
    ):
        client = anthropic.Anthropic(base_url=server.url, api_key="-")
        question = [{"role": "user", "content": "Name three colours of the rainbow."}]
        message = client.messages.create(
            model="local",
            max_tokens=48,
            system="Answer briefly.",
            messages=question,  # type: ignore[arg-type]
            extra_body={"temperature": 0},
        )
        print(message.content[0].text)  # type: ignore[union-attr]
        print("stop_reason:", message.stop_reason, "usage:", message.usage)
        with client.messages.stream(
            model="local",
            max_tokens=48,
            messages=question,  # type: ignore[arg-type]
        ) as stream:
            for text in stream.text_stream:
                print(text, end="", flush=True)
        print()
        counted = client.messages.count_tokens(model="local", messages=question)  # type: ignore[arg-type]
        print("input tokens:", counted.input_tokens)


if __name__ == "__main__":
    main()
