"""Backend sampling (issue 62) on SmolLM2, llama.cpp's CPU backend: the chains llamax
attaches to sequence ids sample in the decode the tokens llama.cpp's chain samples on the
host, token for token: step after step, for the common mixes (penalties included), across
a row sampled on the host between graph draws (the chain renewed, its generator carried on)
and a move of the KV cache to a new context; and through the public API, a workload of
concurrent seeded requests (forks, logprobs, a grammar, penalties beside plain chains)
replies the same with ``backend_sampling`` on and off."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest

import llamax
from llamax.backend.base import BatchItem
from llamax.backend.llama_cpp import LlamaCppBackend
from llamax.config import ContextConfig
from llamax.params import SamplingParams
from llamax.server import BackgroundServer, create_app
from llamax.testing.idle import assert_idle

pytestmark = pytest.mark.model

MIXES: dict[str, dict[str, Any]] = {
    "defaults": {"temperature": 0.8},
    "top-k 200, top-p 0.9": {"temperature": 1.0, "top_k": 200, "top_p": 0.9, "min_p": 0.0},
    "repeat penalty": {"temperature": 0.8, "repeat_penalty": 1.3, "penalty_last_n": 16},
    "presence and frequency": {"temperature": 0.9, "presence_penalty": 0.5,
                               "frequency_penalty": 0.4},
    "greedy": {"temperature": 0.0},
    "greedy, penalty": {"temperature": 0.0, "repeat_penalty": 1.5},
    "a logit bias": {"temperature": 1.1, "logit_bias": {28: 3.0, 30: -2.0, 2: float("-inf")}},
}  # fmt: skip
PROMPTS = (
    "Once upon a time",
    "The three primary colours are",
    "def fibonacci(n):",
    "Dear diary, today I",
)
N_SEQ = 6
STEPS = 24
HOST_STEP = 9
"""At this step half the sequences' rows are sampled on the host (their chains leave the
ids and are renewed), then the graph samples them again."""
MOVE_STEP = 16
"""Before this step the cache moves to the unified layout: a new context, every chain
renewed."""


def backend_for(model_path: Path, graph: bool) -> LlamaCppBackend:
    return LlamaCppBackend(
        ContextConfig(
            model_path=str(model_path), n_ctx=2048, n_seq_max=N_SEQ, n_threads=2,
            kv_layout="auto", backend_sampling=graph,
        )
    )  # fmt: skip


@pytest.mark.parametrize("mix", MIXES.values(), ids=MIXES.keys())
def test_the_decode_draws_the_chains_tokens(model_path: Path, mix: dict[str, Any]) -> None:
    """Two contexts decode the same batches: one samples every row with llama.cpp's chain
    on the host, the other in the graph (all rows, so no logits reach the host)."""
    params = SamplingParams(**mix)
    seeds = [11 * i + 3 for i in range(N_SEQ)]
    host, graph = backend_for(model_path, False), backend_for(model_path, True)
    assert graph.samples_in_graph and not host.samples_in_graph
    host._host_sampling = False  # the reference: llama.cpp's own chain
    chains = [host.new_sampler(params, seed, []) for seed in seeds]
    drawn = [graph.new_sampler(params, seed, [], graph=True) for seed in seeds]
    assert all(s.graph for s in drawn)
    prompts = [graph.tokenize(PROMPTS[i % len(PROMPTS)], parse_special=False) for i in range(N_SEQ)]
    parts = [(seq_id, tokens, 0) for seq_id, tokens in enumerate(prompts)]
    try:
        for step in range(STEPS):
            if step == MOVE_STEP:
                assert graph.can_relayout
                host.relayout(True)
                graph.relayout(True)
            on_host = step == HOST_STEP
            items = batch(parts)
            graph_items = [
                BatchItem(i.seq_id, i.token_ids, i.start_pos, i.rows,
                          sampler=None if on_host and i.seq_id % 2 else drawn[i.seq_id])
                for i in items
            ]  # fmt: skip
            assert host.decode(items) == 0
            assert graph.decode(graph_items) == 0
            rows = [item.rows[0] for item in items]
            if on_host:  # from the rows' logits (llama_sampler_sample would take the
                # graph's token, had the graph sampled the row)
                want = [sample_drawn(host, s, row) for s, row in zip(chains, rows, strict=True)]
                got = [
                    sample_drawn(graph, s, row) if i % 2 else graph.sample(s, row)
                    for i, (s, row) in enumerate(zip(drawn, rows, strict=True))
                ]
            else:
                want = [host.sample(s, row) for s, row in zip(chains, rows, strict=True)]
                got = graph.sample_rows(drawn, rows)
            assert got == want, (step, mix)
            parts = [
                (item.seq_id, [token], item.start_pos + len(item.token_ids))
                for item, token in zip(items, want, strict=True)
            ]
        graph_chains = graph._graph
        assert graph_chains is not None
        assert graph_chains.num_draws == N_SEQ * STEPS - N_SEQ // 2
        # attached at the start, again after the host step (half), again after the move
        assert graph_chains.num_attaches == N_SEQ + N_SEQ // 2 + N_SEQ
    finally:
        for sampler in chains:
            host.free_sampler(sampler)
        for sampler in drawn:
            graph.free_sampler(sampler)
        assert graph._graph is not None and graph._graph.num_attached == 0
        host.close()
        graph.close()


def test_a_chain_over_the_whole_vocabulary_stays_on_the_host(model_path: Path) -> None:
    """Without top-k, llama.cpp's graph sorts and softmaxes the whole vocabulary with other
    sums than its host chain (measured: a sequence's token parted at its third step);
    top-k without top-p leaves the candidates in ggml's order, not sorted (parted at the
    first step); such chains, typical-p and a grammar are not offered to the graph."""
    backend = backend_for(model_path, True)
    try:
        for params, grammar in (
            (SamplingParams(temperature=1.0, top_k=0, top_p=0.9), None),
            (SamplingParams(temperature=1.2, top_k=40, top_p=1.0, min_p=0.0), None),
            (SamplingParams(temperature=0.8, typical_p=0.9), None),
            (SamplingParams(temperature=0.8), 'root ::= "a"'),
        ):
            sampler = backend.new_sampler(params, 1, [], grammar=grammar, graph=True)
            assert not sampler.graph
            backend.free_sampler(sampler)
    finally:
        backend.close()


def sample_drawn(backend: LlamaCppBackend, sampler: Any, row: int) -> int:
    return backend.sample_drawn(sampler, row, 1).token


def batch(parts: list[tuple[int, list[int], int]]) -> list[BatchItem]:
    """One item per ``(seq_id, tokens, start_pos)``, each wanting its last token's row."""
    items, offset = [], 0
    for seq_id, tokens, start in parts:
        offset += len(tokens)
        items.append(BatchItem(seq_id, tokens, start, (offset - 1,)))
    return items


