"""The reproducible mode on every kind of model we can write here (issue 60): other weight
types (Q8_0, F16, the K-quants Q4_K_M and Q6_K, written from SmolLM2 by llama.cpp's own
quantizer, ``scripts/requantize.py``) and other memories (hybrid LFM2, recurrent Mamba2,
sliding-window Gemma 3, random weights from ``scripts/make_memory_model.py``). The random
concurrent load of ``test_model_reproducible`` runs on each, and every reply must equal,
bit for bit, its solo run on an emptied context."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import memory_model_files
import pytest
from script_modules import load_script
from test_model_reproducible import (
    HEAD,
    OPTIONS,
    QUESTIONS,
    TIMEOUT,
    compare,
    manual_pair,
    replies,
    run_load,
    solo_on,
    user,
)

import llamax

pytestmark = pytest.mark.model

WEIGHTS = ("q8_0", "f16", "q4_k_m", "q6_k")
MEMORIES = ("hybrid", "recurrent", "sliding_window")

_WRITTEN: dict[str, Path] = {}


def _model(kind: str, model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    if kind in MEMORIES:
        return memory_model_files.shared(tmp_path_factory, kind, model_path)
    if kind not in _WRITTEN:
        out = tmp_path_factory.mktemp(f"weights_{kind}") / f"smollm2-{kind}.gguf"
        _WRITTEN[kind] = load_script("requantize").requantize(model_path, out, kind)
    return _WRITTEN[kind]


@pytest.fixture
def on_kind(
    request: pytest.FixtureRequest, model_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[..., llamax.Context]]:
    path = _model(request.param, model_path, tmp_path_factory)
    made: list[llamax.Context] = []

    def make(**options: Any) -> llamax.Context:
        ctx = llamax.Context(path, **{**OPTIONS, "reproducible": True, **options})
        made.append(ctx)
        return ctx

    yield make
    for ctx in made:
        ctx.close()


@pytest.mark.parametrize("on_kind", [*WEIGHTS, *MEMORIES], indirect=True)
def test_every_reply_equals_its_solo_run_on_each_kind_of_model(
    on_kind: Callable[..., llamax.Context],
) -> None:
    ctx = on_kind()
    assert ctx.config.is_reproducible
    load = run_load(ctx, seed=62, num_bursts=2)
    assert ctx.audit() == []
    assert {"greedy", "session", "continuation"} <= {job.kind for job in load.compared}
    compare(load, solo_on(on_kind()))
    assert load.differences == [], load.differences


@pytest.mark.parametrize("on_kind", ["f16", "q4_k_m"], indirect=True)
def test_broken_rows_together_differ_where_the_probe_says_apart(
    on_kind: Callable[..., llamax.Context], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four prompts submitted at once to a manual context, so their decode rows meet: with
    the probe's verdict they equal their solo runs. Where the probe says the rows go apart
    (F16 and Q4_K on the AVX-512 EPYC this was written on; another CPU's kernels may not
    differ, and then its rows go together), forcing them together (the mode before the
    probe) makes them differ."""
    prompts = [[1 + (17 * s + 5 * i) % 9000 for i in range(40 + 7 * s)] for s in range(4)]
    apart = not on_kind(autostart=False)._engine.scheduler.planner.rows_together
    together, solo = manual_pair(on_kind, prompts)
    assert together == solo
    if apart:
        monkeypatch.setattr("llamax.engine.sched.scheduler.rows_batch_invariant", lambda _: True)
        together, solo = manual_pair(on_kind, prompts)
        assert together != solo


