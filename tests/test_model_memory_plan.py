"""The memory planner against what llama.cpp allocates (issue 61), on SmolLM2 and the
random hybrid, recurrent and sliding-window models of ``scripts/make_memory_model.py``:

- the KV cache a plan predicts is the KV buffer llama.cpp allocates for a context of the
  same options (its log's ``KV buffer size``), for ``n_ctx`` 2,048 / 8,192 / 32,768 times
  ``n_seq_max`` 1 / 4 / 16 (in ``kv_layout="auto"``'s streams, padding included) and for
  every KV type; its compute buffers are llama.cpp's too; and creating the context grows
  the process by the KV cache (llama.cpp zeroes it);
- SmolLM2's cell, read from the model's shape, is the one ``model_info`` measures (the
  growth of a sequence's saved state, less its 12-byte header);
- a recurrent or hybrid model's per-sequence state is counted, once per sequence;
- a context that cannot fit is refused before anything is allocated, with the numbers,
  unless ``$LLAMAX_MEMORY_CHECK=0``;
- ``llamax info --n-ctx ...`` prints the plan.
"""

from __future__ import annotations

import json
import re
import time
from contextlib import closing
from pathlib import Path

import memory_model_files
import pytest

import llamax
from llamax import cli
from llamax.backend.llama_cpp import LlamaCppBackend, kv_dims
from llamax.backend.memory_probe import (
    MEMORY_CHECK_ENV,
    SizeProbe,
    check_context_memory,
    plan_with_probe,
)
from llamax.backend.native import (
    NativeContext,
    NativeModel,
    bindings,
    captured_log,
    context_params,
)
from llamax.config import KV_TYPES, ContextConfig
from llamax.memory_plan import kv_bytes

pytestmark = pytest.mark.model

MIB = 1 << 20
SMOLLM2_CELL = 30 * 3 * 64 * 2 * 2  # 30 layers, 3 KV heads of 64, K and V, F16


def _logged_mib(lines: list[str], what: str) -> float:
    """The sum of llama.cpp's ``<what> buffer size = X MiB`` lines."""
    pattern = re.compile(rf"{what} buffer size =\s*([\d.]+) MiB")
    return sum(float(m.group(1)) for line in lines if (m := pattern.search(line)))


def _resident() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


@pytest.mark.parametrize("n_ctx", [2048, 8192, 32768])
@pytest.mark.parametrize("n_seq_max", [1, 4, 16])
def test_the_plan_is_what_llama_cpp_allocates(model_path: Path, n_ctx: int, n_seq_max: int) -> None:
    plan = llamax.plan_memory(model_path, n_ctx=n_ctx, n_seq_max=n_seq_max, search=False)
    config = ContextConfig(model_path=str(model_path), n_ctx=n_ctx, n_seq_max=n_seq_max)
    with captured_log() as lines:
        backend = LlamaCppBackend(config)
    with closing(backend):
        assert plan.kv_cells == backend.kv_cells
        assert plan.kv_layout == ("unified" if backend.is_unified else "streams")
        assert plan.n_ctx_stream == backend.n_ctx_stream
    kv, compute = _logged_mib(lines, "KV") * MIB, _logged_mib(lines, "compute") * MIB
    assert abs(plan.kv_bytes - kv) <= 0.05 * kv  # within 5% (measured: to the 0.01 MiB logged)
    assert abs(plan.kv_bytes - kv) <= 0.01 * MIB
    assert abs(plan.compute_bytes - compute) <= 0.01 * MIB
    assert abs(plan.output_bytes - _logged_mib(lines, "output") * MIB) <= 0.01 * MIB
    assert plan.kv_bytes_per_cell == SMOLLM2_CELL


