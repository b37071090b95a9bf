"""Two llamax replicas on a local Ray Serve cluster, called through the OpenAI client.

Requests that share a system prompt land on the same replica and reuse its prefix cache.
Needs ``pip install '.[ray]' openai``; takes ~30 s (Ray start + two model loads).
"""

from __future__ import annotations

import socket

import openai
import ray
from ray import serve

import llamax.ray

SYSTEM = "You are a terse librarian. Recommend one book per answer, title only. " * 6


def main() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = llamax.ray.deployment(num_replicas=2, context_options={"n_ctx": 2048, "n_seq_max": 4})
        serve.run(app, name="llamax", route_prefix="/")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-")
        for topic in ["the sea", "mountains", "cities"]:
            raw = client.chat.completions.with_raw_response.create(
                model="llamax", max_tokens=16, temperature=0,
                messages=[{"role": "system", "content": SYSTEM},
                          {"role": "user", "content": f"A book about {topic}?"}],
            )  # fmt: skip
            done = raw.parse()
            usage = done.usage
            cached = (
                usage.prompt_tokens_details.cached_tokens
                if usage and usage.prompt_tokens_details
                else 0
            )
            print(f"replica {raw.headers['x-llamax-replica']}  cached {cached:>3} tokens  "
                  f"{done.choices[0].message.content!r}")  # fmt: skip
    finally:
        serve.shutdown()  # type: ignore[no-untyped-call]
        ray.shutdown()


if __name__ == "__main__":
    main()
