"""Shared prefixes: a burst of requests with one long system prompt prefills it once."""

import time

import llamax

SYSTEM = (
    "<|im_start|>system\n"
    + " ".join(f"Rule {i}: answer briefly and precisely." for i in range(40))
    + "<|im_end|>\n"
)


def main() -> None:
    params = llamax.SamplingParams(max_tokens=16, temperature=0)
    with llamax.Context(n_ctx=4096, n_seq_max=8) as ctx:
        start = time.perf_counter()
        handles = [
            ctx.add_request(
                SYSTEM
                + f"<|im_start|>user\nName a colour, #{i}.<|im_end|>\n<|im_start|>assistant\n",
                params,
            )
            for i in range(8)
        ]
        for handle in handles:
            done = handle.result()
            print(f"{done.usage.cached_tokens:5d} cached  {done.text!r}")
        stats = ctx.stats()
        print(
            f"{time.perf_counter() - start:.1f}s, "
            f"prefilled {stats.sequences.num_prefill_tokens} tokens, "
            f"served {stats.sequences.num_cached_tokens} from the cache"
        )


if __name__ == "__main__":
    main()
