"""n > 1: one prompt, several independent continuations; the prompt is computed once."""

import llamax


def main() -> None:
    prompt = (
        "<|im_start|>user\nWrite a one-line slogan for a bakery.<|im_end|>\n<|im_start|>assistant\n"
    )
    params = llamax.SamplingParams(max_tokens=24, temperature=0.9, seed=1, n=4)
    with llamax.Context(n_ctx=2048, n_seq_max=4) as ctx:
        done = ctx.add_request(prompt, params).result()
        for choice in done.choices:
            print(f"[{choice.index}] {choice.text.strip()!r} ({choice.finish_reason})")
        print(done.usage, "prefill tokens:", ctx.stats().sequences.num_prefill_tokens)


if __name__ == "__main__":
    main()
