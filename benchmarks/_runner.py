"""The shared runner of workload benchmarks: workloads, systems, the timed repeat loop and
the tables every report derives from it.

A :class:`Workload` is N prompts of one kind and the N it runs at. A *system* is a
:data:`Run`: prompts and sampling parameters in, a :class:`RunResult` out (what was
generated, how long it took, what was drafted); :func:`llamax_run` and :func:`lcp_run` make
one from a ``llamax.Context`` or a llama-cpp-python peer. :func:`measure` warms every system
up and then times every (repeat, workload, N, system), the system order rotating so that no
system always runs first. Only the public llamax API is used.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

from _common import TokenTimes, agreement, in_fresh_thread, log, ratio, stats_delta
from _peers import LlamaCppPythonPeer

import llamax

__all__ = [
    "Run",
    "RunResult",
    "Runs",
    "Workload",
    "lcp_run",
    "llamax_run",
    "measure",
    "median_table",
    "ratio_table",
    "samples",
    "worst",
]


@dataclass(frozen=True)
class Workload:
    """N prompts of one kind, how many tokens each may make, and at which N it runs."""

    name: str
    kind: str  # e.g. "copy-heavy", "free text" or "throughput"
    prompt: Callable[[int], str]
    max_tokens: int
    ns: tuple[int, ...]
    ignore_eos: bool = False
    systems: tuple[str, ...] | None = None  # the systems it runs on (None: all)

    def prompts(self, n: int) -> list[str]:
        """Prompts ``0 .. n-1``."""
        return [self.prompt(i) for i in range(n)]

    def runs_on(self, system: str) -> bool:
        """Whether ``system`` runs this workload."""
        return self.systems is None or system in self.systems

    def params(self) -> llamax.SamplingParams:
        """Greedy, ``max_tokens``; the system decides whether to speculate."""
        return llamax.SamplingParams(
            max_tokens=self.max_tokens, temperature=0.0, ignore_eos=self.ignore_eos
        )


@dataclass(frozen=True)
class RunResult:
    """One timed run of one system on N requests."""

    seconds: float
    first_token_s: float  # llamax: when the last first token came; Llama: sum of prefills
    token_ids: tuple[tuple[int, ...], ...]
    drafted: int
    accepted: int
    stats: dict[str, int] | None = None  # llamax with speculation: ctx.stats() deltas

    @property
    def tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after each request's first, over the time after the last first token."""
        rest = self.seconds - self.first_token_s
        return (self.tokens - len(self.token_ids)) / rest if rest > 0 else float("nan")

    def sample(self) -> dict[str, Any]:
        extra = {} if self.stats is None else {"stats": self.stats}
        return {
            "tokens": self.tokens,
            "seconds": round(self.seconds, 4),
            "tokens_per_s": round(self.tokens_per_s, 2),
            "first_token_s": round(self.first_token_s, 4),
            "decode_tokens_per_s": round(self.decode_tokens_per_s, 2),
            "drafted_tokens": self.drafted,
            "accepted_tokens": self.accepted,
            **extra,
        }


Run = Callable[[Sequence[str], llamax.SamplingParams], RunResult]
Runs = dict[str, dict[str, dict[int, list[RunResult]]]]  # workload -> system -> N -> runs


def llamax_run(
    ctx: llamax.Context, *, spec: bool, speculative: llamax.PromptLookup | None = None
) -> Run:
    """N ``add_request`` calls at once, then every result; the KV cache cleared first.
    ``speculative``: each request asks for it (``SamplingParams.speculative``)."""

    def run(prompts: Sequence[str], params: llamax.SamplingParams) -> RunResult:
        if speculative is not None:
            params = dataclasses.replace(params, speculative=speculative)
        ctx.clear_cache()  # untimed: no prompt reuse between runs
        before = ctx.stats()
        start = time.perf_counter()
        handles = [ctx.add_request(p, params) for p in prompts]
        streams = [TokenTimes(h) for h in handles]  # first-token times (the prefill's end)
        done = [h.result() for h in handles]
        seconds = time.perf_counter() - start
        first = max(s.wait()[0] for s in streams) - start
        ids = tuple(c.token_ids for c in done)
        if not spec:
            return RunResult(seconds, first, ids, 0, 0)
        drafted = sum(c.usage.drafted_tokens for c in done)
        accepted = sum(c.usage.accepted_tokens for c in done)
        stats = stats_delta(before, ctx.stats(), ["drafted_tokens", "accepted_tokens", "steps"])
        return RunResult(seconds, first, ids, drafted, accepted, stats)

    return run


