"""Backend sampling: plain requests' chains run inside llama.cpp's decode (on a GPU the
logits then stay on the device); the same seed gives the same tokens as on the host."""

import llamax


def main() -> None:
    prompt = "<|im_start|>user\nName three rivers.<|im_end|>\n<|im_start|>assistant\n"
    params = llamax.SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=7)
    replies = []
    for on in (False, True):
        with llamax.Context(n_ctx=2048, n_seq_max=2, backend_sampling=on) as ctx:
            replies.append(ctx.add_request(prompt, params).result())
            print(f"backend_sampling={on}: {replies[-1].text.strip()!r}")
    print("same tokens:", replies[0].token_ids == replies[1].token_ids)


if __name__ == "__main__":
    main()
