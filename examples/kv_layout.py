"""The adaptive KV layout: short requests run in KV streams of their own; a long prompt
moves every sequence into one unified buffer, mid-stream, and short ones move them back."""

import llamax


def counting(start: int, n: int) -> str:
    return ", ".join(str(start + k) for k in range(n)) + ","


def show(ctx: llamax.Context, when: str) -> None:
    stats = ctx.stats()
    print(
        f"{when:<34} layout={stats.kv.layout:<8} moves={stats.kv.num_relayouts} "
        f"cells={stats.kv.cells_total} ({stats.kv.bytes_total / 2**20:.0f} MiB)"
    )


def main() -> None:
    params = llamax.SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    with llamax.Context(n_ctx=2048, n_seq_max=4) as ctx:
        show(ctx, "start")
        print(
            f"a sequence may hold {ctx.n_ctx_seq} tokens; its own stream holds "
            f"{ctx.stats().kv.cells_per_stream}"
        )
        shorts = [ctx.add_request(counting(10 * i, 5), params) for i in range(2)]
        for handle in shorts:
            next(iter(handle))  # both decoding, each in its own stream
        show(ctx, "two short requests decoding")
        long = ctx.add_request(counting(1000, 150), llamax.SamplingParams(max_tokens=8))
        long.result()
        show(ctx, "after a ~900-token prompt")
        for handle in shorts:
            print("  short:", handle.result().text[:40], "...")
        many = [ctx.add_request(counting(100 * i, 5), params) for i in range(3)]
        for handle in many:
            handle.result()
        show(ctx, "after three more short requests")


if __name__ == "__main__":
    main()
