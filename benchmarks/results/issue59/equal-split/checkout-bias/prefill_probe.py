"""A lone ~2,900-token prefill on a manual SmolLM2 context, timed: run alternated from two
checkouts of the same commit (``PYTHONPATH``) to see whether where the code lies biases a
pair. Usage, from /tmp: ``PYTHONPATH=CHECKOUT .venv/bin/python .../prefill_probe.py``"""

import time

import llamax


def main() -> None:
    ctx = llamax.Context(
        llamax.default_model_path(), n_ctx=8192, n_seq_max=8, n_threads=2, autostart=False
    )
    prompt = " ".join(
        f"Note {i}: the lighthouse keeper logged the weather at dawn." for i in range(200)
    )
    started = time.perf_counter()
    handle = ctx.add_request(prompt, llamax.SamplingParams(max_tokens=1, temperature=0.0))
    while ctx.process():
        pass
    handle.result()
    seconds = time.perf_counter() - started
    print(f"prefill {seconds:.2f} s", ctx.stats().num_prefill_tokens)
    ctx.close()


if __name__ == "__main__":
    main()