def test_each_kv_type_costs_what_llama_cpp_allocates(model_path: Path) -> None:
    for kv_type in KV_TYPES:
        plan = llamax.plan_memory(
            model_path, n_ctx=4096, n_seq_max=1, kv_type=kv_type, search=False
        )
        config = ContextConfig(model_path=str(model_path), n_ctx=4096, n_seq_max=1, kv_type=kv_type)
        with captured_log() as lines:
            backend = LlamaCppBackend(config)
        with closing(backend):
            assert plan.kv_bytes_per_cell == backend.kv_bytes_per_cell, kv_type
        assert abs(plan.kv_bytes - _logged_mib(lines, "KV") * MIB) <= 0.01 * MIB, kv_type
        assert abs(plan.compute_bytes - _logged_mib(lines, "compute") * MIB) <= 0.01 * MIB


def test_smollm2_s_cell_from_its_shape_is_the_measured_one(model_path: Path) -> None:
    """``model_info`` measures a cell as the growth of a sequence's saved state, which
    adds the cell's position and sequence id (12 bytes) to its K and V."""
    plan = llamax.plan_memory(model_path, n_ctx=4096, search=False)
    assert (
        plan.kv_bytes_per_cell
        == SMOLLM2_CELL
        == llamax.model_info(model_path).kv_bytes_per_cell - 12
    )
    assert plan.weights_bytes == llamax.model_info(model_path).size_bytes


def test_creating_the_context_grows_the_process_by_the_kv_cache(model_path: Path) -> None:
    """llama.cpp zeroes the KV buffer as it allocates it, so all of it is resident at
    once; the compute buffers are allocated but untouched until a decode."""
    plan = llamax.plan_memory(model_path, n_ctx=32768, n_seq_max=1, search=False)
    C = bindings()
    with closing(NativeModel(C, model_path, n_gpu_layers=0)) as model:
        params = context_params(
            C, n_ctx=32768, n_batch=512, n_seq_max=1, n_threads=1, n_threads_batch=1,
            kv_unified=True,
        )  # fmt: skip
        before = _resident()
        with captured_log():
            context = NativeContext.create(model, params)
        assert context is not None
        with closing(context):
            grown = _resident() - before
    assert abs(grown - plan.kv_bytes) <= 0.05 * plan.kv_bytes, (grown, plan.kv_bytes)


def test_a_context_that_cannot_fit_is_refused_before_it_is_allocated(model_path: Path) -> None:
    n_ctx = 1 << 24  # 386 GB of KV cache at SmolLM2's 23,040 bytes a cell
    before, start = _resident(), time.monotonic()
    with pytest.raises(llamax.InsufficientMemoryError) as refused:
        llamax.Context(model_path, n_ctx=n_ctx, n_seq_max=4)
    assert time.monotonic() - start < 60
    assert _resident() - before < 1 << 30  # nothing near the cache was allocated
    plan, message = refused.value.plan, str(refused.value)
    assert plan.kv_bytes == n_ctx * SMOLLM2_CELL and plan.kv_cells == n_ctx
    assert plan.context_bytes > refused.value.available_bytes > 0
    for said in ("16,777,216", "23,040 bytes", "f16/f16", "MemAvailable", MEMORY_CHECK_ENV):
        assert said in message
    assert f"is {plan.max_n_ctx:,}" in message and 0 < plan.max_n_ctx < n_ctx
    assert isinstance(refused.value, llamax.ModelLoadError)  # what catching code expects


