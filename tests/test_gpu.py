"""The GPU tier: llamax on a CUDA (or Metal) build of llama.cpp, every layer offloaded.

Run with ``pytest -m gpu tests/test_gpu.py`` (the default run deselects the marker). The
model is ``$LLAMAX_GPU_MODEL`` (``scripts/gpu_check.sh`` sets the random 1B of
``scripts/make_random_model.py``), else the default model. Without a GPU build the module
skips, saying so; ``LLAMAX_GPU_TIER_ON_CPU=1`` runs the same tests with ``n_gpu_layers=0``
on the CPU, to check the tests themselves where no GPU is lent (docs/gpu.md).

Greedy outputs of two batch compositions are compared up to llama.cpp's near ties
(``near_tie.py``): random weights make near ties common, and GPU kernels, like CPU ones,
sum in an order that depends on the batch. The raw loop at the *same* composition is
expected to agree token for token; the test says how many did.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from near_tie import assert_greedy_agrees

import llamax
from llamax.testing import assert_idle

ON_CPU = os.environ.get("LLAMAX_GPU_TIER_ON_CPU") == "1"


def _gpu_offload() -> bool:
    import llama_cpp

    return bool(llama_cpp.llama_supports_gpu_offload())


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not ON_CPU and not _gpu_offload(),
        reason="no CUDA device / llama.cpp not built with CUDA (llama_supports_gpu_offload() "
        "is false); LLAMAX_GPU_TIER_ON_CPU=1 runs the tier on the CPU",
    ),
]

N_GPU_LAYERS = 0 if ON_CPU else -1
N_STREAMS = 16
N_STORM = 64
TIMEOUT = 300.0
MAX_TOKENS = 32
FORCED = 3  # tokens of the model's earlier reply forced in the speculative test
GREEDY = llamax.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
SYS = (
    "You are the support assistant of a small outdoor shop. The store opens at nine and "
    "closes at six from Monday to Saturday; on Sunday it opens at ten. Orders above fifty "
    "dollars ship for free and arrive within five business days. Unused items may be "
    "returned within thirty days for a full refund. Kayak rentals cost forty dollars a day. "
)


@pytest.fixture(scope="module")
def gpu_model() -> Path:
    """``$LLAMAX_GPU_MODEL``, else the default model."""
    return Path(os.environ.get("LLAMAX_GPU_MODEL") or llamax.default_model_path())


@pytest.fixture(scope="module")
def gpu_ctx(gpu_model: Path) -> Iterator[llamax.Context]:
    """One context on the GPU for the module (streams layout, room for the storm)."""
    ctx = llamax.Context(
        gpu_model,
        n_ctx=N_STORM * 256,
        n_seq_max=N_STORM,
        n_batch=1024,
        n_gpu_layers=N_GPU_LAYERS,
        speculative=llamax.PromptLookup(),
    )
    yield ctx
    ctx.close()


@pytest.fixture
def ctx(gpu_ctx: llamax.Context) -> Iterator[llamax.Context]:
    """The module's context, asserted idle (``audit()`` clean, nothing leaked) after each test."""
    assert_idle(gpu_ctx)
    yield gpu_ctx
    assert_idle(gpu_ctx, timeout=60)


@pytest.fixture(scope="module")
def probe(gpu_model: Path) -> Iterator[llamax.Context]:
    """A one-sequence context that measures near ties (nothing cached between probes)."""
    ctx = llamax.Context(gpu_model, n_ctx=1024, n_seq_max=1, n_gpu_layers=N_GPU_LAYERS)
    yield ctx
    ctx.close()


def short_prompts(n: int) -> list[str]:
    """The benchmarks' W1 prompts (benchmarks/_common.py)."""
    return [f"Write a short story about topic number {i}:" for i in range(n)]


def _gpu_memory_used_mib() -> int | None:
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=False,
    )
    return int(out.stdout.split()[0]) if out.returncode == 0 and out.stdout.strip() else None


def test_every_layer_is_offloaded(gpu_model: Path, caplog: pytest.LogCaptureFixture) -> None:
    before = _gpu_memory_used_mib()
    with caplog.at_level(logging.INFO, logger="llamax.llama_cpp"):
        ctx = llamax.Context(gpu_model, n_ctx=512, n_seq_max=1, n_gpu_layers=N_GPU_LAYERS)
    try:
        loaded = _gpu_memory_used_mib()
        done = ctx.add_request("Hello", GREEDY).result(TIMEOUT)
        assert len(done.token_ids) == MAX_TOKENS
    finally:
        ctx.close()
    found = re.search(r"offloaded (\d+)/(\d+) layers to GPU", caplog.text)
    if ON_CPU:
        assert found is None or found.group(1) == "0", found
        return
    assert found, "llama.cpp did not log how many layers it offloaded"
    offloaded, total = int(found.group(1)), int(found.group(2))
    assert offloaded == total, f"only {offloaded}/{total} layers on the GPU"
    if before is not None and loaded is not None:
        size_mib = gpu_model.stat().st_size / 2**20
        # the output matrix is on the GPU, the input embedding stays in host memory
        assert loaded - before > 0.5 * size_mib, (before, loaded, size_mib)


