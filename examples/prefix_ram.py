"""The host-RAM prefix tier: long system prompts cycled through a KV cache that holds two.

Six assistants, each with its own ~600-token system prompt, answer in turn, twice. The
context has room for only two of them in KV, so by its second turn an assistant's prefix
was evicted: with ``prefix_ram_bytes`` it waits in RAM and is restored, without it it is
computed again. Prints each second-round time to first token and the tier's counters.
"""

import time

import llamax

ASSISTANTS = ("billing", "shipping", "returns", "warranty", "accounts", "repairs")


def system(topic: str) -> str:
    rules = " ".join(f"Rule {i} about {topic}: answer briefly and precisely." for i in range(60))
    return f"<|im_start|>system\nYou handle {topic}. {rules}<|im_end|>\n"


def ttft(ctx: llamax.Context, prompt: str) -> float:
    start = time.perf_counter()
    handle = ctx.add_request(prompt, llamax.SamplingParams(max_tokens=4, temperature=0))
    next(iter(handle))
    elapsed = time.perf_counter() - start
    handle.result()
    return elapsed


def second_round(prefix_ram_bytes: int) -> list[float]:
    with llamax.Context(n_ctx=2048, n_seq_max=2, prefix_ram_bytes=prefix_ram_bytes) as ctx:
        times = []
        for turn in ("Hello!", "Thanks, and one more question?"):
            times = [
                ttft(ctx, f"{system(t)}<|im_start|>user\n{turn}<|im_end|>\n<|im_start|>assistant\n")
                for t in ASSISTANTS
            ]
        stats = ctx.stats()
        print(
            f"prefix_ram_bytes={prefix_ram_bytes}: {stats.prefix_ram.num_restores} restores, "
            f"{stats.prefix_ram.num_entries} entries "
            f"({stats.prefix_ram.num_bytes / 1e6:.0f} MB) in RAM, "
            f"{stats.sequences.num_prefill_tokens} prompt tokens computed"
        )
        return times


def main() -> None:
    with_tier = second_round(512 << 20)
    without = second_round(0)
    for topic, a, b in zip(ASSISTANTS, with_tier, without, strict=True):
        print(
            f"{topic:9s} second turn TTFT: {a * 1000:6.1f} ms with the tier, "
            f"{b * 1000:6.1f} ms without"
        )


if __name__ == "__main__":
    main()
