"""Issue 59 part 5 probe: where a one-stream decode step's time goes outside ``llama_decode``.

One request (a short prompt, ``--tokens`` greedy tokens, end-of-generation ignored) on a
manual context (``autostart=False``, ``process()`` on this thread), after a 16-token warm-up
request. The engine's phases are timed by wrapping their functions (``perf_counter`` around
each call, no profiler); the wrappers add ~1-2 us a call. ``overhead`` is the step's wall
time less ``llama_decode``'s. Prints one line a phase, ms per step, then llama.cpp's count of
reused graphs.

Usage, from the repository root::

    .venv/bin/python benchmarks/results/issue59/step-overhead/step_overhead_probe.py \
        [--tokens 256] [--model PATH]
"""

from __future__ import annotations

import argparse
import collections
import functools
import time
from collections.abc import Callable
from typing import Any

import llama_cpp.llama_cpp as C

import llamax
import llamax.engine.loop as loop_module
import llamax.engine.sched.step_planner as planner_module
import llamax.engine.step as step_module
import llamax.engine.timing.step_budget as budget_module
from llamax.engine.sched.scheduler import Scheduler

SPENT: dict[str, float] = collections.defaultdict(float)


def wrap(owner: Any, name: str, label: str) -> None:
    """Time every call of ``owner.name`` into ``SPENT[label]``."""
    function: Callable[..., Any] = getattr(owner, name)

    @functools.wraps(function)
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            SPENT[label] += time.perf_counter() - start

    setattr(owner, name, timed)


def classes_with(module: Any, *names: str) -> list[type]:
    return [
        cls
        for cls in vars(module).values()
        if isinstance(cls, type) and cls.__module__ == module.__name__
        and all(hasattr(cls, n) for n in names)
    ]  # fmt: skip


def instrument() -> list[Any]:
    """Wrap the phases; return a list that receives the first context pointer decoded."""
    contexts: list[Any] = []
    decode = C.llama_decode

    def first_context(ctx: Any, batch: Any) -> int:
        if not contexts:
            contexts.append(ctx)
        return int(decode(ctx, batch))

    C.llama_decode = first_context
    wrap(C, "llama_decode", "llama_decode")
    for cls in classes_with(loop_module, "_publish_snapshot", "_step"):
        wrap(cls, "_step", "step (all)")
        wrap(cls, "_publish_snapshot", "stats snapshot")
    wrap(Scheduler, "schedule", "schedule")
    wrap(Scheduler, "update", "update (tokens, stops, events)")
    wrap(Scheduler, "observe", "observe (cost fit, drafts)")
    wrap(step_module, "sample_plan", "sample")
    wrap(budget_module.StepCostModel, "observe", "  cost fit")
    wrap(budget_module.np.linalg, "eigh", "    its eigh")
    for cls in classes_with(planner_module, "build", "start", "features"):
        wrap(cls, "features", "step features")
    return contexts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    contexts = instrument()
    model = args.model or llamax.default_model_path()
    ctx = llamax.Context(model, n_ctx=16384, n_seq_max=4, n_threads=2, autostart=False)
    prompt = "Write a short story about a lighthouse keeper:"
    warm = ctx.add_request(prompt, llamax.SamplingParams(max_tokens=16, temperature=0.0))
    while ctx.process():
        pass
    warm.result()
    SPENT.clear()
    params = llamax.SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    handle = ctx.add_request(prompt, params)
    steps, start = 1, time.perf_counter()
    while ctx.process():
        steps += 1
    wall = time.perf_counter() - start
    handle.result()
    print(f"model {model}")
    print(f"steps {steps}, wall {1000 * wall / steps:.3f} ms a step, overhead "
          f"{1000 * (wall - SPENT['llama_decode']) / steps:.3f} ms a step")  # fmt: skip
    for label, seconds in sorted(SPENT.items(), key=lambda kv: -kv[1]):
        print(f"  {label:32s} {1000 * seconds / steps:7.3f} ms a step")
    perf = C.llama_perf_context(contexts[0])
    print(f"graphs reused {perf.n_reused} of {perf.n_eval + perf.n_p_eval} decodes")
    ctx.close()


if __name__ == "__main__":
    main()
