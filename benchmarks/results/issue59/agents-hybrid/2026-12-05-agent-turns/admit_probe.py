"""Time from a turn's submission to its first decode on the hybrid, and the backend calls
in between (issue 59 part 5).

Eight turns of one conversation whose replies come back tokenized differently (their first
token changed), as the random model's do through a chat client. ``python admit_probe.py``
steps the context by hand and profiles turns 2 and 6; ``python admit_probe.py auto`` runs
it on the background loop. Run from /tmp with ``PYTHONPATH`` set to the checkout to
measure; the model is written to ``/tmp/ag3``.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import llamax
import llamax.backend.llama_cpp as backend_module

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))  # benchmarks/
from _common import load_script

AUTO = len(sys.argv) > 1
CALLS: list[tuple[str, float, float]] = []


def record() -> None:
    cls = backend_module.LlamaCppBackend
    for name in ("decode", "state_seq_get", "state_seq_set", "seq_rm", "seq_cp"):
        method = getattr(cls, name)

        def timed(
            self: Any, *args: Any, _method: Any = method, _name: str = name, **kwargs: Any
        ) -> Any:
            start = time.perf_counter()
            result = _method(self, *args, **kwargs)
            CALLS.append((_name, start, time.perf_counter()))
            return result

        setattr(cls, name, timed)


def main() -> None:
    model = Path("/tmp/ag3/hybrid_350m.gguf")
    if not model.exists():
        model.parent.mkdir(parents=True, exist_ok=True)
        load_script("make_memory_model").write_memory_model(
            model, kind="hybrid_350m", tokenizer_from=llamax.default_model_path()
        )
    record()
    rng = np.random.default_rng(0)
    params = llamax.SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    with llamax.Context(model, n_ctx=16384, n_seq_max=4, n_threads=2, autostart=AUTO) as ctx:
        prompt = rng.integers(100, 40000, 631).tolist()
        for turn in range(8):
            CALLS.clear()
            handle = ctx.add_request(prompt, params)
            submitted = time.perf_counter()
            profile = cProfile.Profile() if turn in (2, 6) and not AUTO else None
            if profile is not None:
                profile.enable()
            while not AUTO and ctx.has_work():
                ctx.process()
                if profile is not None:
                    profile.disable()
                    print_profile(profile)
                    profile = None
            done = handle.result(60)
            first = next(c for c in CALLS if c[0] == "decode")
            before = [(c[0], round(1e3 * (c[2] - c[1]), 1)) for c in CALLS if c[1] < first[1]]
            print(
                f"turn {turn} n={len(prompt)} cached={done.usage.cached_tokens} "
                f"to first decode {1e3 * (first[1] - submitted):.1f} ms; {before}"
            )
            reply = [7777, *done.token_ids[1:]]  # the reply, tokenized differently
            prompt = [*prompt, *reply, *rng.integers(100, 40000, 214).tolist()]


def print_profile(profile: cProfile.Profile) -> None:
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(45)
    print(out.getvalue())


if __name__ == "__main__":
    main()
