"""Sizing a context with llama.cpp without allocating it (a dry run), for
:func:`llamax.plan_memory` and for the backend's refusal of a context that cannot fit.

A model loaded with ``no_alloc`` holds its metadata and tensor shapes, not its weights; a
context made on it builds every buffer's tensors and reserves its compute graphs without
allocating them (llama.cpp's own memory-fit pass). The sizes are read from the lines
llama.cpp logs while it does (:func:`~llamax.backend.native.captured_log`): a KV cache's
``size = ... MiB (N cells, L layers, s/S seqs), K (f16): ... MiB, V (f16): ... MiB``, a
recurrent memory's ``R``/``S`` sizes, the compute buffers' sizes. They are printed in MiB
with two decimals, so the shape is read from a dry run big enough for that to be exact:
65,536 cells of F32, where a cell's K values over the layers are ``4 * K MiB``. A
recurrent memory is allocated even then, so its state is read at one sequence, then at up
to 256 if the state is small (at most 16 MiB in all).

Design note: the numbers come from llama.cpp rather than from the GGUF's hyperparameters
because which layers hold KV, which are sliding-window or recurrent and how wide each is
are decided per architecture in llama.cpp's C++ (``llama-model.cpp``); what it sizes is
what it allocates.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

from ..config import ContextConfig, KVType, env_flag, is_quantized, kv_row_bytes
from ..errors import InsufficientMemoryError, ModelLoadError
from ..memory_plan import (
    MAX_DRY_RUN_CELLS,
    KVShape,
    MemoryPlan,
    ModelShape,
    assemble_plan,
    available_memory,
    layout_cells,
    micro_batch,
    padded,
)
from .gguf_file import GGML_TYPES
from .kv_layout import adapts_layout
from .native import NativeContext, NativeModel, bindings, captured_log, context_params

__all__ = [
    "MEMORY_CHECK_ENV",
    "CacheLine",
    "DryRun",
    "SizeProbe",
    "check_context_memory",
    "memory_check_enabled",
    "parse_dry_run",
    "plan_with_probe",
]

MEMORY_CHECK_ENV = "LLAMAX_MEMORY_CHECK"
"""``0`` (``false``, ``no``, ``off``) turns :func:`check_context_memory` off."""

_MIB = 1 << 20
_SHAPE_CELLS = 65536
"""The dry run the shape is read from: a cell's values over the layers are exact at F32."""
_STATE_PROBE_BYTES = 16 << 20
"""The most recurrent state a dry run allocates to read one sequence's state precisely."""
_COMPUTE_STATE_BYTES = 64 << 20
"""The most recurrent state a dry run for compute buffers allocates: with more sequences
than that holds, the buffers are read at fewer (they barely depend on it)."""

_KV_LINE = re.compile(
    r"size =\s*[\d.]+ MiB \(\s*(\d+) cells,\s*(\d+) layers,\s*(\d+)/\s*(\d+) seqs\), "
    r"K \((\w+)\):\s*([\d.]+) MiB, V \((\w+)\):\s*([\d.]+) MiB"
)
_STATE_LINE = re.compile(
    r"size =\s*[\d.]+ MiB \(\s*(\d+) cells,\s*(\d+) layers,\s*(\d+) seqs\s+(\d+) rs_seq\), "
    r"R \(\w+\):\s*([\d.]+) MiB, S \(\w+\):\s*([\d.]+) MiB(?:, P \(\w+\):\s*([\d.]+) MiB)?"
)
_SWA_LINE = re.compile(r"creating\s+(non-)?SWA KV cache")
_COMPUTE_LINE = re.compile(r"compute buffer size =\s*([\d.]+) MiB")


@dataclass(frozen=True, slots=True)
class CacheLine:
    """One KV cache of a dry run, as llama.cpp logged it."""

    cells: int
    """Cells per stream."""
    layers: int
    n_stream: int
    k_mib: float
    v_mib: float
    windowed: bool
    """Whether it is an iSWA cache's sliding-window half."""


