"""Backend sampling on the fake (``FakeBackend(graph_sampling=True)``): which rows the
engine lets the decode sample, and llama.cpp's rules that abort a process when broken (a
chain attached twice, a graph-sampled row read as logits), checked by the fake on every
path that moves a sequence: queueing, preemption, a layout move, forks, drafts, cancels,
faults. The tokens must be the host's, request for request."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

import llamax
from llamax.testing import FakeBackend
from llamax.testing.idle import assert_idle

MakeFake = Callable[..., tuple[llamax.Context, FakeBackend]]


def run(ctx: llamax.Context, max_steps: int = 20_000) -> None:
    steps = 0
    while ctx.has_work():
        ctx.process()
        steps += 1
        assert steps < max_steps, "engine did not finish"


def mixed_requests(rng: random.Random, count: int) -> list[tuple[str, llamax.SamplingParams]]:
    """Plain sampled and greedy requests, with some that need their row on the host."""
    out = []
    for i in range(count):
        prompt = "".join(rng.choice("abcdefghij") for _ in range(rng.randint(1, 40)))
        kind = rng.choice(["sampled", "sampled", "greedy", "n2", "logprobs", "processor"])
        fields: dict[str, Any] = {"max_tokens": rng.randint(1, 24), "seed": 100 + i}
        if kind != "greedy":
            fields["temperature"] = rng.choice([0.5, 0.8, 1.3])
        else:
            fields["temperature"] = 0
        if kind == "n2":
            fields["n"] = 2
        if kind == "logprobs":
            fields["logprobs"] = 2
        if kind == "processor":
            fields["logits_processors"] = [lambda ids, row: None]
        out.append((prompt, llamax.SamplingParams(**fields)))
    return out


def outputs(
    requests: Sequence[tuple[str, llamax.SamplingParams]],
    cancels: dict[int, int] | None = None,
    **backend_options: Any,
) -> tuple[list[list[tuple[int, ...]]], FakeBackend]:
    """Every request's choices' tokens; ``cancels``: at step k, cancel request i."""
    backend = FakeBackend(**backend_options)
    ctx = llamax.Context(backend=backend, autostart=False)
    handles = [ctx.add_request(prompt, params) for prompt, params in requests]
    step = 0
    while ctx.has_work():
        if cancels and step in cancels:
            handles[cancels[step]].cancel()
        ctx.process()
        step += 1
        assert step < 20_000, "engine did not finish"
    got = [[c.token_ids for c in h.result(0).choices] for h in handles]
    assert_idle(ctx)
    assert backend.num_attached == 0, "a chain stayed attached after its sequence ended"
    ctx.close()
    return got, backend


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("kv_layout", ["unified", "streams", "auto"])
def test_the_decode_draws_what_the_host_draws(seed: int, kv_layout: str) -> None:
    rng = random.Random(seed)
    requests = mixed_requests(rng, 10)
    options: dict[str, Any] = {"n_seq_max": 4, "n_ctx": 512, "n_batch": 32}
    options["kv_layout"] = kv_layout
    cancels = {rng.randint(1, 40): rng.randrange(len(requests)) for _ in range(3)}
    host, _ = outputs(requests, cancels, **options)
    graph, backend = outputs(requests, cancels, graph_sampling=True, **options)
    assert graph == host
    assert backend.num_graph_draws > 0, "no row was sampled in the decode"


def test_rows_that_need_the_host_stay_there() -> None:
    """Logprobs, a processor, a grammar, n > 1's shared row: never sampled in the decode
    (the fake raises if their rows' logits were read after a graph draw)."""
    backend = FakeBackend(graph_sampling=True)
    ctx = llamax.Context(backend=backend, autostart=False)
    needs_host = [
        llamax.SamplingParams(max_tokens=6, temperature=0.8, logprobs=1, seed=1),
        llamax.SamplingParams(max_tokens=6, temperature=0.8, seed=2,
                              logits_processors=[lambda ids, row: None]),
        llamax.SamplingParams(max_tokens=6, temperature=0.8, seed=3, grammar="root ::= [a-z]{6}"),
    ]  # fmt: skip
    handles = [ctx.add_request("abc", p) for p in needs_host]
    run(ctx)
    assert all(len(h.result(0).token_ids) == 6 for h in handles)
    assert backend.num_graph_draws == 0 and backend.num_attaches == 0
    assert_idle(ctx)
    ctx.close()


def test_forks_sample_their_shared_row_on_the_host_then_their_own_in_the_decode() -> None:
    params = llamax.SamplingParams(max_tokens=8, temperature=0.9, n=3, seed=7)
    host, _ = outputs([("hello", params)])
    graph, backend = outputs([("hello", params)], graph_sampling=True)
    assert graph == host
    # the first token of each choice is drawn on the host from the parent's row, the other
    # seven of each in the decode
    assert backend.num_graph_draws == 3 * 7
    assert backend.num_attaches == 3


def test_preempted_sequences_take_fresh_chains_and_draw_on() -> None:
    """A sequence preempted (its id given to another) and recomputed keeps its generator:
    its chain is renewed when it leaves the id, never attached twice."""
    requests = [
        (p, llamax.SamplingParams(max_tokens=20, temperature=0.8, seed=i))
        for i, p in enumerate(["aaaa", "bbbb", "cccc", "dddd"])
    ]
    host, _ = outputs(requests, n_ctx=48, n_seq_max=4)
    backend = FakeBackend(n_ctx=48, n_seq_max=4, graph_sampling=True)
    ctx = llamax.Context(backend=backend, autostart=False)
    handles = [ctx.add_request(p, params) for p, params in requests]
    run(ctx)
    assert ctx.stats().num_preemptions >= 1
    assert [[c.token_ids for c in h.result(0).choices] for h in handles] == host
    assert backend.num_attaches > len(requests)  # re-attached after moving
    assert backend.num_attached == 0
    assert_idle(ctx)
    ctx.close()


def test_a_layout_move_renews_every_attached_chain() -> None:
    """``kv_layout="auto"``: a long prompt moves the cache to the unified layout while other
    sequences stream with attached chains (a new llama.cpp context); they draw on."""
    short = [
        ("ab" * 3, llamax.SamplingParams(max_tokens=40, temperature=0.8, seed=i)) for i in range(3)
    ]
    long = [("x" * 150, llamax.SamplingParams(max_tokens=4, temperature=0.8, seed=9))]
    options: dict[str, Any] = {"n_ctx": 256, "n_seq_max": 4, "kv_layout": "auto", "n_batch": 16}
    host, _ = outputs(short + long, **options)
    graph, backend = outputs(short + long, graph_sampling=True, **options)
    assert backend.num_relayouts >= 1
    assert graph == host


def test_a_sequence_that_may_draft_samples_on_the_host() -> None:
    params = llamax.SamplingParams(
        max_tokens=30, temperature=0.3, seed=5, speculative=llamax.PromptLookup()
    )
    prompt = "abcabcabcabcabcabc"
    host_ctx = llamax.Context(backend=FakeBackend(), autostart=False)
    graph_backend = FakeBackend(graph_sampling=True)
    graph_ctx = llamax.Context(backend=graph_backend, autostart=False)
    got = []
    for ctx in (host_ctx, graph_ctx):
        handle = ctx.add_request(prompt, params)
        run(ctx)
        got.append(handle.result(0).token_ids)
        assert_idle(ctx)
    assert got[0] == got[1]
    assert graph_ctx.stats().speculation.num_drafted_tokens > 0
    # a sequence that may draft never takes a graph chain (no attach and detach a step)
    assert graph_backend.num_attaches == 0 and graph_backend.num_graph_draws == 0
    host_ctx.close()
    graph_ctx.close()


def test_a_batch_hook_keeps_every_row_on_the_host() -> None:
    seen: list[int] = []

    def hook(rows: Sequence[Any], logits: npt.NDArray[np.float32]) -> None:
        seen.append(len(rows))

    backend = FakeBackend(graph_sampling=True)
    ctx = llamax.Context(backend=backend, autostart=False, batch_logits_processor=hook)
    handles = [
        ctx.add_request(p, llamax.SamplingParams(max_tokens=5, temperature=0.8, seed=1))
        for p in ("ab", "cd")
    ]
    run(ctx)
    assert all(len(h.result(0).token_ids) == 5 for h in handles)
    assert seen and backend.num_graph_draws == 0
    assert_idle(ctx)
    ctx.close()


def test_cancelled_and_failed_requests_leave_no_chain_attached() -> None:
    backend = FakeBackend(graph_sampling=True, n_seq_max=4)
    ctx = llamax.Context(backend=backend, autostart=False)
    calls = 0

    def fault(name: str) -> object:
        nonlocal calls
        if name == "new_sampler":
            calls += 1
            # calls 1-4 build the four samplers before the first decode; the second's
            # is built again when its row is sampled (call 5), and fails again
            if calls in (2, 5):
                raise RuntimeError("injected new_sampler failure")
        return None

    backend.fault = fault
    params = llamax.SamplingParams(max_tokens=30, temperature=0.8, seed=3)
    handles = [ctx.add_request(p, params) for p in ("aa", "bb", "cc", "dd")]
    for _ in range(6):
        ctx.process()
    handles[0].cancel()
    run(ctx)
    backend.fault = None
    ended = []
    for handle in handles[1:]:
        try:
            ended.append(len(handle.result(0).token_ids))
        except llamax.RequestFailedError:
            ended.append(-1)
    assert sorted(ended) == [-1, 30, 30], ended
    assert backend.num_graph_draws > 0
    assert backend.num_attached == 0
    assert_idle(ctx)
    ctx.close()


def test_the_audit_reports_a_chain_left_attached() -> None:
    """A backend that frees a sampler without detaching its chain (llama.cpp would then run
    a freed chain) is caught by ``Context.audit()``, which ``assert_idle`` runs."""

    class Leaky(FakeBackend):
        def free_sampler(self, sampler: Any) -> None:
            self.live_samplers.discard(id(sampler))  # the chain stays attached

    backend = Leaky(graph_sampling=True)
    ctx = llamax.Context(backend=backend, autostart=False)
    ctx.add_request("ab", llamax.SamplingParams(max_tokens=3, temperature=0.8, seed=1))
    run(ctx)
    problems = ctx.audit()
    assert any("attached to sequence ids" in p for p in problems), problems
    ctx.close()