def test_a_workload_replies_the_same_with_backend_sampling(model_path: Path) -> None:
    """Through ``llamax.Context``, streams, fixed threads, whole prompts and no prefix reuse
    (a row's logits then do not depend on what runs beside it): seeded requests of every
    kind, more than there are sequence ids, the same tokens with ``backend_sampling`` on
    and off."""
    replies = []
    for graph in (False, True):
        with llamax.Context(
            model_path, n_ctx=4096, n_seq_max=4, kv_layout="streams", n_threads=2,
            adapt_threads=False, calibrate=False, backend_sampling=graph, prefix_cache=False,
            max_step_ms=None,
        ) as ctx:  # fmt: skip
            handles = []
            for i, mix in enumerate([*MIXES.values(), *EXTRA]):
                params = SamplingParams(**mix, max_tokens=20, seed=500 + i)
                handles.append(ctx.add_request(PROMPTS[i % len(PROMPTS)], params))
            replies.append([tuple(c.token_ids for c in h.result(300).choices) for h in handles])
            chains = ctx._backend._graph  # type: ignore[attr-defined]
            if graph:
                assert chains.num_draws > 0
            assert_idle(ctx)
            if graph:
                assert chains.num_attached == 0
    assert replies[0] == replies[1]


EXTRA: tuple[dict[str, Any], ...] = (
    {"temperature": 1.0, "top_k": 0, "top_p": 0.9},
    {"temperature": 1.2, "top_k": 40, "top_p": 1.0, "min_p": 0.0},
    {"temperature": 0.8, "n": 3},
    {"temperature": 0.8, "logprobs": 2},
    {"temperature": 0.8, "grammar": 'root ::= "yes" | "no"'},
    {"temperature": 0.7, "typical_p": 0.9},
    {"temperature": 0.7, "ignore_eos": True},
)
"""Requests whose rows (some or all) stay on the host."""


def test_over_http_the_openai_client_gets_the_same_replies(model_path: Path) -> None:
    """``llamax serve --backend-sampling`` in-process: seeded chat completions through the
    ``openai`` client (four at once, one with ``n`` = 2 and one with logprobs) reply as
    with the option off."""
    import concurrent.futures

    bodies: list[dict[str, Any]] = [
        {"seed": 1, "temperature": 0.8, "top_p": 0.95},
        {"seed": 2, "temperature": 0.9, "top_p": 0.9, "n": 2},
        {"seed": 3, "temperature": 0.8, "top_p": 0.95, "logprobs": True, "top_logprobs": 2},
        {"seed": 4, "temperature": 0.0},
    ]
    replies = []
    for graph in (False, True):
        with llamax.Context(
            model_path, n_ctx=4096, n_seq_max=4, kv_layout="streams", n_threads=2,
            adapt_threads=False, calibrate=False, backend_sampling=graph, prefix_cache=False,
            max_step_ms=None,
        ) as ctx, BackgroundServer(create_app(ctx)) as server:  # fmt: skip
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")

            def ask(body: dict[str, Any], client: openai.OpenAI = client) -> list[str | None]:
                done = client.chat.completions.create(
                    model="llamax",
                    messages=[{"role": "user", "content": "Name a colour and a fruit."}],
                    max_tokens=16,
                    **body,
                )
                return [choice.message.content for choice in done.choices]

            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                replies.append(list(pool.map(ask, bodies)))
            chains = ctx._backend._graph  # type: ignore[attr-defined]
            if graph:
                assert chains.num_draws > 0
            assert_idle(ctx)
    assert replies[0] == replies[1]


