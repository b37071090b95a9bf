"""Sessions: a conversation whose KV cache stays resident between turns; fork and save it."""

import tempfile
from pathlib import Path

import llamax

PARAMS = llamax.SamplingParams(max_tokens=32, temperature=0)


def turn(transcript: str, user: str) -> str:
    return transcript + f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def main() -> None:
    with llamax.Context(n_ctx=4096, n_seq_max=4) as ctx, ctx.session() as chat:
        transcript = turn("", "Give me a fruit.")
        for user in ("Another one?", "And a vegetable?"):
            done = chat.add_request(transcript, PARAMS).result()
            print(f"assistant: {done.text.strip()!r}  (cached {done.usage.cached_tokens} tokens)")
            transcript = turn(transcript + done.text + "<|im_end|>\n", user)
        with chat.fork() as branch:
            print("branch:", branch.add_request(transcript, PARAMS).result().text.strip())
        path = Path(tempfile.mkdtemp()) / "chat.llamax"
        chat.save(path)
        with llamax.Session.load(ctx, path) as restored:
            done = restored.add_request(transcript, PARAMS).result()
            print("restored:", done.text.strip(), f"(cached {done.usage.cached_tokens})")


if __name__ == "__main__":
    main()
