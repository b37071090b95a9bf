"""Issue 59 part 5 probe: what ``Scheduler.schedule`` does in a one-stream decode step.

The setup of ``../step_overhead_probe.py`` (one greedy request on a manual context), with
``cProfile`` switched on only inside ``Scheduler.schedule``; prints the functions by their
own time (a profiler inflates small calls: read it for the ranking, time it with the probe).

Usage, from this folder::

    ../../../../../.venv/bin/python schedule_profile.py [--tokens 256] [--model PATH]
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import pstats
from typing import Any

import llamax
from llamax.engine.sched.scheduler import Scheduler

PROFILE = cProfile.Profile()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--model", default=None)
    parser.add_argument("--lines", type=int, default=35)
    args = parser.parse_args()
    schedule = Scheduler.schedule
    counting = [False]

    @functools.wraps(schedule)
    def profiled(self: Any, *a: Any, **k: Any) -> Any:
        if not counting[0]:
            return schedule(self, *a, **k)
        PROFILE.enable()
        try:
            return schedule(self, *a, **k)
        finally:
            PROFILE.disable()

    Scheduler.schedule = profiled  # type: ignore[method-assign]
    model = args.model or llamax.default_model_path()
    ctx = llamax.Context(model, n_ctx=16384, n_seq_max=4, n_threads=2, autostart=False)
    prompt = "Write a short story about a lighthouse keeper:"
    warm = ctx.add_request(prompt, llamax.SamplingParams(max_tokens=16, temperature=0.0))
    while ctx.process():
        pass
    warm.result()
    params = llamax.SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    handle = ctx.add_request(prompt, params)
    counting[0] = True
    steps = 1
    while ctx.process():
        steps += 1
    counting[0] = False
    handle.result()
    ctx.close()
    print(f"model {model}, {steps} steps")
    stats = pstats.Stats(PROFILE)
    stats.sort_stats("tottime").print_stats(args.lines)
    stats.sort_stats("cumulative").print_stats(args.lines)


if __name__ == "__main__":
    main()
