"""The memory planner's arithmetic without a model (issue 61): the cells a layout holds, a
KV cache's bytes at each type, a plan's sums and its searches against brute force, the log
lines a dry run is read from, and the refusal's error and switch.
tests/test_model_memory_plan.py checks the same numbers against what llama.cpp allocates."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

import llamax
from llamax.backend.memory_probe import (
    MEMORY_CHECK_ENV,
    memory_check_enabled,
    parse_dry_run,
)
from llamax.config import KV_TYPES, ContextConfig
from llamax.memory_plan import (
    KVShape,
    ModelShape,
    assemble_plan,
    available_memory,
    kv_bytes,
    layout_cells,
)

SMOLLM2 = KVShape(num_layers=30, k_values=30 * 192, v_values=30 * 192)
"""SmolLM2-135M: 30 layers of 3 KV heads of 64 values."""


def _shape(*caches: KVShape, state: int = 0, n_swa: int = 0) -> ModelShape:
    return ModelShape(
        path=Path("model.gguf"),
        description="test",
        weights_bytes=100 << 20,
        n_vocab=49152,
        n_ctx_train=8192,
        caches=caches or (SMOLLM2,),
        state_bytes_per_seq=state,
        is_recurrent=not caches and bool(state),
        n_swa=n_swa,
    )


def test_layouts_hold_the_cells_llama_cpp_pads_them_to() -> None:
    assert layout_cells(4096, 4, unified=True) == (4096, 1)
    assert layout_cells(100, 1, unified=True) == (256, 1)  # at least 256
    assert layout_cells(8192, 4, unified=False) == (2048, 4)
    assert layout_cells(2048, 16, unified=False) == (256, 16)  # 4,096 cells for 2,048 asked
    assert layout_cells(2048, 6, unified=False) == (512, 6)  # llama.cpp's "rounding down to 3072"
    assert layout_cells(8192, 64, unified=False) == (256, 64)  # docs/kv-cache.md: 16,384


def test_a_cell_costs_each_type_s_blocks() -> None:
    """ggml's type traits: f16 2 bytes a value, q8_0 34 bytes a block of 32, q4_0 18 ..."""
    per_cell = {t: _shape().cell_bytes(t, t) for t in KV_TYPES}
    assert per_cell == {
        "f32": 46080, "f16": 23040, "bf16": 23040, "q8_0": 12240, "q5_1": 8640,
        "q5_0": 7920, "q4_1": 7200, "iq4_nl": 6480, "q4_0": 6480,
    }  # fmt: skip
    assert _shape().cell_bytes("q8_0", "f16") == 6120 + 11520  # K and V apart
    kv = kv_bytes(_shape(), 8192, 4, unified=False, type_k="f16", type_v="f16")
    assert kv == 8192 * 23040
    kv = kv_bytes(_shape(), 2048, 16, unified=False, type_k="q4_0", type_v="q4_0")
    assert kv == 4096 * 6480  # the streams' padding counts


def test_a_window_cache_holds_its_window_only_when_not_full_size() -> None:
    """llamax keeps llama.cpp's full-size window cache (every cell, cut anywhere); without
    it llama.cpp sizes it to the window (times the sequences when unified) plus a
    micro-batch, padded to 256 (``llama_kv_cache_iswa``)."""
    full, window = KVShape(1, 64, 64), KVShape(5, 320, 320, window=32)
    shape = _shape(full, window, n_swa=32)
    assert not shape.plain_kv

    def sized(n_ctx: int, *, swa_full: bool) -> int:
        return kv_bytes(
            shape, n_ctx, 4, unified=True, type_k="f16", type_v="f16", swa_full=swa_full
        )

    assert sized(4096, swa_full=True) == 4096 * (256 + 1280)
    assert sized(4096, swa_full=False) == 4096 * 256 + 768 * 1280  # 32 * 4 + 512 -> 768
    assert sized(512, swa_full=False) == 512 * 256 + 512 * 1280  # at most the full cache's