def lcp_run(peer: LlamaCppPythonPeer) -> Run:
    """``Llama.generate`` for each prompt in turn, on a thread of its own."""

    def run(prompts: Sequence[str], params: llamax.SamplingParams) -> RunResult:
        def body() -> RunResult:
            start = time.perf_counter()
            outs, prefill_s = [], 0.0
            for p in prompts:  # one after another: each request's wait for its first
                began = time.perf_counter()  # token is its own prefill
                outs.append(peer.generate_ids(p, params.max_tokens or 0, ban_eog=params.ignore_eos))
                prefill_s += outs[-1].first_token_at - began
            seconds = time.perf_counter() - start
            ids = tuple(o.token_ids for o in outs)
            drafted = sum(o.drafted_tokens for o in outs)
            accepted = sum(o.accepted_tokens for o in outs)
            return RunResult(seconds, prefill_s, ids, drafted, accepted)

        return in_fresh_thread(body)

    return run


def measure(
    systems: dict[str, Run],
    loads: Sequence[Workload],
    repeats: int,
    *,
    peers: Collection[str] = (),
    peer_ns: Collection[int] = (),
) -> Runs:
    """Warm up every system, then every (repeat, workload, N, system), order rotating;
    the systems in ``peers`` only at N in ``peer_ns``."""
    for name, run in systems.items():
        run(["Hello"], dataclasses.replace(loads[0].params(), max_tokens=8))
        log(f"warmed up {name}")
    names = list(systems)
    runs: Runs = {w.name: {s: {} for s in names if w.runs_on(s)} for w in loads}
    for repeat in range(repeats):
        order = names[repeat % len(names) :] + names[: repeat % len(names)]
        for load in loads:
            for n in load.ns:
                for name in order:
                    if not load.runs_on(name) or (name in peers and n not in peer_ns):
                        continue
                    result = systems[name](load.prompts(n), load.params())
                    runs[load.name][name].setdefault(n, []).append(result)
                    rate = f"{result.accepted}/{result.drafted}" if result.drafted else "-"
                    log(
                        f"repeat {repeat + 1}/{repeats} {load.name:<5} N={n:<3} {name:<24}"
                        f"{result.tokens_per_s:8.1f} tok/s, {result.decode_tokens_per_s:6.1f} "
                        f"after prefill ({result.tokens} tokens, "
                        f"{result.seconds:.2f} s, accepted/drafted {rate})"
                    )
    return runs


def median_table(
    runs: Runs, load: Workload, *, decode: bool = False
) -> dict[str, dict[str, float | None]]:
    """``{system: {N: median tokens/s}}`` of one workload (after the prefill: ``decode``)."""

    def med(system: str, n: int) -> float | None:
        rs = runs[load.name].get(system, {}).get(n)
        values = [r.decode_tokens_per_s if decode else r.tokens_per_s for r in rs or []]
        return round(statistics.median(values), 2) if values else None

    return {s: {str(n): med(s, n) for n in load.ns} for s in runs[load.name]}


def ratio_table(
    table: dict[str, dict[str, float | None]], pairs: Sequence[tuple[str, str]], load: Workload
) -> dict[str, dict[str, float | None]]:
    """``{"<num>_over_<den>": {N: ratio}}`` for each pair of systems both in ``table``."""
    ns = [str(n) for n in load.ns]
    return {
        f"{num}_over_{den}": {k: ratio(table[num][k], table[den][k]) for k in ns}
        for num, den in pairs
        if num in table and den in table
    }


def worst(runs: Sequence[RunResult], references: Sequence[RunResult]) -> dict[str, Any]:
    """The agreement (``_common.agreement``) of the run least like any of ``references``:
    each run is compared with the reference most like it.

    Greedy runs of llamax without speculation are not all alike: on the same context, the
    KV cells a run gets (after earlier runs) change llama.cpp's numerics at near ties.
    """

    def score(c: dict[str, Any]) -> int:
        return int(c["identical"])

    best = [
        max((agreement(r.token_ids, ref.token_ids) for ref in references), key=score) for r in runs
    ]
    return min(best, key=score)


def samples(runs: Runs) -> dict[str, Any]:
    """Every run's :meth:`RunResult.sample`, by workload, system and N."""
    return {
        w: {
            s: {str(n): [r.sample() for r in rs] for n, rs in by_n.items()}
            for s, by_n in by_system.items()
        }
        for w, by_system in runs.items()
    }