def test_the_check_is_skipped_when_turned_off_or_plainly_fitting(
    model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Called on its own here: with the check off, llama.cpp would try to allocate."""
    C = bindings()
    absurd = ContextConfig(model_path=str(model_path), n_ctx=1 << 24, n_seq_max=1)
    with closing(NativeModel(C, model_path, n_gpu_layers=0)) as model:
        dims = kv_dims(model)
        with pytest.raises(llamax.InsufficientMemoryError):
            check_context_memory(model, absurd, unified=True, dims=dims)
        monkeypatch.setenv(MEMORY_CHECK_ENV, "0")
        check_context_memory(model, absurd, unified=True, dims=dims)  # no error: off
        monkeypatch.delenv(MEMORY_CHECK_ENV)
        default = ContextConfig(model_path=str(model_path))
        check_context_memory(model, default, unified=True, dims=dims)


def test_the_largest_n_ctx_that_fits_fits_and_the_next_does_not(model_path: Path) -> None:
    plan = llamax.plan_memory(model_path, n_ctx=4096, n_seq_max=4, memory_bytes=2 << 30)
    assert plan.fits and plan.max_n_ctx >= 4096
    at_most = llamax.plan_memory(
        model_path, n_ctx=plan.max_n_ctx, n_seq_max=4, memory_bytes=2 << 30, search=False
    )
    beyond = llamax.plan_memory(
        model_path, n_ctx=plan.max_n_ctx + 256, n_seq_max=4, memory_bytes=2 << 30, search=False
    )
    assert at_most.fits and not beyond.fits
    assert at_most.total_bytes <= 2 << 30 < beyond.total_bytes


@pytest.fixture(scope="module")
def memory_models(tmp_path_factory: pytest.TempPathFactory, model_path: Path) -> dict[str, Path]:
    pytest.importorskip("gguf")
    kinds = ("hybrid", "recurrent", "sliding_window")
    return {kind: memory_model_files.shared(tmp_path_factory, kind, model_path) for kind in kinds}


def test_a_recurrent_or_hybrid_model_s_state_is_counted_per_sequence(
    memory_models: dict[str, Path],
) -> None:
    # LFM2: 2 short-convolution blocks of (3 - 1) x 64 floats; 2 attention blocks of
    # 2 KV heads of 32
    hybrid = llamax.plan_memory(memory_models["hybrid"], n_ctx=4096, n_seq_max=16)
    assert hybrid.state_bytes_per_seq == 2 * 2 * 64 * 4
    assert hybrid.state_bytes == 16 * hybrid.state_bytes_per_seq
    assert hybrid.kv_bytes_per_cell == 2 * 2 * 32 * 2 * 2 and hybrid.kv_bytes == 4096 * 512
    # one attention cache beside the recurrent state: auto starts in streams and moves
    assert hybrid.kv_layout == "streams" and hybrid.moves_layout
    # Mamba2: 2 blocks of a (4 - 1) x 160 convolution and a 16 x 128 state, F32; llama.cpp
    # logs them in MiB to two decimals, so the state is read to within a few bytes
    recurrent = llamax.plan_memory(memory_models["recurrent"], n_ctx=4096, n_seq_max=16)
    exact = 2 * (3 * 160 + 16 * 128) * 4
    assert abs(recurrent.state_bytes_per_seq - exact) <= 64
    assert recurrent.state_bytes == 16 * recurrent.state_bytes_per_seq
    assert (recurrent.kv_bytes, recurrent.kv_bytes_per_cell) == (0, 0)
    assert recurrent.max_n_ctx == llamax.info.MAX_PLANNED_CTX  # no cache grows with it
    assert recurrent.kv_layout == "unified" and not recurrent.moves_layout  # no cells to part
    measured = llamax.model_info(memory_models["recurrent"]).state_bytes_per_seq
    assert 0 <= measured - exact <= 256  # a saved state adds a header to the state


def test_the_recurrent_state_llama_cpp_allocates(memory_models: dict[str, Path]) -> None:
    C = bindings()
    path = memory_models["recurrent"]
    plan = llamax.plan_memory(path, n_ctx=4096, n_seq_max=64, search=False)
    with closing(NativeModel(C, path, n_gpu_layers=0)) as model:
        params = context_params(
            C, n_ctx=4096, n_batch=512, n_seq_max=64, n_threads=1, n_threads_batch=1,
            kv_unified=True,
        )  # fmt: skip
        with captured_log() as lines:
            context = NativeContext.create(model, params)
        assert context is not None
        context.close()
    assert abs(plan.state_bytes - _logged_mib(lines, "RS") * MIB) <= 0.01 * MIB


def test_a_window_cache_is_sized_as_llama_cpp_sizes_it(memory_models: dict[str, Path]) -> None:
    """Full size as llamax creates contexts (``swa_full``), and to the window without."""
    path = memory_models["sliding_window"]
    plan = llamax.plan_memory(path, n_ctx=4096, n_seq_max=4, search=False)
    assert plan.kv_layout == "unified" and not plan.moves_layout
    config = ContextConfig(model_path=str(path), n_ctx=4096, n_seq_max=4)
    with closing(SizeProbe(config)) as probe:
        shape = probe.shape()
        assert [cache.window for cache in shape.caches] == [0, 32]
        for swa_full in (True, False):
            run = probe.dry_run(
                n_ctx=4096, n_seq_max=4, unified=True, kv_types=("f16", "f16"), swa_full=swa_full
            )
            logged = sum(c.k_mib + c.v_mib for c in run.caches) * MIB
            planned = kv_bytes(
                shape, 4096, 4, unified=True, type_k="f16", type_v="f16", swa_full=swa_full
            )
            assert abs(planned - logged) <= 0.02 * MIB, swa_full
            if swa_full:
                assert planned == plan.kv_bytes


def test_llamax_info_prints_the_plan(model_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["info", str(model_path), "--n-ctx", "8192", "--n-seq-max", "4"]
    assert cli.main([*args, "--memory", "8G"]) == 0
    out = capsys.readouterr().out
    assert "KV cache:           180.0 MiB (23,040 bytes a cell at f16/f16)" in out
    assert "streams, 8,192 cells (4 x 2,048)" in out and "8.0 GiB (given): fits" in out
    assert "largest n_ctx:" in out and "largest n_seq_max:" in out
    assert cli.main([*args, "--kv-type", "q8_0", "--memory", "64M"]) == 0
    out = capsys.readouterr().out
    assert "12,240 bytes a cell at q8_0/q8_0" in out and "does NOT fit" in out
    assert cli.main([*args, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["kv_bytes"] == 8192 * SMOLLM2_CELL and plan["n_seq_max"] == 4
    expected = plan_with_probe(
        ContextConfig(model_path=str(model_path), n_ctx=8192, n_seq_max=4),
        plan["memory_bytes"],
        search=False,
    )
    assert plan["compute_bytes"] == expected.compute_bytes
    assert cli.main(["info", str(model_path.with_suffix(".missing")), "--n-ctx", "64"]) == 1


def test_context_plan_is_the_plan_of_the_context_the_same_options_create(
    model_path: Path,
) -> None:
    """``Context.plan`` takes the constructor's options: those that decide memory are
    planned, the others only checked; the reproducible mode's choices are its own."""
    options = {"n_ctx": 2048, "n_seq_max": 4, "kv_type": "q8_0", "n_threads": 2}
    plan = llamax.Context.plan(model_path, memory_bytes=8 << 30, search=False, **options)
    want = llamax.plan_memory(
        model_path, n_ctx=2048, n_seq_max=4, kv_type="q8_0", memory_bytes=8 << 30, search=False
    )
    assert plan == want and plan.fits
    assert (
        plan.kv_bytes_per_cell
        < llamax.Context.plan(
            model_path, memory_bytes=8 << 30, search=False, n_ctx=2048, n_seq_max=4
        ).kv_bytes_per_cell
    )  # q8_0 against the default f16
    streams = llamax.Context.plan(
        model_path, memory_bytes=8 << 30, search=False, reproducible=True, n_ctx=2048
    )
    assert streams == llamax.plan_memory(
        model_path, n_ctx=2048, kv_layout="streams", flash_attn=False, memory_bytes=8 << 30,
        search=False,
    )  # fmt: skip
    with pytest.raises(llamax.InvalidParameterError) as caught:
        llamax.Context.plan(model_path, n_threads=0)
    assert caught.value.param == "n_threads"
    with pytest.raises(TypeError, match="n_ctxx"):
        llamax.Context.plan(model_path, n_ctxx=4096)  # type: ignore[call-arg]
