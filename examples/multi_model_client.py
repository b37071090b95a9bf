"""Serve the default model under two names from one server, and pick one per request.

Needs ``pip install '.[server]' openai``. From a shell the same server is
``llamax serve --model a=PATH --model b=PATH --idle-unload 600`` (see docs/models.md).
"""

from __future__ import annotations

import openai

import llamax
from llamax.server import BackgroundServer, ModelPool, create_app


def main() -> None:
    path = llamax.default_model_path()
    # Two names, two contexts: each loads when first asked for, and unloads after 60 s idle.
    pool = ModelPool(
        {"terse": path, "chatty": path}, idle_unload_seconds=60, n_ctx=2048, n_seq_max=4,
        n_threads=2,
    )  # fmt: skip
    try:
        with BackgroundServer(create_app(pool)) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
            print("before:", [(m.id, m.model_extra["status"]) for m in client.models.list()])  # type: ignore[index]
            for model, max_tokens in (("terse", 8), ("chatty", 32)):
                reply = client.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": "Name three colours."}],
                    max_tokens=max_tokens,
                    temperature=0,
                )
                print(f"{model}:", reply.choices[0].message.content)
            print("after: ", [(m.id, m.model_extra["status"]) for m in client.models.list()])  # type: ignore[index]
            try:
                client.chat.completions.create(
                    model="gpt-4", messages=[{"role": "user", "content": "Hi"}]
                )
            except openai.NotFoundError as exc:
                print("unknown model:", exc.status_code, exc.code)
    finally:
        pool.close()


if __name__ == "__main__":
    main()
