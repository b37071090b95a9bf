"""The reproducible mode on every kind of model we can write here (issue 60): other weight
types (Q8_0, F16, the K-quants Q4_K_M and Q6_K, written from SmolLM2 by llama.cpp's own
quantizer, ``scripts/requantize.py``) and other memories (hybrid LFM2, recurrent Mamba2,
sliding-window Gemma 3, random weights from ``scripts/make_memory_model.py``). The random
concurrent load of ``test_model_reproducible`` runs on each, and every reply must equal,
bit for bit, its solo run on an emptied context."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import memory_model_files
import pytest
from script_modules import load_script
from test_model_reproducible import OPTIONS, compare, run_load, solo_on

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