def test_under_kv_pressure_with_cancels_every_request_settles(model_path: Path) -> None:
    """llama.cpp aborts the process when a chain is attached twice or sampled on the host
    after an attach: 8 sampled streams of 100-token prompts x 200 tokens in ``n_ctx=512``,
    4 ids (the cache moves to the unified layout and preempts, every chain renewed and
    attached again), beside requests that stay on the host (n = 2, logprobs, a grammar,
    speculative decoding), three cancelled from another thread once a preemption happened:
    every request settles, the engine is idle after and no chain stays attached."""
    import random
    import threading
    import time

    rng = random.Random(4)
    with llamax.Context(
        model_path, n_ctx=512, n_seq_max=4, n_threads=2, calibrate=False, backend_sampling=True
    ) as ctx:
        body = ctx.tokenize(" The river ran past the old mill and on to the sea." * 8)[:99]
        handles = []
        for i in range(12):
            fields: dict[str, Any] = {"max_tokens": 200, "seed": i, "ignore_eos": True}
            fields |= {"temperature": 0.8} if i < 8 else {"temperature": 0.7}
            if i == 8:
                fields["n"] = 2
            elif i == 9:
                fields["logprobs"] = 1
            elif i == 10:
                fields |= {"grammar": "root ::= [a-z ]+", "ignore_eos": False}
            elif i == 11:
                fields["speculative"] = llamax.PromptLookup()
            handles.append(ctx.add_request([*body[:-1], body[-1] + i], SamplingParams(**fields)))

        def cancel() -> None:  # once the pressure has preempted (forced, not timed)
            while not ctx.stats().num_preemptions and not all(h.done() for h in handles):
                time.sleep(0.01)
            for handle in rng.sample(handles[:8], 3):
                time.sleep(rng.uniform(0.0, 0.5))
                handle.cancel()

        canceller = threading.Thread(target=cancel)
        canceller.start()
        reasons = [h.result(600).finish_reason for h in handles]
        canceller.join()
        assert set(reasons) <= {"length", "stop", "cancelled"}, reasons
        stats = ctx.stats()
        assert stats.num_preemptions > 0 and stats.kv_layout == "unified"
        chains = ctx._backend._graph  # type: ignore[attr-defined]
        assert chains.num_draws > 0 and chains.num_attaches > 8
        assert_idle(ctx)
        assert chains.num_attached == 0
        assert ctx.audit() == []


def test_a_chain_the_graph_runs_in_part_is_finished_on_the_host(model_path: Path) -> None:
    """A device may lack a sampler's ops: llama.cpp then runs the chain's longest prefix in
    the graph and leaves the rest. Forced here with typical-p (no backend part) after
    top-k: the attached chain's ``llama_sampler_sample`` finishes each row on the host from
    what the graph left (no token is drawn in the graph), step after step, and the chains
    detach and free cleanly."""
    backend = backend_for(model_path, True)
    params = SamplingParams(temperature=0.8, typical_p=0.9)
    drawn = [backend.new_sampler(params, 40 + i, [], graph=True) for i in range(3)]
    for sampler in drawn:
        assert not sampler.graph
        sampler.graph = True  # as if llamax offered it
    prompts = [backend.tokenize(PROMPTS[i], parse_special=False) for i in range(3)]
    parts = [(seq_id, tokens, 0) for seq_id, tokens in enumerate(prompts)]
    try:
        for _ in range(8):
            items = [
                BatchItem(i.seq_id, i.token_ids, i.start_pos, i.rows, sampler=drawn[i.seq_id])
                for i in batch(parts)
            ]
            assert backend.decode(items) == 0
            rows = [item.rows[0] for item in items]
            ctx = backend._context.ptr  # the graph drew no token: the host finishes each
            assert [backend._C.llama_get_sampled_token_ith(ctx, r) for r in rows] == [-1] * 3
            tokens = backend.sample_rows(drawn, rows)
            assert all(0 <= t < backend.facts.n_vocab for t in tokens)
            parts = [
                (item.seq_id, [token], item.start_pos + len(item.token_ids))
                for item, token in zip(items, tokens, strict=True)
            ]
        chains = backend._graph
        assert chains is not None and chains.num_draws == 24
    finally:
        for sampler in drawn:
            backend.free_sampler(sampler)
        assert backend.num_attached == 0
        backend.close()
