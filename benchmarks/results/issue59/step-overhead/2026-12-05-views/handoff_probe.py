"""One stream, 256 greedy tokens on a background-loop context: the time from submission to
the last token when the caller iterates the tokens (a wake-up a token) against waiting on
the future alone; alternated, 5 rounds. Prints ms a token.

Usage, from /tmp: ``.venv/bin/python .../handoff_probe.py [MODEL]``
"""

import statistics
import sys
import time

import llamax

N = 256


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else llamax.default_model_path()
    ctx = llamax.Context(model, n_ctx=4096, n_seq_max=4, n_threads=2)
    prompt = "Write a short story about a lighthouse keeper:"
    params = llamax.SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)
    ctx.add_request(prompt, llamax.SamplingParams(max_tokens=16, temperature=0.0)).result()
    times: dict[str, list[float]] = {"iterate": [], "result": []}
    for round_ in range(5):
        for mode in ["iterate", "result"] if round_ % 2 == 0 else ["result", "iterate"]:
            started = time.perf_counter()
            handle = ctx.add_request(prompt, params)
            if mode == "iterate":
                for _ in handle:
                    pass
            handle.result()
            times[mode].append(1000 * (time.perf_counter() - started) / N)
    for mode, values in times.items():
        rounded = [round(v, 3) for v in values]
        print(mode, rounded, "median", round(statistics.median(values), 3))
    ctx.close()


if __name__ == "__main__":
    main()
