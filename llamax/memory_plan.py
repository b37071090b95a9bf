"""What a context will cost in memory, before it exists: :func:`plan_memory`.

A context's memory is the model's weights, the KV cache (every attention layer's K and V of
every cell), a recurrent model's state (per sequence, whatever its length), llama.cpp's
compute buffers (intermediate results of one micro-batch), its output buffer (a row of
logits per sequence), and the host-RAM tier of evicted prefixes. :func:`plan_memory` sizes
them for a model and a set of :class:`~llamax.Context` options without allocating
anything: llama.cpp sizes a context on the model's metadata alone (a *dry run*: the weights
are not read and no buffer is allocated), and the KV cache's bytes follow from the cells a
layout holds and the widths of the model's layers (:class:`ModelShape`). It says whether
all of it fits a memory size, and the largest ``n_ctx`` and ``n_seq_max`` that do.

The same numbers make a :class:`~llamax.Context` that cannot fit fail before llama.cpp
allocates it (:class:`~llamax.InsufficientMemoryError`), rather than be killed by the
kernel halfway through zeroing its KV cache (docs/memory.md).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol, TypeAlias

from .checks import require
from .config import ContextConfig, KVLayout, KVType, kv_row_bytes
from .models import default_model_path

__all__ = [
    "MAX_DRY_RUN_CELLS",
    "MAX_PLANNED_CTX",
    "PLANNED_OPTIONS",
    "KVShape",
    "MemoryPlan",
    "ModelShape",
    "Sizer",
    "assemble_plan",
    "available_memory",
    "kv_bytes",
    "layout_cells",
    "micro_batch",
    "padded",
    "plan_memory",
]

_PAD = 256
"""llama.cpp pads ``n_ctx``, each stream and a window's cache to a multiple of this."""

MAX_DRY_RUN_CELLS = 1 << 22
"""The most cells a dry run sizes (4,194,304): it allocates each cell's bookkeeping, about
48 bytes. A context of more has its compute buffers sized at this many (a lower bound)."""

MAX_PLANNED_CTX = MAX_DRY_RUN_CELLS
"""The largest ``n_ctx`` the searches of :func:`plan_memory` try: a model whose memory
does not grow with its context (recurrent) reports this one."""

_MAX_SEQ = 256
"""llama.cpp's most sequences (``LLAMA_MAX_SEQ``), as ``n_seq_max`` allows."""


