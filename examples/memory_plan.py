"""Planning a context's memory before creating it (docs/memory.md).

Plans the default model at a few sizes and KV types against 4 GiB, finds the largest
context that fits in 1 GiB, creates it, and shows the refusal of one that cannot fit
anywhere. Nothing is allocated by a plan: llama.cpp sizes the context on the model's
metadata. (Past the model's trained context, 8,192 tokens for SmolLM2, llama.cpp warns:
the plan is about memory alone.)
"""

import llamax

MIB = 1 << 20
MEMORY = 4 << 30


def show(plan: llamax.MemoryPlan) -> None:
    print(
        f"n_ctx={plan.n_ctx:>7,} n_seq_max={plan.n_seq_max:>2} {plan.kv_type_k:>5}: "
        f"KV {plan.kv_bytes / MIB:7.1f} MiB ({plan.kv_bytes_per_cell:,} B a cell, "
        f"{plan.kv_layout}), compute {plan.compute_bytes / MIB:5.1f} MiB, "
        f"total {plan.total_bytes / MIB:6.0f} MiB: {'fits' if plan.fits else 'does not fit'}"
        f" (largest n_ctx {plan.max_n_ctx:,})"
    )


def main() -> None:
    for kv_type in ("f16", "q8_0", "q4_0"):
        for n_ctx, n_seq_max in ((8192, 4), (32768, 16)):
            show(
                llamax.plan_memory(
                    n_ctx=n_ctx, n_seq_max=n_seq_max, kv_type=kv_type, memory_bytes=MEMORY
                )
            )
    largest = llamax.plan_memory(n_ctx=4096, n_seq_max=1, kv_type="q8_0", memory_bytes=1 << 30)
    with llamax.Context(n_ctx=largest.max_n_ctx, n_seq_max=1, kv_type="q8_0") as ctx:
        print(f"created: {ctx.n_ctx:,} cells, {ctx.stats().kv.bytes_total / MIB:.0f} MiB of KV")
    try:
        llamax.Context(n_ctx=1 << 24, n_seq_max=1)  # 360 GiB of KV cache
    except llamax.InsufficientMemoryError as refused:
        print(f"refused: {refused}")


if __name__ == "__main__":
    main()