class FakeSizer:
    """A :class:`~llamax.memory_plan.Sizer` with made-up compute buffers that grow with
    the cells, as llama.cpp's do without flash attention; it counts its calls."""

    def __init__(self, *, plain: bool, per_cell: int = 20, base: int = 100 << 20) -> None:
        self.plain, self.per_cell, self.base = plain, per_cell, base
        self.calls = 0

    def layout(self, n_ctx: int, n_seq_max: int) -> tuple[bool, bool]:
        moves = self.plain and n_seq_max > 1
        return not moves, moves

    def compute_bytes(self, n_ctx: int, n_seq_max: int, unified: bool) -> int:
        self.calls += 1
        per_stream, _ = layout_cells(n_ctx, n_seq_max, unified)
        return self.base + self.per_cell * per_stream


def _config(**options: object) -> ContextConfig:
    return ContextConfig(model_path="model.gguf", **options)  # type: ignore[arg-type]


def test_a_plan_adds_its_parts_and_finds_the_largest_sizes_that_fit() -> None:
    shape, sizer = _shape(), FakeSizer(plain=True)
    config = _config(n_ctx=8192, n_seq_max=4, prefix_ram_bytes=1 << 30)
    plan = assemble_plan(shape, sizer, config, 4 << 30)
    assert (plan.kv_layout, plan.moves_layout, plan.kv_cells, plan.n_ctx_stream) == (
        "streams", True, 8192, 2048,
    )  # fmt: skip
    assert plan.kv_bytes == 8192 * 23040 and plan.kv_bytes_per_cell == 23040
    assert plan.compute_bytes == (100 << 20) + 20 * 2048
    assert plan.output_bytes == 4 * 49152 * 4
    assert plan.context_bytes == plan.kv_bytes + plan.compute_bytes + plan.output_bytes
    # a move to unified: its 8,192 cells, compute buffers and outputs beside the streams'
    assert plan.relayout_bytes == 8192 * 23040 + (100 << 20) + 20 * 8192 + plan.output_bytes
    assert plan.prefix_ram_bytes == 1 << 30
    assert plan.total_bytes == (100 << 20) + plan.context_bytes + plan.relayout_bytes + (1 << 30)
    assert plan.fits and plan.memory_bytes == 4 << 30

    def fits(n_ctx: int, n_seq_max: int) -> bool:
        other = assemble_plan(
            shape, sizer, _config(n_ctx=n_ctx, n_seq_max=n_seq_max, n_batch=512,
                                  prefix_ram_bytes=1 << 30), 4 << 30, search=False,
        )  # fmt: skip
        return other.fits

    best = max(k * 256 for k in range(1, 600) if fits(k * 256, 4))
    assert plan.max_n_ctx == best and not fits(best + 256, 4)
    assert plan.max_n_seq_max == max(s for s in range(1, 257) if fits(8192, s))
    sizer.calls = 0
    assemble_plan(shape, sizer, config, 4 << 30)
    assert sizer.calls < 60  # bisection within the span compute buffers leave open


def test_nothing_fits_when_the_weights_do_not() -> None:
    plan = assemble_plan(_shape(), FakeSizer(plain=True), _config(n_ctx=4096), 50 << 20)
    assert not plan.fits and (plan.max_n_ctx, plan.max_n_seq_max) == (0, 0)


def test_a_recurrent_state_is_counted_per_sequence_and_the_context_does_not_bound_it() -> None:
    shape = ModelShape(
        path=Path("m.gguf"), description="mamba", weights_bytes=1 << 20, n_vocab=1000,
        n_ctx_train=4096, caches=(), state_bytes_per_seq=20224, is_recurrent=True,
    )  # fmt: skip
    plan = assemble_plan(shape, FakeSizer(plain=False, per_cell=0), _config(n_seq_max=16), 1 << 30)
    assert (plan.state_bytes_per_seq, plan.state_bytes, plan.kv_bytes) == (20224, 16 * 20224, 0)
    assert plan.kv_layout == "unified" and not plan.moves_layout
    assert plan.max_n_ctx == llamax.info.MAX_PLANNED_CTX  # no KV: any length
    assert plan.max_n_seq_max == 256


def test_the_ram_tier_s_default_is_a_quarter_of_the_memory_at_most_8_gib() -> None:
    sizer = FakeSizer(plain=True)
    plan = assemble_plan(_shape(), sizer, _config(), 16 << 30, search=False)
    assert plan.prefix_ram_bytes == 4 << 30
    plan = assemble_plan(_shape(), sizer, _config(), 64 << 30, search=False)
    assert plan.prefix_ram_bytes == 8 << 30
    plan = assemble_plan(_shape(), sizer, _config(prefix_ram_share=0.5), 16 << 30, search=False)
    assert plan.prefix_ram_bytes == 2 << 30
    plan = assemble_plan(_shape(), sizer, _config(prefix_cache=False), 16 << 30, search=False)
    assert plan.prefix_ram_bytes == 0