def padded(n: int) -> int:
    """``n`` cells as llama.cpp pads them (a multiple of 256, at least 256)."""
    return max(_PAD, -(-n // _PAD) * _PAD)


def micro_batch(config: ContextConfig) -> int:
    """The micro-batch llamax asks llama.cpp for: ``n_ubatch``, else ``n_batch`` at most
    512 (llama.cpp then takes at most ``n_ctx``)."""
    return min(config.n_ubatch or min(config.n_batch, 512), config.n_batch)


def layout_cells(n_ctx: int, n_seq_max: int, unified: bool) -> tuple[int, int]:
    """``(cells per stream, streams)`` llama.cpp allocates for ``n_ctx``: one buffer of
    ``n_ctx`` cells padded to 256, or ``n_seq_max`` streams of ``n_ctx // n_seq_max``
    cells each padded to 256 (``llama_context``'s constructor), which may hold more than
    ``n_ctx`` (``n_ctx=2048, n_seq_max=16``: 16 x 256 = 4,096 cells)."""
    if unified:
        return padded(n_ctx), 1
    return padded(padded(n_ctx) // n_seq_max), n_seq_max


@dataclass(frozen=True, slots=True)
class KVShape:
    """One KV cache of a model, as llama.cpp builds it: the layers it holds and the values
    one cell takes in them. A model has one, or two with sliding-window layers (llama.cpp's
    iSWA cache: the full-attention layers', then the window layers')."""

    num_layers: int
    k_values: int
    """K values of one cell, over the cache's layers (the sum of their ``n_embd_k_gqa``)."""
    v_values: int
    """V values of one cell, over the cache's layers (``n_embd_v_gqa``)."""
    window: int = 0
    """The sliding window of its layers (``llama_model_n_swa``); 0 for full attention."""

    def cell_bytes(self, type_k: str, type_v: str) -> int:
        """Bytes of one cell of this cache at these types (each layer's row is whole blocks
        of a quantized type, or llama.cpp refuses the type, so the sum's row is theirs)."""
        return kv_row_bytes(type_k, self.k_values) + kv_row_bytes(type_v, self.v_values)


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What a model's memory is made of, read from llama.cpp (a dry run on its metadata:
    :mod:`llamax.backend.memory_probe`)."""

    path: Path
    description: str
    """llama.cpp's one-line summary (type, size, quantisation)."""
    weights_bytes: int
    """The weights' bytes (``llama_model_size``)."""
    n_vocab: int
    n_ctx_train: int
    caches: tuple[KVShape, ...]
    """The KV caches (none for a recurrent model)."""
    state_bytes_per_seq: int = 0
    """A recurrent or hybrid model's state (F32, its R and S tensors) for one sequence."""
    is_recurrent: bool = False
    is_hybrid: bool = False
    n_swa: int = 0
    """The sliding window (``llama_model_n_swa``), 0 when none."""

    @property
    def plain_kv(self) -> bool:
        """One KV cache of full attention and nothing else, as the backend decides it: its
        sequences' states can move between layouts (``kv_layout="auto"`` adapts)."""
        return not (self.is_recurrent or self.is_hybrid or self.n_swa > 0)

    @property
    def movable_kv(self) -> bool:
        """Whether its sequences' states can move between layouts (``kv_layout="auto"``
        adapts): one full-attention KV cache, alone (:attr:`plain_kv`) or beside a hybrid's
        recurrent state (the backend decides it the same way)."""
        return self.plain_kv or (self.is_hybrid and self.n_swa == 0)

    def cell_bytes(self, type_k: str, type_v: str) -> int:
        """Bytes of one cell in every cache: what one more token of a sequence costs (a
        window layer's cell holds a token of its window)."""
        return sum(cache.cell_bytes(type_k, type_v) for cache in self.caches)


def kv_bytes(
    shape: ModelShape,
    n_ctx: int,
    n_seq_max: int,
    *,
    unified: bool,
    type_k: str,
    type_v: str,
    n_ubatch: int = 512,
    swa_full: bool = True,
) -> int:
    """The bytes of every KV cache llama.cpp allocates for this context.

    A window's cache holds as many cells as the full-attention one with ``swa_full`` (as
    llamax creates contexts, so that a sequence cuts exactly anywhere); without it,
    ``n_swa`` (times ``n_seq_max`` when unified) plus ``n_ubatch`` cells, padded to 256 and
    at most the other's (``llama_kv_cache_iswa``).
    """
    per_stream, n_stream = layout_cells(n_ctx, n_seq_max, unified)
    total = 0
    for cache in shape.caches:
        cells = per_stream
        if cache.window and not swa_full:
            span = cache.window * (n_seq_max if unified else 1) + n_ubatch
            cells = padded(min(per_stream, span))
        total += cache.cell_bytes(type_k, type_v) * cells * n_stream
    return total


class Sizer(Protocol):
    """What :func:`assemble_plan` asks llama.cpp (:class:`~llamax.backend.memory_probe.
    SizeProbe`): the layout a context starts in, and the size of its compute buffers."""

    def layout(self, n_ctx: int, n_seq_max: int) -> tuple[bool, bool]:
        """``(unified, moves)``: whether a context of these sizes starts with one buffer,
        and whether ``kv_layout="auto"`` moves it between layouts."""
        ...

    def compute_bytes(self, n_ctx: int, n_seq_max: int, unified: bool) -> int:
        """llama.cpp's compute buffers for a context of these sizes in that layout."""
        ...


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """What a context of a model and a set of options costs in memory, part by part, and
    whether it fits a memory size: :func:`plan_memory`'s answer. Every size is in bytes.

    ``context_bytes`` is what creating the context allocates beside the weights (the KV
    cache is zeroed at once, so it is resident from the start); ``total_bytes`` adds the
    weights, a move between KV layouts (both contexts live for a moment) and the RAM tier's
    budget (filled as prefixes are evicted), and ``fits`` compares it with
    ``memory_bytes``.
    """

    model_path: Path
    description: str
    """llama.cpp's one-line summary of the model."""
    n_ctx: int
    """The ``n_ctx`` planned (KV cells asked for)."""
    n_seq_max: int
    kv_type_k: KVType
    kv_type_v: KVType
    kv_layout: Literal["unified", "streams"]
    """The layout the context starts in."""
    moves_layout: bool
    """Whether ``kv_layout="auto"`` moves the cache between layouts (see ``relayout_bytes``)."""
    kv_cells: int
    """KV cells allocated, over all streams (llama.cpp pads each stream to 256 cells)."""
    n_ctx_stream: int
    """Cells one sequence may hold in the starting layout: its stream's, or all of them."""
    weights_bytes: int
    """The model's weights (mapped from the file: page cache the kernel may evict, but
    every decode reads all of them)."""
    kv_bytes_per_cell: int
    """One cell in every layer at these KV types: what one more token costs."""
    kv_bytes: int
    """The KV cache as allocated: ``kv_cells * kv_bytes_per_cell`` (a window's cache
    sized as llama.cpp sizes it)."""
    state_bytes_per_seq: int
    """A recurrent or hybrid model's state for one sequence (0 for attention alone)."""
    state_bytes: int
    """``state_bytes_per_seq * n_seq_max``: every sequence's state, allocated at once."""
    compute_bytes: int
    """llama.cpp's compute buffers, as it sizes them for this context (a dry run)."""
    output_bytes: int
    """The logits buffer: a row of ``n_vocab`` floats per sequence. A decode asking logits
    for more rows (a speculative draft's) grows it, up to ``n_batch`` rows."""
    relayout_bytes: int
    """What a move between layouts adds while both contexts live (the other layout's KV
    cache, compute and output buffers); 0 when the cache never moves."""
    prefix_ram_bytes: int
    """The host-RAM prefix tier's budget (``prefix_ram_bytes``, else a quarter of
    ``memory_bytes`` at most 8 GiB, times ``prefix_ram_share``; 0 without a tier)."""
    context_bytes: int
    """``kv_bytes + state_bytes + compute_bytes + output_bytes``: what creating the
    context allocates beside the weights."""
    total_bytes: int
    """``weights_bytes + context_bytes + relayout_bytes + prefix_ram_bytes``."""
    memory_bytes: int
    """The memory planned for (``memory_bytes``, else what the kernel reports available:
    ``MemAvailable``)."""
    fits: bool
    """``total_bytes <= memory_bytes``."""
    max_n_ctx: int
    """The largest ``n_ctx`` (a multiple of 256) whose plan fits with this ``n_seq_max``
    and the other options; 0 when none does; at most :data:`MAX_PLANNED_CTX`."""
    max_n_seq_max: int
    """The largest ``n_seq_max`` (at most 256 and ``n_ctx``) whose plan fits with this
    ``n_ctx``; 0 when none does (``n_batch`` must be at least it)."""


def available_memory(meminfo: str = "/proc/meminfo", *, swap: bool = False) -> int:
    """The memory the kernel could hand out now without swapping: ``MemAvailable`` (with
    ``swap``, plus ``SwapFree``), else the free physical pages; 0 when neither can be read."""
    fields: dict[str, int] = {}
    try:
        with open(meminfo, encoding="ascii") as file:
            for line in file:
                name, _, rest = line.partition(":")
                if name in ("MemAvailable", "SwapFree"):
                    fields[name] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    available = fields.get("MemAvailable", 0)
    if not available:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, ValueError, OSError):
            available = 0
    return available + (fields.get("SwapFree", 0) if swap and available else 0)


def _ram_tier_bytes(config: ContextConfig, memory_bytes: int) -> int:
    """The RAM tier's budget for ``config`` on a machine of ``memory_bytes`` available
    (``llamax.engine.kv.prefix.PrefixCache.build``'s, whose default reads the machine)."""
    from .engine.kv.prefix_ram import MAX_DEFAULT_BYTES

    if not config.prefix_cache:
        return 0
    if config.prefix_ram_bytes is not None:
        return config.prefix_ram_bytes
    return int(min(memory_bytes // 4, MAX_DEFAULT_BYTES) * config.prefix_ram_share)


@dataclass(frozen=True, slots=True)
class _Need:
    """One candidate context's parts (see :class:`MemoryPlan`)."""

    unified: bool
    moves: bool
    per_stream: int
    n_stream: int
    kv: int
    state: int
    compute: int
    output: int
    relayout: int

    @property
    def context(self) -> int:
        return self.kv + self.state + self.compute + self.output


Compute: TypeAlias = Callable[[int, int, bool], int]
"""``(n_ctx, n_seq_max, unified) -> bytes`` of compute buffers (:meth:`Sizer.compute_bytes`,
or a bound standing in for it)."""


def _need(
    shape: ModelShape,
    sizer: Sizer,
    compute: Compute,
    config: ContextConfig,
    kv_types: tuple[KVType, KVType],
    n_ctx: int,
    n_seq_max: int,
) -> _Need:
    unified, moves = sizer.layout(n_ctx, n_seq_max)
    per_stream, n_stream = layout_cells(n_ctx, n_seq_max, unified)
    n_ubatch = min(micro_batch(config), padded(n_ctx))

    def kv(in_unified: bool) -> int:
        return kv_bytes(
            shape, n_ctx, n_seq_max, unified=in_unified, type_k=kv_types[0],
            type_v=kv_types[1], n_ubatch=n_ubatch,
        )  # fmt: skip

    output = shape.n_vocab * 4 * n_seq_max
    relayout = 0
    if moves:
        relayout = kv(not unified) + compute(n_ctx, n_seq_max, not unified) + output
    return _Need(
        unified=unified,
        moves=moves,
        per_stream=per_stream,
        n_stream=n_stream,
        kv=kv(unified),
        state=shape.state_bytes_per_seq * max(1, n_seq_max),
        compute=compute(n_ctx, n_seq_max, unified),
        output=output,
        relayout=relayout,
    )


def _largest(fits: Callable[[int], bool], low: int, high: int) -> int:
    """The largest ``k`` in ``[low, high]`` with ``fits(k)``, for a ``fits`` true up to
    some ``k`` and false past it; ``low - 1`` when ``fits(low)`` is false."""
    if not fits(low):
        return low - 1
    if fits(high):
        return high
    while high - low > 1:  # fits(low), not fits(high)
        mid = (low + high) // 2
        if fits(mid):
            low = mid
        else:
            high = mid
    return low


def _largest_fitting(
    fits: Callable[[int, Compute], bool], compute: Compute, at: Callable[[int], tuple[int, int]],
    low: int, high: int,
) -> int:  # fmt: skip
    """The largest ``k`` in ``[low, high]`` that ``fits`` with the real ``compute``, in few
    dry runs: compute buffers grow with the context, so the answer lies between the
    largest ``k`` that fits with none and the largest that fits with those of that one
    (``at(k)``: its ``(n_ctx, n_seq_max)``); only that span is bisected with dry runs."""
    top = _largest(lambda k: fits(k, lambda *_: 0), low, high)
    if top < low:
        return top
    n_ctx, n_seq_max = at(top)
    most = max(compute(n_ctx, n_seq_max, unified) for unified in (False, True))
    bottom = _largest(lambda k: fits(k, lambda *_: most), low, top)
    if bottom < low:
        return _largest(lambda k: fits(k, compute), low, top)
    return _largest(lambda k: fits(k, compute), bottom, top)


def assemble_plan(
    shape: ModelShape,
    sizer: Sizer,
    config: ContextConfig,
    memory_bytes: int,
    *,
    search: bool = True,
) -> MemoryPlan:
    """The plan of a context of ``config`` (at its KV types) for a model of ``shape``, with
    its compute buffers and layout from ``sizer``, against ``memory_bytes``. With
    ``search``, the largest ``n_ctx`` and ``n_seq_max`` that fit are found by bisection
    (a few dry runs of llama.cpp's sizing); without, both are 0."""
    fixed = shape.weights_bytes + _ram_tier_bytes(config, memory_bytes)
    kv_types = config.kv_types

    def total(need: _Need) -> int:
        return fixed + need.context + need.relayout

    def fits(n_ctx: int, n_seq_max: int, compute: Compute) -> bool:
        streams = config.kv_layout == "streams"
        if n_seq_max > n_ctx or (streams and (config.n_ctx_seq or 16) * n_seq_max > n_ctx):
            return False  # ContextConfig refuses these sizes
        need = _need(shape, sizer, compute, config, kv_types, n_ctx, n_seq_max)
        return total(need) <= memory_bytes

    real = sizer.compute_bytes
    need = _need(shape, sizer, real, config, kv_types, config.n_ctx, config.n_seq_max)
    max_n_ctx = max_n_seq_max = 0
    if search:
        n_seq_max, n_ctx = config.n_seq_max, config.n_ctx
        low = max(1, -(-max(n_seq_max, config.n_ctx_seq or 0) // _PAD))
        top = _largest_fitting(
            lambda k, compute: fits(k * _PAD, n_seq_max, compute), real,
            lambda k: (k * _PAD, n_seq_max), low, MAX_PLANNED_CTX // _PAD,
        )  # fmt: skip
        max_n_ctx = max(0, top) * _PAD
        most = _largest_fitting(
            lambda s, compute: fits(n_ctx, s, compute), real,
            lambda s: (n_ctx, s), 1, min(_MAX_SEQ, n_ctx),
        )  # fmt: skip
        max_n_seq_max = max(0, most)
    return MemoryPlan(
        model_path=shape.path,
        description=shape.description,
        n_ctx=config.n_ctx,
        n_seq_max=config.n_seq_max,
        kv_type_k=kv_types[0],
        kv_type_v=kv_types[1],
        kv_layout="unified" if need.unified else "streams",
        moves_layout=need.moves,
        kv_cells=need.per_stream * need.n_stream,
        n_ctx_stream=need.per_stream,
        weights_bytes=shape.weights_bytes,
        kv_bytes_per_cell=shape.cell_bytes(*kv_types),
        kv_bytes=need.kv,
        state_bytes_per_seq=shape.state_bytes_per_seq,
        state_bytes=need.state,
        compute_bytes=need.compute,
        output_bytes=need.output,
        relayout_bytes=need.relayout,
        prefix_ram_bytes=fixed - shape.weights_bytes,
        context_bytes=need.context,
        total_bytes=total(need),
        memory_bytes=memory_bytes,
        fits=total(need) <= memory_bytes,
        max_n_ctx=max_n_ctx,
        max_n_seq_max=max_n_seq_max,
    )


PLANNED_OPTIONS: tuple[str, ...] = (
    "n_ctx", "n_seq_max", "kv_type", "kv_type_k", "kv_type_v", "n_ctx_seq", "kv_layout",
    "n_batch", "n_ubatch", "flash_attn", "prefix_cache", "prefix_ram_bytes",
    "prefix_ram_share",
)  # fmt: skip
"""The :class:`~llamax.Context` options :func:`plan_memory` takes: those that decide its
memory."""


def plan_memory(
    model_path: str | os.PathLike[str] | None = None,
    *,
    n_ctx: int = 4096,
    n_seq_max: int = 16,
    kv_type: KVType = "f16",
    kv_type_k: KVType | None = None,
    kv_type_v: KVType | None = None,
    n_ctx_seq: int | None = None,
    kv_layout: KVLayout = "auto",
    n_batch: int = 512,
    n_ubatch: int | None = None,
    flash_attn: bool | None = None,
    prefix_cache: bool = True,
    prefix_ram_bytes: int | None = None,
    prefix_ram_share: float = 1.0,
    memory_bytes: int | None = None,
    search: bool = True,
) -> MemoryPlan:
    """Plan the memory of ``llamax.Context(model_path, **options)`` without creating it.

    The options are :class:`~llamax.Context`'s that decide its memory, with its defaults,
    so a plan is that of the context the same keywords create (they are checked as it
    checks them). llama.cpp reads the model's metadata (not its weights) and sizes the
    context without allocating it, in well under a second; the plan is for a context on
    the CPU (with layers on a GPU, the KV cache and compute buffers go to its memory).

    Args:
        model_path: a GGUF file; ``None`` means ``$LLAMAX_MODEL`` or the default model.
        n_ctx: KV cells, over all sequences.
        n_seq_max: sequences computed at once.
        kv_type: the K and V caches' number type (``"f16"``, ``"q8_0"`` ...:
            :data:`llamax.config.KV_TYPES`).
        kv_type_k: the K cache's type, where it differs from ``kv_type``.
        kv_type_v: the V cache's type, where it differs (quantized, it needs flash
            attention: ``flash_attn=False`` is refused).
        n_ctx_seq: the most tokens one sequence may hold (it decides the layout).
        kv_layout: ``"auto"``, ``"unified"`` or ``"streams"``.
        n_batch: most tokens a decode carries.
        n_ubatch: llama.cpp's micro-batch (the compute buffers follow it).
        flash_attn: flash attention (``None``: llama.cpp decides).
        prefix_cache: whether finished prefixes are kept (and so whether the RAM tier is).
        prefix_ram_bytes: the RAM tier's budget (``None``: a quarter of ``memory_bytes``,
            at most 8 GiB, times ``prefix_ram_share``).
        prefix_ram_share: this context's share of the default RAM tier budget.
        memory_bytes: the memory to plan for (``None``: what the kernel reports available
            now, ``MemAvailable``).
        search: find the largest ``n_ctx`` and ``n_seq_max`` that fit (a few more dry
            runs); without, :attr:`MemoryPlan.max_n_ctx` and ``max_n_seq_max`` are 0.

    Returns:
        The :class:`MemoryPlan`.

    Raises:
        InvalidParameterError: an option is out of range, as :class:`~llamax.Context`
            says it (an unknown KV type, a quantized V without flash attention ...).
        ModelLoadError: the file is missing, not GGUF, or llama.cpp refuses it or the
            context.
    """
    from .backend.memory_probe import plan_with_probe

    path = Path(model_path or os.environ.get("LLAMAX_MODEL") or default_model_path()).expanduser()
    require(
        memory_bytes is None or (isinstance(memory_bytes, int) and memory_bytes >= 0),
        f"memory_bytes must be None or an int >= 0, got {memory_bytes!r}",
        "memory_bytes",
    )
    config = ContextConfig(
        model_path=str(path),
        n_ctx=n_ctx,
        n_seq_max=n_seq_max,
        kv_type=kv_type,
        kv_type_k=kv_type_k,
        kv_type_v=kv_type_v,
        n_ctx_seq=n_ctx_seq,
        kv_layout=kv_layout,
        n_batch=n_batch,
        n_ubatch=n_ubatch,
        flash_attn=flash_attn,
        prefix_cache=prefix_cache,
        prefix_ram_bytes=prefix_ram_bytes,
        prefix_ram_share=prefix_ram_share,
    )
    memory = available_memory() if memory_bytes is None else memory_bytes
    return plan_with_probe(config, memory, search=search)