def test_batched_greedy_equals_the_raw_loop_at_the_same_composition(
    gpu_model: Path, probe: llamax.Context
) -> None:
    """Every prompt prefilled in one batch, then one token per stream per step, in both."""
    sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
    from _loops import RawLoop  # benchmarks/_loops.py: one KV stream per sequence

    prompts = short_prompts(N_STREAMS)
    options = dict(n_ctx=N_STREAMS * 256, n_seq_max=N_STREAMS, n_batch=1024)
    ctx = llamax.Context(
        gpu_model, kv_layout="streams", max_step_ms=None, autostart=False,
        n_gpu_layers=N_GPU_LAYERS, **options,
    )  # fmt: skip
    try:
        handles = [ctx.add_request(p, GREEDY) for p in prompts]
        steps = 0
        while ctx.has_work():
            ctx.process()
            steps += 1
        ours = [h.result(TIMEOUT).token_ids for h in handles]
        tokens = [ctx.tokenize(p) for p in prompts]
    finally:
        ctx.close()
    assert steps <= MAX_TOKENS + 1, f"{steps} steps: the prompts did not prefill in one batch"
    loop = RawLoop(gpu_model, kv_unified=False, **options)
    try:
        raw = loop.generate(prompts, MAX_TOKENS).token_ids
    finally:
        loop.close()
    equal = sum(tuple(a) == tuple(b) for a, b in zip(raw, ours, strict=True))
    print(f"llamax equals the raw loop on {equal}/{N_STREAMS} streams")
    for prompt, expected, got in zip(tokens, raw, ours, strict=True):
        assert_greedy_agrees(probe, prompt, expected, got)


def test_cache_hit_equals_cold(ctx: llamax.Context, probe: llamax.Context) -> None:
    prompt = ctx.tokenize(SYS + "When do you open on Sunday?")
    cold = ctx.add_request(prompt, GREEDY).result(TIMEOUT)
    assert cold.usage.cached_tokens == 0
    hit = ctx.add_request(prompt, GREEDY).result(TIMEOUT)
    assert hit.usage.cached_tokens == len(prompt) - 1
    assert_greedy_agrees(probe, prompt, cold.token_ids, hit.token_ids)
    other = ctx.tokenize(SYS + "How much is a kayak?")
    shared = ctx.add_request(other, GREEDY).result(TIMEOUT)
    assert shared.usage.cached_tokens > len(prompt) // 2
    # cold, split where the hit split it: a one-chunk prefill may part from a chunked one
    # by more than a near tie (on SmolLM2 on this AVX2 CPU, 0.31 nats), in llama.cpp alone
    cut = shared.usage.cached_tokens
    probe.add_request(other[:cut], llamax.SamplingParams(max_tokens=1)).result(TIMEOUT)
    reference = probe.add_request(other, GREEDY).result(TIMEOUT)
    probe.clear_cache()
    assert reference.usage.cached_tokens == cut
    assert_greedy_agrees(probe, other, reference.token_ids, shared.token_ids)


def test_session_save_load_round_trip(ctx: llamax.Context, gpu_model: Path, tmp_path: Path) -> None:
    path = tmp_path / "gpu.llamax"
    prompt = ctx.tokenize(SYS + "Can I return a tent?")
    with ctx.session() as session:
        reply = session.add_request(prompt, GREEDY).result(TIMEOUT)
        held = session.token_ids
        session.save(path)
        follow_up = [*prompt, *reply.token_ids, *ctx.tokenize(" And boots?", add_special=False)]
        expected = session.add_request(follow_up, GREEDY).result(TIMEOUT)
    other = llamax.Context(gpu_model, n_ctx=2048, n_seq_max=2, n_gpu_layers=N_GPU_LAYERS)
    try:
        with llamax.Session.load(other, path) as loaded:
            assert loaded.token_ids == held
            again = loaded.add_request(follow_up, GREEDY).result(TIMEOUT)
            assert again.usage.cached_tokens == len(held)
            assert again.token_ids == expected.token_ids
        assert_idle(other)
    finally:
        other.close()


def test_grammar_output_is_unchanged(ctx: llamax.Context) -> None:
    """A grammar that allows every text leaves greedy output as it was; a narrow one holds."""
    prompt = SYS + "Answer yes or no:"
    plain = ctx.add_request(prompt, GREEDY).result(TIMEOUT)
    ctx.clear_cache()
    anything = llamax.SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, grammar=r"root ::= [^\x00]*"
    )
    free = ctx.add_request(prompt, anything).result(TIMEOUT)
    ctx.clear_cache()
    assert free.token_ids == plain.token_ids
    narrow = llamax.SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, grammar='root ::= ("yes" | "no") ("." | "!")'
    )
    runs = [ctx.add_request(prompt, narrow) for _ in range(4)]
    texts = {h.result(TIMEOUT).text for h in runs}
    assert len(texts) == 1 and re.fullmatch(r"(yes|no)[.!]", texts.pop())