# what this llama.cpp logs while it sizes a context (a dry run, SmolLM2 and the random
# sliding-window and hybrid models of scripts/make_memory_model.py)
LINES = [
    "llama_context:        CPU  output buffer size =     0.75 MiB\n",
    "llama_kv_cache_iswa: creating non-SWA KV cache, size = 1024 cells\n",
    "llama_kv_cache:        CPU KV buffer size =     0.00 MiB\n",
    "llama_kv_cache: size =    1.00 MiB (  1024 cells,   1 layers,  4/4 seqs), "
    "K (f16):    0.50 MiB, V (f16):    0.50 MiB\n",
    "llama_kv_cache_iswa: creating     SWA KV cache, size = 1024 cells\n",
    "llama_kv_cache: size =    5.00 MiB (  1024 cells,   5 layers,  4/4 seqs), "
    "K (f16):    2.50 MiB, V (q8_0):    2.50 MiB\n",
    "llama_memory_recurrent:        CPU RS buffer size =     0.25 MiB\n",
    "llama_memory_recurrent: size =    0.25 MiB (   256 cells,   4 layers, 256 seqs  0 rs_seq), "
    "R (f32):    0.25 MiB, S (f32):    0.00 MiB, P (f32):    0.00 MiB\n",
    "sched_reserve:        CPU compute buffer size =    96.63 MiB\n",
]


def test_a_dry_run_is_read_from_llama_cpp_s_log_lines() -> None:
    caches, state_cells, state_mib, compute = parse_dry_run(LINES)
    assert [(c.cells, c.layers, c.n_stream, c.k_mib, c.v_mib, c.windowed) for c in caches] == [
        (1024, 1, 4, 0.5, 0.5, False),
        (1024, 5, 4, 2.5, 2.5, True),
    ]
    assert (state_cells, state_mib) == (256, 0.25)
    assert compute == round(96.63 * 2**20)
    assert parse_dry_run([]) == ((), 0, 0.0, 0)


def test_available_memory_reads_meminfo(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 100 kB\nMemAvailable:   2048 kB\nSwapFree:  1024 kB\n")
    assert available_memory(str(meminfo)) == 2048 * 1024
    assert available_memory(str(meminfo), swap=True) == 3072 * 1024
    assert available_memory(str(tmp_path / "missing")) >= 0  # the free pages, or 0


def test_the_check_s_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(MEMORY_CHECK_ENV, raising=False)
    assert memory_check_enabled()
    for off in ("0", "false", "No", "off"):
        monkeypatch.setenv(MEMORY_CHECK_ENV, off)
        assert not memory_check_enabled()
    monkeypatch.setenv(MEMORY_CHECK_ENV, "maybe")
    with pytest.raises(llamax.InvalidParameterError, match="LLAMAX_MEMORY_CHECK"):
        memory_check_enabled()


def test_the_refusal_is_a_model_load_error_that_pickles_with_its_plan() -> None:
    plan = assemble_plan(_shape(), FakeSizer(plain=True), _config(), 1 << 30, search=False)
    error = llamax.InsufficientMemoryError("too big", plan=plan, available_bytes=1 << 30)
    assert isinstance(error, llamax.ModelLoadError)
    again = pickle.loads(pickle.dumps(error))
    assert (str(again), again.plan, again.available_bytes) == ("too big", plan, 1 << 30)


@pytest.mark.parametrize(
    ("options", "param"),
    [
        ({"kv_type": "q3_k"}, "kv_type"),
        ({"kv_type_v": "q8_0", "flash_attn": False}, "kv_type_v"),
        ({"n_ctx": 8}, "n_ctx"),
        ({"memory_bytes": -1}, "memory_bytes"),
    ],
)
def test_plan_memory_checks_its_options_as_context_does(
    options: dict[str, object], param: str, tmp_path: Path
) -> None:
    """Checked before the model is read (the file here does not exist)."""
    with pytest.raises(llamax.InvalidParameterError) as raised:
        llamax.plan_memory(tmp_path / "none.gguf", **options)  # type: ignore[arg-type]
    assert raised.value.param == param