@dataclass(frozen=True, slots=True)
class DryRun:
    """What llama.cpp sized for one context (MiB numbers as it logged them)."""

    n_ctx: int
    n_ctx_seq: int
    caches: tuple[CacheLine, ...]
    state_cells: int
    """A recurrent memory's cells (one per sequence); 0 without one."""
    state_mib: float
    """Its R, S (and P) tensors."""
    compute_bytes: int


def parse_dry_run(lines: Sequence[str]) -> tuple[tuple[CacheLine, ...], int, float, int]:
    """``(caches, state cells, state MiB, compute bytes)`` from a context's log lines."""
    caches: list[CacheLine] = []
    windowed = False
    state_cells, state_mib, compute_mib = 0, 0.0, 0.0
    for line in lines:
        if swa := _SWA_LINE.search(line):
            windowed = swa.group(1) is None
        elif kv := _KV_LINE.search(line):
            cells, layers, _seqs, streams = (int(kv.group(i)) for i in (1, 2, 3, 4))
            k_mib, v_mib = float(kv.group(6)), float(kv.group(8))
            caches.append(CacheLine(cells, layers, streams, k_mib, v_mib, windowed))
        elif state := _STATE_LINE.search(line):
            state_cells = int(state.group(1))
            state_mib = sum(float(state.group(i) or 0) for i in (5, 6, 7))
        elif compute := _COMPUTE_LINE.search(line):
            compute_mib += float(compute.group(1))
    return tuple(caches), state_cells, state_mib, round(compute_mib * _MIB)