def test_every_reply_under_its_own_adapters_equals_its_solo_run(
    model_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """LoRA adapters per request in the reproducible mode: bursts from threads of requests
    under two adapters, one at two scales, and none, sharing a system prompt or not; every
    reply bit for bit as it comes alone on an emptied context."""
    folder = tmp_path_factory.mktemp("lora")
    write = load_script("make_lora_adapter").write_lora_adapter
    lora = {"warm": str(write(folder / "warm.gguf", seed=1)),
            "cold": str(write(folder / "cold.gguf", seed=2))}  # fmt: skip
    sets: list[dict[str, float] | None] = [None, {"warm": 1.0}, {"warm": 0.5}, {"cold": 1.0}]
    options = {**OPTIONS, "reproducible": True, "lora": lora}
    rng = random.Random(64)
    results: list[tuple[list[int], llamax.SamplingParams, Any]] = []
    with llamax.Context(model_path, **options) as ctx:
        head = ctx.tokenize(HEAD)
        for burst in range(3):
            batch = []
            for i in range(rng.randint(3, 5)):
                question = user(rng.choice(QUESTIONS))
                shared = rng.random() < 0.7
                tokens = ([*head, *ctx.tokenize(question, add_special=False)] if shared
                          else ctx.tokenize(f"Note {burst}.{i}: " + question))  # fmt: skip
                p = llamax.SamplingParams(max_tokens=rng.randint(6, 12), temperature=0.0,
                                          logprobs=2, lora=rng.choice(sets))  # fmt: skip
                batch.append((tokens, p))
            handles: dict[int, llamax.RequestHandle] = {}
            threads = [
                threading.Thread(target=_submit, args=(ctx, handles, i, *job))
                for i, job in enumerate(batch)
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(TIMEOUT)
            for i, (tokens, p) in enumerate(batch):
                results.append((tokens, p, replies(handles[i].result(TIMEOUT))))
        assert ctx.audit() == []
    differences = []
    with llamax.Context(model_path, **options) as alone:
        for tokens, p, got in results:
            alone.clear_cache()
            if replies(alone.add_request(tokens, p).result(TIMEOUT)) != got:
                differences.append(f"{len(tokens)} tokens under {p.lora}")
    assert {str(p.lora) for _, p, _ in results} >= {"None", "{'warm': 1.0}"}
    assert differences == [], differences


def _submit(
    ctx: llamax.Context,
    handles: dict[int, llamax.RequestHandle],
    index: int,
    tokens: Any,
    params: llamax.SamplingParams,
) -> None:
    handles[index] = ctx.add_request(tokens, params)


@pytest.mark.parametrize("kv", [{}, {"kv_type_v": "q8_0"}], ids=["grid", "batch-invariant"])
def test_every_reply_with_images_equals_its_solo_run(model_path: Path, kv: dict[str, Any]) -> None:
    """Images in the reproducible mode (a random gemma3-style projector): requests with an
    image (two of them the same image), others with text only, sent together from
    threads; every reply bit for bit as it comes alone on an emptied context. With a
    ``q8_0`` V the model is batch-invariant and the grid is off."""
    import vision_files
    from vision_files import pixels, png

    projector = vision_files.script().cached_vision_model(projector="gemma3")
    options = {**OPTIONS, "n_batch": 256, "reproducible": True, "mmproj": str(projector), **kv}
    p = llamax.SamplingParams(max_tokens=8, temperature=0.0, logprobs=2, ignore_eos=True)
    prompts: list[Any] = [
        ["<|im_start|>user\n", llamax.Image(png(pixels(seed, 48, 64))),
         f" What is in picture {i}?<|im_end|>\n<|im_start|>assistant\n"]
        for i, seed in enumerate((1, 2, 1))
    ]  # fmt: skip
    prompts += [HEAD + user(q) for q in QUESTIONS[:3]]
    results = []
    with llamax.Context(model_path, **options) as ctx:
        assert ctx._engine.scheduler.kv.invariant is bool(kv)
        for _ in range(2):  # the second round finds the images' prefixes cached
            handles: dict[int, llamax.RequestHandle] = {}
            threads = [
                threading.Thread(target=_submit, args=(ctx, handles, i, prompt, p))
                for i, prompt in enumerate(prompts)
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(TIMEOUT)
            results += [(prompt, replies(handles[i].result(TIMEOUT))) for i, prompt in
                        enumerate(prompts)]  # fmt: skip
        assert ctx.audit() == []
    differences = []
    with llamax.Context(model_path, **options) as alone:
        for prompt, got in results:
            alone.clear_cache()
            if replies(alone.add_request(prompt, p).result(TIMEOUT)) != got:
                differences.append(str(prompt)[:60])
    assert differences == [], differences
