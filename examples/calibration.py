"""This machine's step costs: timed at load once, then read from the cache.

The time-budgeted steps (``max_step_ms``) and the pricing of speculative drafts start from
them instead of numbers fitted on another machine (docs/kv-cache.md, "Calibration").
"""

import time

import llamax


def main() -> None:
    for attempt in ("first load", "second load"):
        started = time.perf_counter()
        with llamax.Context(n_ctx=4096, n_seq_max=4) as ctx:
            loaded = time.perf_counter() - started
            cal = ctx.calibration
            if cal is None:
                print("this model could not be calibrated; the built-in prior is used")
                return
            print(
                f"{attempt}: {loaded:.2f} s; a step costs {cal.fixed_s * 1e3:.1f} ms "
                f"+ {cal.token_s * 1e3:.2f} ms a token + {cal.attention_s * 1e6:.2f} us an "
                f"attended cell (timed over {cal.depth} cells, {cal.num_steps} steps, "
                f"{cal.measured_s:.2f} s when measured)"
            )
    with llamax.Context(n_ctx=4096, n_seq_max=4, calibrate=False) as ctx:
        print(f"calibrate=False: {ctx.calibration}")


if __name__ == "__main__":
    main()