class SizeProbe:
    """A model loaded without its weights (``no_alloc``), on which llama.cpp sizes
    contexts without allocating them. It is the :class:`~llamax.memory_plan.Sizer` of the
    plans of ``config``; :meth:`close` frees it.

    Raises:
        ModelLoadError: the file is missing, not GGUF, or llama.cpp refuses it.
    """

    def __init__(self, config: ContextConfig) -> None:
        self._C = bindings()
        self._config = config
        path = Path(config.model_path)
        with captured_log():  # its loading lines are a dry run's too
            self._model = NativeModel(self._C, path, n_gpu_layers=0, no_alloc=True)
        self._path = path
        self._compute: dict[tuple[int, int, bool], int] = {}
        self._shape: ModelShape | None = None

    def close(self) -> None:
        """Free the model; idempotent."""
        self._model.close()

    def dry_run(
        self,
        *,
        n_ctx: int,
        n_seq_max: int,
        unified: bool,
        kv_types: tuple[KVType, KVType],
        swa_full: bool = True,
    ) -> DryRun:
        """Size a context of these sizes with the config's batch sizes and flash attention.

        Raises:
            ModelLoadError: llama.cpp refused the context (its last error line says why).
        """
        config = self._config
        cparams = context_params(
            self._C,
            n_ctx=n_ctx,
            n_batch=max(config.n_batch, n_seq_max),
            n_ubatch=micro_batch(config),
            n_seq_max=n_seq_max,
            n_threads=1,
            n_threads_batch=1,
            kv_unified=unified,
            type_k=GGML_TYPES[kv_types[0]],
            type_v=GGML_TYPES[kv_types[1]],
            swa_full=swa_full,
        )
        if config.flash_attn is not None:
            cparams.flash_attn_type = 1 if config.flash_attn else 0
        elif is_quantized(kv_types[1]):  # what the backend does: V needs flash attention
            cparams.flash_attn_type = 1
        with captured_log() as lines:
            context = NativeContext.create(self._model, cparams)
        if context is None:
            said = [line.strip() for line in lines if "error" in line.lower() or "fail" in line]
            raise ModelLoadError(
                f"llama.cpp refused a context for {self._path} (n_ctx={n_ctx}, "
                f"n_seq_max={n_seq_max}, KV types {kv_types[0]}/{kv_types[1]})"
                + (f": {said[-1]}" if said else "")
            )
        with closing(context):
            sizes = context.n_ctx(), context.n_ctx_seq()
        caches, state_cells, state_mib, compute = parse_dry_run(lines)
        return DryRun(*sizes, caches, state_cells, state_mib, compute)

    def shape(self) -> ModelShape:
        """The model's :class:`~llamax.memory_plan.ModelShape`, read once."""
        if self._shape is None:
            self._shape = self._read_shape()
        return self._shape

    def _read_shape(self) -> ModelShape:
        model = self._model
        run = self.dry_run(
            n_ctx=_SHAPE_CELLS, n_seq_max=1, unified=True, kv_types=("f32", "f32")
        )  # one stream: a cell's K values are 4 * K MiB * 2**20 / (4 bytes * cells)
        window = model.n_swa()
        caches = tuple(
            KVShape(
                num_layers=line.layers,
                k_values=round(line.k_mib * _MIB / (4 * line.cells * line.n_stream)),
                v_values=round(line.v_mib * _MIB / (4 * line.cells * line.n_stream)),
                window=window if line.windowed else 0,
            )
            for line in run.caches
        )
        state = 0
        if run.state_cells:
            state = round(run.state_mib * _MIB / run.state_cells)
            most = (run.state_mib + 0.015) * _MIB  # each of R, S, P is rounded to 0.005 MiB
            n_seq = min(256, int(_STATE_PROBE_BYTES // most))
            if n_seq > 1:
                again = self.dry_run(
                    n_ctx=padded(n_seq), n_seq_max=n_seq, unified=True, kv_types=("f16", "f16")
                )
                state = round(again.state_mib * _MIB / max(1, again.state_cells))
        return ModelShape(
            path=self._path,
            description=model.desc(),
            weights_bytes=model.size(),
            n_vocab=model.n_vocab(),
            n_ctx_train=model.n_ctx_train(),
            caches=caches,
            state_bytes_per_seq=state,
            is_recurrent=model.is_recurrent(),
            is_hybrid=model.is_hybrid(),
            n_swa=window,
        )

    # ------------------------------------------------------------------ Sizer
    def layout(self, n_ctx: int, n_seq_max: int) -> tuple[bool, bool]:
        """``(unified, moves)`` as the backend decides them for these sizes."""
        config = dataclasses.replace(
            self._config,
            n_ctx=n_ctx,
            n_seq_max=n_seq_max,
            n_batch=max(self._config.n_batch, n_seq_max),
        )
        moves = adapts_layout(config, self.shape().movable_kv)
        return config.resolved_kv_layout == "unified" and not moves, moves

    def compute_bytes(self, n_ctx: int, n_seq_max: int, unified: bool) -> int:
        """llama.cpp's compute buffers for these sizes (a dry run, remembered). A dry run
        still allocates a recurrent memory, and each cell's bookkeeping (positions and
        sequence ids, about 48 bytes): with more sequences than
        ``_COMPUTE_STATE_BYTES`` of state, the buffers are sized at fewer, and with more
        than :data:`~llamax.memory_plan.MAX_DRY_RUN_CELLS` cells at that many (a lower
        bound: they grow with the cells)."""
        per_seq = self.shape().state_bytes_per_seq
        if per_seq:
            n_seq_max = max(1, min(n_seq_max, _COMPUTE_STATE_BYTES // per_seq))
        key = (min(padded(n_ctx), MAX_DRY_RUN_CELLS), n_seq_max, unified)
        config = self._config
        if key not in self._compute:
            run = self.dry_run(
                n_ctx=key[0], n_seq_max=n_seq_max, unified=unified, kv_types=config.kv_types
            )
            self._compute[key] = run.compute_bytes
        return self._compute[key]


def plan_with_probe(config: ContextConfig, memory_bytes: int, *, search: bool = True) -> MemoryPlan:
    """:func:`llamax.plan_memory`'s work: the plan of ``config``.

    Raises:
        ModelLoadError: llama.cpp refuses the file or the context.
    """
    with closing(SizeProbe(config)) as probe:
        return assemble_plan(probe.shape(), probe, config, memory_bytes, search=search)


def memory_check_enabled() -> bool:
    """Whether :func:`check_context_memory` runs: ``$LLAMAX_MEMORY_CHECK`` is not off.

    Raises:
        InvalidParameterError: the variable holds something else than ``0``/``1``,
            ``false``/``true``, ``no``/``yes``, ``off``/``on``.
    """
    return env_flag(MEMORY_CHECK_ENV, "1")


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"


def check_context_memory(
    model: NativeModel, config: ContextConfig, *, unified: bool, dims: tuple[int, int]
) -> None:
    """Refuse a context whose buffers cannot fit, before llama.cpp allocates them.

    llama.cpp zeroes the KV cache as it allocates it, so a cache larger than the memory
    the kernel can hand out is not a clean allocation failure: the process (or another)
    is killed halfway. So a context whose KV cache, recurrent state, compute and output
    buffers (:attr:`MemoryPlan.context_bytes`) exceed ``MemAvailable + SwapFree`` is
    refused. The weights (mapped, already loaded), the RAM tier (filled later) and a move
    between layouts do not count: this refuses only what cannot work. The exact plan (a
    dry run) is made only when the KV cache estimated from the model's attention shape
    (``dims``: a layer's K and V values a cell, every layer alike) takes more than half
    that memory, so a context that plainly fits pays nothing.
    Skipped with layers on a GPU (the buffers are not in host memory) and with
    ``$LLAMAX_MEMORY_CHECK=0``.

    Raises:
        InsufficientMemoryError: the context cannot fit; the message gives the plan's
            numbers and the largest ``n_ctx`` that fits.
        InvalidParameterError: ``$LLAMAX_MEMORY_CHECK`` holds something else than a flag.
    """
    if not memory_check_enabled():
        return
    if config.n_gpu_layers != 0 and model.C.llama_supports_gpu_offload():
        return
    limit = available_memory(swap=True)
    if not limit:
        return
    type_k, type_v = config.kv_types
    per_stream, n_stream = layout_cells(config.n_ctx, config.n_seq_max, unified)
    per_cell = (kv_row_bytes(type_k, dims[0]) + kv_row_bytes(type_v, dims[1])) * model.n_layer()
    if per_cell * per_stream * n_stream <= limit // 2:
        return
    plan = plan_with_probe(config, limit)
    if plan.context_bytes <= limit:
        return
    parts = [
        f"KV cache {_size(plan.kv_bytes)}: {plan.kv_cells:,} cells of "
        f"{plan.kv_bytes_per_cell:,} bytes at {type_k}/{type_v}"
    ]
    if plan.state_bytes:
        parts.append(f"recurrent state {_size(plan.state_bytes)}")
    parts += [f"compute buffers {_size(plan.compute_bytes)}", f"output {_size(plan.output_bytes)}"]
    fits = (
        f"the largest n_ctx whose whole plan fits with n_seq_max={plan.n_seq_max} (the "
        f"weights and the RAM tier counted too) is {plan.max_n_ctx:,}"
        if plan.max_n_ctx
        else f"no n_ctx fits with n_seq_max={plan.n_seq_max}"
    )
    raise InsufficientMemoryError(
        f"a context of n_ctx={config.n_ctx:,}, n_seq_max={config.n_seq_max} for "
        f"{plan.model_path.name} needs {_size(plan.context_bytes)} beside its weights "
        f"({'; '.join(parts)}), more than the {_size(limit)} of memory available "
        f"(MemAvailable + SwapFree); {fits} (llamax.plan_memory plans others; "
        f"${MEMORY_CHECK_ENV}=0 creates it anyway)",
        plan=plan,
        available_bytes=limit,
    )
