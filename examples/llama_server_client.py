"""A llama-server client against llamax: the native ``/completion`` route (what scripts
and bots written for llama.cpp's server call), streamed and not, with token
probabilities, then ``/apply-template`` and ``/props``.

Needs the extras: pip install '.[server]'"""

import json

import httpx

import llamax
from llamax.server import BackgroundServer, create_app


def main() -> None:
    with (
        llamax.Context(n_ctx=2048, n_seq_max=4) as ctx,
        BackgroundServer(create_app(ctx)) as server,
    ):
        body = {"prompt": "The three primary colours are", "n_predict": 16, "temperature": 0,
                "n_probs": 2, "stop": ["."]}  # fmt: skip
        result = httpx.post(server.url + "/completion", json=body, timeout=60).json()
        print(repr(result["content"]), result["stop_type"], repr(result["stopping_word"]))
        print("tokens:", result["tokens_evaluated"], "in,", result["tokens_predicted"], "out;",
              f"{result['timings']['predicted_per_second']:.1f} tokens/s")  # fmt: skip
        first = result["completion_probabilities"][0]
        print("first token:", [(p["token"], round(p["logprob"], 2)) for p in first["top_logprobs"]])

        with httpx.stream("POST", server.url + "/completion", json=body | {"stream": True},
                          timeout=60) as stream:  # fmt: skip
            for line in stream.iter_lines():
                if line.startswith("data: "):
                    event = json.loads(line[6:])
                    print(event["content"], end="", flush=True)
        print()

        messages = [{"role": "user", "content": "Hi"}]
        prompt = httpx.post(server.url + "/apply-template", json={"messages": messages}).json()
        print(prompt["prompt"])
        props = httpx.get(server.url + "/props").json()
        print(
            "slots:", props["total_slots"], "n_ctx:", props["default_generation_settings"]["n_ctx"]
        )


if __name__ == "__main__":
    main()