def test_speculative_output_is_unchanged(ctx: llamax.Context, probe: llamax.Context) -> None:
    """Prompt lookup drafts the model's own earlier reply; greedy output stays the plain one.

    The prompt is a question, the model's reply to it and the question again, and the first
    ``FORCED`` tokens of the reply are forced (a logits processor, in both runs): then the
    last two tokens have occurred before and a draft follows, whatever the model picks
    after that, so the verification runs even on a random model that copies nothing.
    Drafts are not priced here (``scheduler.drafts.priced``): the pricing would rightly
    draft little for a model that rarely copies, and the test is about verification.
    """
    base = SYS + "Tell me about the kayak rentals."
    first = ctx.add_request(base, GREEDY).result(TIMEOUT).token_ids
    prompt = [*ctx.tokenize(base), *first, *ctx.tokenize(base, add_special=False)]
    ctx.clear_cache()

    def lead(token_ids: np.ndarray, logits: np.ndarray) -> np.ndarray | None:
        j = len(token_ids) - len(prompt)
        if j >= FORCED:
            return None
        row = np.full_like(logits, -np.inf)
        row[first[j]] = 0.0
        return row

    params = llamax.SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logits_processors=[lead]
    )
    plain = ctx.add_request(prompt, params).result(TIMEOUT)
    ctx.clear_cache()
    scheduler = ctx._engine.scheduler
    scheduler.drafts.priced = False
    try:
        spec = ctx.add_request(prompt, dataclasses.replace(params, speculative=True))
        done = spec.result(TIMEOUT)
    finally:
        scheduler.drafts.priced = True
    ctx.clear_cache()
    print(f"drafted {done.usage.drafted_tokens}, accepted {done.usage.accepted_tokens}")
    assert done.usage.drafted_tokens > 0
    assert done.token_ids[:FORCED] == first[:FORCED]
    forced = [*prompt, *first[:FORCED]]
    assert_greedy_agrees(probe, forced, plain.token_ids[FORCED:], done.token_ids[FORCED:])


def test_cancel_storm_leaves_audit_clean(ctx: llamax.Context) -> None:
    """64 streams, cancelled from 8 threads at staggered points while they decode."""
    params = llamax.SamplingParams(temperature=0.8, max_tokens=128, ignore_eos=True, seed=1)
    handles = [ctx.add_request(p, params) for p in short_prompts(N_STORM)]
    for handle in handles[:8]:  # some are mid-stream when cancelled
        next(iter(handle))

    def cancel(part: list[llamax.RequestHandle], delay: float) -> None:
        for handle in part:
            time.sleep(delay)
            handle.cancel()

    threads = [threading.Thread(target=cancel, args=(handles[i::8], 0.001 * i)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    reasons = {h.result(TIMEOUT).finish_reason for h in handles}
    assert reasons <= {llamax.FinishReason.CANCELLED, llamax.FinishReason.LENGTH}
    assert llamax.FinishReason.CANCELLED in reasons
    assert_idle(ctx, timeout=60)
    assert ctx.audit() == []


def test_backend_sampling_on_the_device(gpu_model: Path) -> None:
    """``backend_sampling``: 16 greedy streams draw in the decode what the host draws from
    the same logits (one composition, so the same floats); 16 sampled streams beside
    requests that need the host (logprobs, ``n`` = 2) all end, their chains drawn in the
    graph and detached after (docs/logits.md#backend-sampling)."""
    replies = []
    sampled = llamax.SamplingParams(
        temperature=0.8, top_p=0.95, min_p=0.05, max_tokens=MAX_TOKENS, ignore_eos=True, seed=3
    )
    for on in (False, True):
        with llamax.Context(
            gpu_model, n_ctx=N_STREAMS * 256, n_seq_max=N_STREAMS, n_batch=1024,
            n_gpu_layers=N_GPU_LAYERS, kv_layout="streams", backend_sampling=on,
        ) as bs_ctx:  # fmt: skip
            greedy = [bs_ctx.add_request(p, GREEDY) for p in short_prompts(N_STREAMS)]
            replies.append([h.result(TIMEOUT).token_ids for h in greedy])
            if not on:
                continue
            host = [
                bs_ctx.add_request("Tell me a joke.", dataclasses.replace(sampled, logprobs=2)),
                bs_ctx.add_request("Tell me a joke.", dataclasses.replace(sampled, n=2)),
            ]
            drawn = [bs_ctx.add_request(p, sampled) for p in short_prompts(N_STREAMS - 4)]
            for handle in [*host, *drawn]:
                for choice in handle.result(TIMEOUT).choices:
                    assert len(choice.token_ids) == MAX_TOKENS
            chains = bs_ctx._backend._graph  # type: ignore[attr-defined]
            assert chains.num_draws >= N_STREAMS * (MAX_TOKENS - 1)
            assert_idle(bs_ctx, timeout=60)
            assert chains.num_attached == 0
    assert replies[0] == replies[1]
