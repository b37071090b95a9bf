"""Frozen, validated context options: :class:`ContextConfig` (what the user chose),
:class:`ContextOptions` (its keyword form) and :class:`EngineConfig` (what the engine gets
of it)."""

from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias, TypedDict

from .checks import (
    Check,
    is_endpoint_list,
    is_int,
    is_pathlike,
    is_real,
    refuse_huge_ints,
    require,
    where,
)
from .drafting import DraftMethod, PromptLookup, Speculative
from .optionspec import byte_size, read_text, spec, zero_is_none
from .params import SamplingParams

__all__ = [
    "KV_TYPES",
    "OPTION_LISTS",
    "ContextConfig",
    "ContextOptions",
    "EngineConfig",
    "KVLayout",
    "KVType",
    "env_flag",
    "flash_attention_is_row_exact",
    "is_quantized",
    "kv_row_bytes",
]

KVLayout: TypeAlias = Literal["auto", "unified", "streams"]
"""How KV cells are laid out: one shared buffer, one buffer per sequence, or chosen."""

KVType: TypeAlias = Literal["f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "iq4_nl", "q4_0"]
"""The number type of the K or V cache: ggml's names, those llama-server's ``-ctk``/``-ctv``
take."""

_KV_BLOCKS: dict[str, tuple[int, int]] = {
    "f32": (1, 4), "f16": (1, 2), "bf16": (1, 2), "q8_0": (32, 34), "q5_1": (32, 24),
    "q5_0": (32, 22), "q4_1": (32, 20), "iq4_nl": (32, 18), "q4_0": (32, 18),
}  # fmt: skip
"""Each KV type's block: ``(values, bytes)`` (ggml's ``blck_size`` and ``type_size``)."""

KV_TYPES: tuple[KVType, ...] = typing.get_args(KVType)
"""The KV types ``kv_type``, ``kv_type_k`` and ``kv_type_v`` take, widest first."""


def is_quantized(kv_type: str) -> bool:
    """Whether ``kv_type`` stores blocks of values with a shared scale (``q8_0`` ...), not
    one float a value: a quantized V cache needs flash attention."""
    return _KV_BLOCKS[kv_type][0] > 1


def flash_attention_is_row_exact(type_k: str, type_v: str) -> bool:
    """Whether ggml's CPU flash attention computes each query row by itself over K and V of
    these types, whatever the batch: its tiled kernel (a prompt chunk of many rows) and its
    split kernel (a lone row over 512 cells or more, its cells shared among the threads)
    take only an F16 K and V (F32 is cast to F16 first); any other pair (a quantized or BF16
    K, or a V of another type than K) gets the row-by-row kernel, whose sums do not depend
    on the rows beside a row, the chunking or the thread count (docs/reproducible.md)."""

    def cast(kv_type: str) -> str:
        return "f16" if kv_type == "f32" else kv_type

    return not (cast(type_k) == "f16" and cast(type_v) == "f16")


def kv_row_bytes(kv_type: str, num_values: int) -> int:
    """The bytes ``num_values`` values take in ``kv_type`` (ggml's ``ggml_row_size``; a
    quantized type's values come in whole blocks of 32).

    Raises:
        KeyError: not one of :data:`KV_TYPES`.
    """
    values, size = _KV_BLOCKS[kv_type]
    return -(-num_values // values) * size


def _default_threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS, Windows
        return max(1, os.cpu_count() or 1)


_ENV_ADAPT = "LLAMAX_ADAPT_THREADS"
_ENV_REPRODUCIBLE = "LLAMAX_REPRODUCIBLE"
_OFF, _ON = ("0", "false", "no", "off"), ("1", "true", "yes", "on")


def env_flag(name: str, default: str) -> bool:
    """Environment variable ``name`` (``default`` when unset) as a switch: ``0``/``1``,
    ``false``/``true``, ``no``/``yes``, ``off``/``on``, any case.

    Raises:
        InvalidParameterError: the variable holds anything else.
    """
    value = os.environ.get(name, default).strip().lower()
    require(
        value in _OFF + _ON,
        f"${name} must be one of {', '.join(_OFF + _ON)}, got {value!r}",
    )
    return value in _ON


def adapt_threads_default() -> bool:
    """``adapt_threads`` when it is not given: ``$LLAMAX_ADAPT_THREADS`` (``0``/``1``,
    ``false``/``true``, ``no``/``yes``, ``off``/``on``), else on.

    Raises:
        InvalidParameterError: the variable holds anything else.
    """
    return env_flag(_ENV_ADAPT, "1")


def reproducible_default() -> bool:
    """``reproducible`` when it is not given: ``$LLAMAX_REPRODUCIBLE`` (``0``/``1``,
    ``false``/``true``, ``no``/``yes``, ``off``/``on``), else off.

    Raises:
        InvalidParameterError: the variable holds anything else.
    """
    return env_flag(_ENV_REPRODUCIBLE, "0")


def _prompt_lookup(max_draft: int) -> PromptLookup | None:
    return PromptLookup(max_draft=max_draft) if max_draft else None


_INT = where(is_int, "must be an int")
_INT_OR_NONE = where(lambda v: v is None or is_int(v), "must be an int or None")
_BOOL = where(lambda v: v is None or isinstance(v, bool), "must be a bool")
_BYTES = where(lambda v: v is None or (is_int(v) and v >= 0), "must be None or an int >= 0")
_SHARE = where(lambda v: is_real(v) and 0 < v <= 1, "must be a number in (0, 1]")
_DIR = where(lambda v: v is None or is_pathlike(v), "must be None or a directory path")
_FILE = where(lambda v: v is None or is_pathlike(v), "must be None or a file path")
_PATHS = ("prefix_disk_dir", "mmproj")
"""Path fields: a ``str`` or any ``os.PathLike`` is taken, and kept as a ``str``."""
_MS = where(lambda v: v is None or is_real(v), "must be a number or None")
_DRAFT = where(
    lambda v: v is None or isinstance(v, DraftMethod), "must be None or a llamax.PromptLookup"
)
_TEMPLATE = where(
    lambda v: v is None or isinstance(v, str), "must be a str or None", show_type=True
)
_LORA = where(
    lambda v: (
        v is None
        or (
            isinstance(v, Mapping)
            and all(isinstance(k, str) and k and is_pathlike(p) for k, p in v.items())
        )
    ),
    "must be a dict of adapter name -> GGUF path",
)
_TYPE_CHECKS: tuple[tuple[Check, tuple[str, ...]], ...] = (
    (_INT, ("n_ctx", "n_seq_max", "n_batch", "n_gpu_layers")),
    (_INT_OR_NONE, ("n_ctx_seq", "n_ubatch", "n_threads", "n_threads_batch")),
    (_BOOL, ("use_mmap", "prefix_cache", "verbose", "use_extra_bufts", "flash_attn", "calibrate")),
    (_BOOL, ("adapt_threads", "reproducible", "backend_sampling")),
    (_BYTES, ("prefix_ram_bytes", "prefix_disk_bytes")),
    (_SHARE, ("prefix_ram_share", "prefix_disk_share")),
    (_DIR, ("prefix_disk_dir",)),
    (_FILE, ("mmproj",)),
    (_MS, ("max_step_ms",)),
    (_DRAFT, ("speculative",)),
    (_TEMPLATE, ("chat_template",)),
    (_LORA, ("lora",)),
)
"""What :meth:`ContextConfig._check_types` runs, in order: ``(check, fields)``."""


@dataclass(frozen=True, slots=True)
class ContextConfig:
    """What the user chose for a :class:`llamax.Context`. Load-time facts live on the engine.

    ``n_ctx`` is the number of KV cells, which is what the KV cache costs in memory, in
    every layout. ``n_ctx_seq`` is the most tokens one sequence (prompt and reply) may hold;
    by default ``n_ctx``. ``kv_layout`` says how the cells are laid out (see
    docs/kv-cache.md): ``"unified"``, one buffer all sequences share (any sequence may grow
    to ``n_ctx``, but every decode attends over the whole used span); ``"streams"``, one
    buffer of ``n_ctx // n_seq_max`` cells per sequence (each decode attends only to its
    own cells; needs ``n_ctx_seq <= n_ctx // n_seq_max``); ``"auto"`` (default): streams
    when ``n_ctx_seq`` is given and fits in one; otherwise streams while every sequence
    fits ``n_ctx // n_seq_max`` cells, moving the cache to the unified layout while one
    needs more and back when all fit again (models with one full-attention KV cache, alone
    or in a hybrid; sliding-window and recurrent-only models stay unified). So a prompt
    that fits ``n_ctx_seq`` never fails because of the layout, and many short sequences
    never attend over each other's cells. ``max_step_ms`` is the latency
    target of one step while sequences are decoding: long prompts are prefilled in chunks
    sized (from measured step costs) to keep every stream's tokens coming about that
    often; ``None`` uses fixed ``n_batch`` chunks. ``n_batch`` is the per-step token budget:
    one ``llama_decode`` never carries more, so a long prompt is prefilled in chunks of at
    most ``n_batch`` tokens while other sequences keep streaming. ``use_extra_bufts=None``
    picks automatically: it is turned off on CPUs that advertise AMX, where ggml's AMX
    matmul crashes in some VMs. ``prefix_cache`` shares computed prompt prefixes between
    sequences and keeps finished ones for reuse (LRU); turn it off to always recompute.
    ``chat_template`` overrides the Jinja chat template of the GGUF metadata.
    ``rpc_servers`` (``"host:port,host:port"``) adds remote llama.cpp ``rpc-server`` hosts as
    devices the model's layers are split over (needs a ``-DGGML_RPC=ON`` build; see
    docs/scale-out.md). ``speculative`` (a :class:`~llamax.PromptLookup`) turns speculative
    decoding on for every request that does not say otherwise (see docs/speculative.md);
    ``None`` (default) leaves it to each request's ``SamplingParams.speculative``.
    ``reproducible`` makes every reply (tokens and logprobs) bit-identical to the same
    request run alone on a fresh context with the same options, whatever else runs (same
    machine, same build; docs/reproducible.md): the KV cache stays in streams, the thread
    count is fixed, prompt chunks start at multiples of one micro-batch (``n_ubatch``, at
    most 256) and each is decoded alone, a prefix is reused only up to a chunk boundary it
    was computed to as a prompt, speculative decoding is off, and so is flash attention unless
    the KV types take its row-by-row kernel (a quantized V: see
    :func:`flash_attention_is_row_exact`). It refuses ``kv_layout="unified"``,
    ``adapt_threads=True``, ``flash_attn=True`` over an F16 K and V, ``speculative`` and an
    ``n_threads_batch`` other than ``n_threads``; ``kv_layout="auto"`` becomes
    ``"streams"``. ``kv_type`` is the KV cache's number type (``"f16"``; ``"q8_0"`` takes
    about half its memory, ``"q4_0"`` about a quarter; docs/kv-cache.md#quantized-kv);
    ``kv_type_k`` and ``kv_type_v`` set K's or V's alone. llama.cpp computes attention over a
    quantized V only with flash attention, so a quantized V refuses ``flash_attn=False``; a
    quantized K alone needs nothing.
    """

    model_path: str
    n_ctx: int = field(
        default=4096,
        metadata=spec(
            doc="KV cells: what the KV cache costs in memory (llama.cpp pads it to a multiple "
            "of 256; less than 256 gets 256, with a warning)",
            flag=True,
        ),
    )
    n_seq_max: int = field(
        default=16,
        metadata=spec(doc="sequences computed at once; more requests wait in the queue", flag=True),
    )
    n_ctx_seq: int | None = field(
        default=None,
        metadata=spec(
            default_doc="`n_ctx`",
            doc="most tokens one sequence (prompt and reply) may hold; with `n_ctx_seq * "
            "n_seq_max <= n_ctx` each sequence gets its own KV stream (docs/kv-cache.md)",
            flag=True,
        ),
    )
    kv_layout: KVLayout = field(
        default="auto",
        metadata=spec(
            doc="`unified`, `streams` or `auto` (streams while every sequence fits "
            "`n_ctx // n_seq_max` cells, unified while one needs more; docs/kv-cache.md)",
            flag=True,
        ),
    )
    max_step_ms: float | None = field(
        default=250.0,
        metadata=spec(
            doc="latency target of a step while sequences decode (long prompts are chunked to keep "
            "it); `None` (flag: `0`): fixed `n_batch` chunks",
            flag=True,
            from_flag=zero_is_none,
        ),
    )
    n_batch: int = field(
        default=512,
        metadata=spec(doc="most tokens one decode step carries (at least `n_seq_max`)", flag=True),
    )
    n_ubatch: int | None = field(
        default=None,
        metadata=spec(default_doc="`n_batch`", doc="llama.cpp's physical micro-batch", flag=True),
    )
    n_threads: int | None = field(
        default=None,
        metadata=spec(
            default_doc="all cores",
            doc="CPU threads; a number is used as given (docs/performance.md)",
            flag=True,
            aliases=("--threads",),
        ),
    )
    adapt_threads: bool | None = field(
        default=None,
        metadata=spec(
            default_doc="on (`$LLAMAX_ADAPT_THREADS=0`: off)",
            doc=(
                "with `n_threads` left to llamax, fewer threads while other processes "
                "hold cores (docs/performance.md)"
            ),
            flag=True,
        ),
    )
    n_threads_batch: int | None = field(
        default=None,
        metadata=spec(default_doc="`n_threads`", doc="CPU threads for prompt batches", flag=True),
    )
    reproducible: bool | None = field(
        default=None,
        metadata=spec(
            default_doc="off (`$LLAMAX_REPRODUCIBLE=1`: on)",
            doc="every reply's tokens and logprobs bit-identical to the same request run alone "
            "on a fresh context with the same options, whatever else runs: streams pinned, "
            "fixed threads, attention row by row, prompt chunks at fixed positions (none "
            "where a start-up probe finds the model batch-invariant), no speculation "
            "(but there) (docs/reproducible.md)",
            flag=True,
        ),
    )
    n_gpu_layers: int = field(
        default=-1, metadata=spec(doc="layers offloaded to the GPU (`-1`: all)", flag=True)
    )
    use_mmap: bool = field(
        default=True, metadata=spec(doc="map the model file instead of reading it", flag=True)
    )
    use_extra_bufts: bool | None = field(
        default=None,
        metadata=spec(
            default_doc="auto",
            doc="ggml's extra (repacked) weight buffers; auto: off on CPUs with AMX",
            flag=True,
        ),
    )
    flash_attn: bool | None = field(
        default=None,
        metadata=spec(
            default_doc="auto", doc="flash attention (auto: llama.cpp decides)", flag=True
        ),
    )
    backend_sampling: bool = field(
        default=False,
        metadata=spec(
            doc="sample plain requests' rows inside llama.cpp's graph, on the device that "
            "computes the logits (llama.cpp's backend sampling; docs/logits.md#backend-sampling)",
            flag=True,
        ),
    )
    kv_type: KVType = field(
        default="f16",
        metadata=spec(
            doc="the KV cache's number type, K and V: `f16`, `q8_0` (half the memory), "
            "`q4_0` ... (a quantized V needs flash attention; docs/kv-cache.md#quantized-kv)",
            flag=True,
        ),
    )
    kv_type_k: KVType | None = field(
        default=None,
        metadata=spec(
            default_doc="`kv_type`",
            doc="the K cache's type, where it differs from `kv_type` (llama-server's `-ctk`)",
            flag=True,
            aliases=("--cache-type-k", "-ctk"),
        ),
    )
    kv_type_v: KVType | None = field(
        default=None,
        metadata=spec(
            default_doc="`kv_type`",
            doc="the V cache's type, where it differs from `kv_type`; quantized, it needs "
            "flash attention (llama-server's `-ctv`)",
            flag=True,
            aliases=("--cache-type-v", "-ctv"),
        ),
    )
    calibrate: bool | None = field(
        default=None,
        metadata=spec(
            default_doc="auto",
            doc="time a few steps at load (a fraction of a second, cached by model and machine) "
            "so step budgets and draft pricing start from this machine's costs (auto: for "
            "llama.cpp models, not for a `backend=` passed in; docs/throughput.md)",
            flag=True,
        ),
    )
    prefix_cache: bool = field(
        default=True,
        metadata=spec(
            doc="share computed prompt prefixes between sequences and keep finished ones (LRU)",
            flag=True,
        ),
    )
    chat_template: str | None = field(
        default=None,
        metadata=spec(
            default_doc="the GGUF's",
            doc="a Jinja chat template instead of the GGUF's (flag: a file holding it)",
            flag=True,
            metavar="FILE",
            from_flag=read_text,
        ),
    )
    lora: Mapping[str, str] | None = field(
        default=None,
        metadata=spec(
            doc="LoRA adapters to load, name -> GGUF path; requests pick them by name "
            "(`SamplingParams.lora`)",
        ),
    )
    prefix_ram_bytes: int | None = field(
        default=None,
        metadata=spec(
            default_doc="a quarter of the memory available at load, at most 8 GiB",
            doc="the host-RAM tier's budget for prefixes evicted from the KV cache, in bytes "
            "(flag: also `512M`, `2G`, `1.5GiB`); `0`: no tier (docs/prefix_ram.md)",
            flag=True,
            flag_type=byte_size,
            metavar="BYTES",
        ),
    )
    prefix_disk_dir: str | os.PathLike[str] | None = field(
        default=None,
        metadata=spec(
            default_doc="no disk tier",
            doc="a directory for a disk tier below the host-RAM tier: prefixes that tier drops "
            "are kept there in files, across restarts (docs/prefix_ram.md#disk-tier)",
            flag=True,
            metavar="DIR",
        ),
    )
    prefix_disk_bytes: int | None = field(
        default=None,
        metadata=spec(
            default_doc="8 GiB, at most half the free space of its filesystem at load",
            doc="the disk tier's budget, in bytes (flag: also `512M`, `2G`, `1.5GiB`); `0`: "
            "no disk tier",
            flag=True,
            flag_type=byte_size,
            metavar="BYTES",
        ),
    )
    prefix_ram_share: float = field(
        default=1.0,
        metadata=spec(
            doc="the share, in (0, 1], of the host-RAM tier's default budget this context "
            "takes when `prefix_ram_bytes` is not given: contexts loaded together divide one "
            "budget rather than each taking it whole (a model pool sets it; docs/models.md)",
        ),
    )
    prefix_disk_share: float = field(
        default=1.0,
        metadata=spec(
            doc="the share, in (0, 1], of the disk tier's default budget this context takes "
            "when `prefix_disk_bytes` is not given (a model pool sets it; docs/models.md)",
        ),
    )
    mmproj: str | os.PathLike[str] | None = field(
        default=None,
        metadata=spec(
            default_doc="none: text only",
            doc="a multimodal projector GGUF (`mmproj`) for the model: prompts may hold images "
            "(docs/images.md)",
            flag=True,
            metavar="FILE",
        ),
    )
    rpc_servers: str | None = field(
        default=None,
        metadata=spec(
            doc="`host:port,...`: llama.cpp `rpc-server` hosts to split the layers over "
            "(docs/scale-out.md)",
            flag=True,
        ),
    )
    speculative: Speculative | None = field(
        default=None,
        metadata=spec(
            doc="speculative decoding for every request that does not say otherwise: a "
            "`PromptLookup` (flag: prompt lookup drafting up to `MAX_DRAFT` tokens, `0`: off)",
            flag=True,
            flag_type=int,
            metavar="MAX_DRAFT",
            flag_default_doc="`0` (off)",
            from_flag=_prompt_lookup,
        ),
    )
    verbose: bool = field(default=False, metadata=spec(doc="llama.cpp's log on stderr", flag=True))

    @classmethod
    def from_options(cls, model_path: str, options: Mapping[str, Any]) -> ContextConfig:
        """Build a config from keyword options, refusing unknown ones.

        Raises:
            TypeError: an unknown option, naming the closest valid one.
            InvalidParameterError: a value is out of range.
        """
        known = [f.name for f in dataclasses.fields(cls) if f.name != "model_path"]
        for name in options:
            if name not in known:
                close = difflib.get_close_matches(name, known, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise TypeError(f"Context() got an unexpected keyword argument {name!r}{hint}")
        return cls(model_path=model_path, **options)

    @property
    def resolved_kv_layout(self) -> Literal["unified", "streams"]:
        """The layout ``"auto"`` starts from with these sizes: ``"unified"`` here means a
        backend that can move between layouts starts with streams and adapts."""
        if self.kv_layout != "auto":
            return self.kv_layout
        fits = self.n_ctx_seq is not None and self.n_ctx_seq * self.n_seq_max <= self.n_ctx
        return "streams" if fits and self.n_seq_max > 1 else "unified"

    @property
    def kv_types(self) -> tuple[KVType, KVType]:
        """The K and V caches' types: ``kv_type_k`` and ``kv_type_v``, else ``kv_type``."""
        return (self.kv_type_k or self.kv_type, self.kv_type_v or self.kv_type)

    @property
    def resolved_n_threads(self) -> int:
        """The threads a step starts with: ``n_threads``, or every core the process may use."""
        return self.n_threads if self.n_threads is not None else _default_threads()

    @property
    def adapts_threads(self) -> bool:
        """Whether the engine may lower the threads while other processes hold cores
        (``adapt_threads``, else :func:`adapt_threads_default`; and only when
        ``n_threads`` was left to it; docs/performance.md).

        Design note: on by default since the engine asks the OS whether the machine is
        crowded before it judges a step (issue 37): on a quiet machine the thread count
        never changes, so outputs stay those of one count (a thread count changes
        llama.cpp's sums in some shapes: a decode over 300 cells parted by 0.53 in a
        logit between 1 and 2 threads)."""
        if self.n_threads is not None or self.is_reproducible:
            return False
        return self.adapt_threads if self.adapt_threads is not None else adapt_threads_default()

    @property
    def is_reproducible(self) -> bool:
        """Whether replies must not depend on what else runs (``reproducible``, else
        :func:`reproducible_default`; docs/reproducible.md)."""
        return self.reproducible if self.reproducible is not None else reproducible_default()

    @property
    def reproducible_chunk(self) -> int | None:
        """The prompt chunk grid of the reproducible mode: one micro-batch (``n_ubatch``,
        else ``n_batch``), at most 256 tokens (llama.cpp widens a micro-batch's attention
        view in steps of 256 cells, so a finer grid costs a prompt nothing and lets a
        prefix be reused at more places); None when off."""
        if not self.is_reproducible:
            return None
        return min(self.n_ubatch or self.n_batch, 256)

    def engine_config(self, *, owns_backend: bool = True) -> EngineConfig:
        """What the engine needs of these options (:class:`EngineConfig`); ``calibrate``
        left to auto means "for a backend the context loads itself" (``owns_backend``)."""
        return EngineConfig(
            prefix_cache=self.prefix_cache,
            max_step_ms=self.max_step_ms,
            speculative=self.speculative,
            calibrate=self.calibrate if self.calibrate is not None else owns_backend,
            adapt_threads=self.adapts_threads,
            reproducible_chunk=self.reproducible_chunk,
            reproducible_row_attention=self.is_reproducible
            and self.flash_attn is True
            and flash_attention_is_row_exact(*self.kv_types),
            prefix_ram_bytes=self.prefix_ram_bytes,
            prefix_ram_share=self.prefix_ram_share,
            prefix_disk_dir=None
            if self.prefix_disk_dir is None
            else os.fspath(self.prefix_disk_dir),
            prefix_disk_bytes=self.prefix_disk_bytes,
            prefix_disk_share=self.prefix_disk_share,
        )

    def __post_init__(self) -> None:
        refuse_huge_ints(self, [f.name for f in dataclasses.fields(self)])  # any field
        self._check_types()
        for name in _PATHS:  # a pathlib.Path is as good as its text
            if isinstance(getattr(self, name), os.PathLike):
                object.__setattr__(self, name, os.fspath(getattr(self, name)))
        require(self.n_ctx >= 16, f"n_ctx must be >= 16, got {self.n_ctx}", "n_ctx")
        require(
            1 <= self.n_seq_max <= 256,
            f"n_seq_max must be in [1, 256], got {self.n_seq_max}",
            "n_seq_max",
        )
        require(self.n_batch >= 1, f"n_batch must be >= 1, got {self.n_batch}", "n_batch")
        # llama.cpp reserves one output row per sequence in a batch of min(n_ctx, n_batch)
        # rows, and aborts the process (GGML_ASSERT) when they do not fit
        require(
            self.n_batch >= self.n_seq_max,
            f"n_batch ({self.n_batch}) must be >= n_seq_max ({self.n_seq_max}): "
            "llama.cpp needs room for one token of every sequence in a batch",
            "n_batch",
        )
        require(
            self.n_ctx >= self.n_seq_max,
            f"n_ctx ({self.n_ctx}) must be >= n_seq_max ({self.n_seq_max}): "
            "llama.cpp needs room for one token of every sequence in a batch",
            "n_ctx",
        )
        require(
            self.kv_layout in ("auto", "unified", "streams"),
            f"kv_layout must be 'auto', 'unified' or 'streams', got {self.kv_layout!r}",
            "kv_layout",
        )
        self._check_kv_types()
        require(
            self.n_ctx_seq is None or 16 <= self.n_ctx_seq <= self.n_ctx,
            f"n_ctx_seq must be in [16, n_ctx={self.n_ctx}], got {self.n_ctx_seq}",
            "n_ctx_seq",
        )
        require(
            self.kv_layout != "streams" or (self.n_ctx_seq or 16) * self.n_seq_max <= self.n_ctx,
            f"kv_layout='streams' gives each of the n_seq_max={self.n_seq_max} sequences "
            f"n_ctx // n_seq_max = {self.n_ctx // self.n_seq_max} cells, fewer than "
            f"n_ctx_seq={self.n_ctx_seq}; raise n_ctx or lower n_ctx_seq",
            "kv_layout",
        )
        require(
            self.max_step_ms is None or self.max_step_ms > 0,
            f"max_step_ms must be > 0 or None, got {self.max_step_ms}",
            "max_step_ms",
        )
        require(
            self.n_ubatch is None or 1 <= self.n_ubatch <= self.n_batch,
            f"n_ubatch must be in [1, n_batch], got {self.n_ubatch}",
            "n_ubatch",
        )
        require(
            self.n_threads is None or self.n_threads >= 1,
            f"n_threads must be >= 1, got {self.n_threads}",
            "n_threads",
        )
        require(
            self.rpc_servers is None or is_endpoint_list(self.rpc_servers),
            f"rpc_servers must be 'host:port[,host:port...]', got {self.rpc_servers!r}",
            "rpc_servers",
        )
        require(
            self.n_threads_batch is None or self.n_threads_batch >= 1,
            f"n_threads_batch must be >= 1, got {self.n_threads_batch}",
            "n_threads_batch",
        )
        if self.is_reproducible:
            self._check_reproducible()

    def _kv_v_field(self) -> str:
        """The field that set the V cache's type: ``kv_type_v``, else ``kv_type``."""
        return "kv_type" if self.kv_type_v is None else "kv_type_v"

    def _check_kv_types(self) -> None:
        """Refuse a KV type llama.cpp does not take, and a quantized V without flash
        attention (llama.cpp would refuse the context only once the model is loaded)."""
        for name in ("kv_type", "kv_type_k", "kv_type_v"):
            value = getattr(self, name)
            require(
                (value is None and name != "kv_type") or value in KV_TYPES,
                f"{name} must be one of {', '.join(repr(t) for t in KV_TYPES)}"
                f"{'' if name == 'kv_type' else ' or None'}, got {value!r}",
                name,
            )
        v_type, v_field = self.kv_types[1], self._kv_v_field()
        require(
            not is_quantized(v_type) or self.flash_attn is not False,
            f"{v_field}={v_type!r} quantizes the V cache, which llama.cpp computes only with "
            "flash attention: flash_attn=False contradicts it (leave flash_attn to auto or "
            f"turn it on, or quantize K alone: kv_type_k={v_type!r} with an f16 V)",
            v_field,
        )

    def _check_reproducible(self) -> None:
        """Refuse what contradicts ``reproducible``; ``kv_layout="auto"`` becomes streams."""
        why = "reproducible=True needs "
        require(
            self.kv_layout != "unified",
            why + "the streams layout (a unified cache's attention sums depend on the other "
            "sequences' cells): kv_layout='unified' contradicts it",
            "kv_layout",
        )
        require(
            self.adapt_threads is not True,
            why + "a fixed thread count (llama.cpp's sums depend on it): adapt_threads=True "
            "contradicts it",
            "adapt_threads",
        )
        type_k, type_v = self.kv_types
        row_exact = flash_attention_is_row_exact(type_k, type_v)
        require(
            self.speculative is None
            or (row_exact and (self.flash_attn is True or is_quantized(type_v))),
            why + "no speculative decoding over attention that is not computed row by row "
            "(a verified draft's cells are computed in a batch of rows, not one by one): "
            "speculative contradicts it (with flash attention row by row, e.g. "
            "kv_type_v='q8_0', drafts are verified where a start-up probe finds the model "
            "batch-invariant)",
            "speculative",
        )
        require(
            self.flash_attn is not True or row_exact,
            why + "attention computed row by row: over an f16 K and V, ggml's CPU flash "
            "attention tiles a prompt chunk's rows and shares a lone row's cells among the "
            "threads, so a row's sums depend on the batch: flash_attn=True contradicts it "
            "(leave flash_attn to auto, or give a V of another type, e.g. kv_type_v='q8_0', "
            "whose flash attention is computed row by row)",
            "flash_attn",
        )
        require(
            self.n_threads_batch is None or self.n_threads_batch == self.resolved_n_threads,
            why + "one thread count (a batch of decode rows runs on n_threads_batch, a lone "
            f"row on n_threads): n_threads_batch={self.n_threads_batch} differs from "
            f"n_threads={self.n_threads}",
            "n_threads_batch",
        )
        # flash attention only where the types need it (a quantized V) or the caller asks:
        # its row-by-row kernel is exact but no faster here (docs/reproducible.md)
        flash = row_exact and (self.flash_attn is True or is_quantized(type_v))
        object.__setattr__(self, "flash_attn", flash)
        if self.kv_layout == "auto":  # streams, pinned: never a move to unified
            object.__setattr__(self, "kv_layout", "streams")
            require(
                (self.n_ctx_seq or 16) * self.n_seq_max <= self.n_ctx,
                why + f"the streams layout, where each of the n_seq_max={self.n_seq_max} "
                f"sequences gets n_ctx // n_seq_max = {self.n_ctx // self.n_seq_max} cells, "
                f"fewer than n_ctx_seq={self.n_ctx_seq}; raise n_ctx or lower n_ctx_seq",
                "n_ctx_seq",
            )

    def _check_types(self) -> None:
        for check, names in _TYPE_CHECKS:
            for name in names:
                check(name, getattr(self, name))


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    """The engine's options, one object handed down ``Context -> Engine -> Scheduler``
    (built by :meth:`ContextConfig.engine_config`, checked there; meanings as in
    :class:`ContextConfig`). The defaults are an engine with every feature on and no
    prefix tier, as tests build one."""

    prefix_cache: bool = True
    max_step_ms: float | None = None
    speculative: Speculative | None = None
    calibrate: bool = False
    """Time a few steps at start (``ContextConfig.calibrate``, resolved)."""
    adapt_threads: bool = False
    """Lower the threads under contention (``ContextConfig.adapts_threads``)."""
    reproducible_chunk: int | None = None
    """The reproducible mode's prompt chunk grid (``ContextConfig.reproducible_chunk``);
    None: off."""
    reproducible_row_attention: bool = False
    """In the reproducible mode: attention is ggml's row-by-row flash attention (a V of a
    type whose flash attention no kernel tiles or splits: :func:`flash_attention_is_row_exact`),
    so a row's attention sums depend on nothing beside it; the engine then probes whether
    the rest of the model is batch-invariant too, and drops the chunk grid where it is
    (docs/reproducible.md)."""
    prefix_ram_bytes: int | None = 0
    """The RAM tier's budget; None: this context's share of the machine's default."""
    prefix_ram_share: float = 1.0
    prefix_disk_dir: str | None = None
    prefix_disk_bytes: int | None = None
    """The disk tier's budget (with a directory); None: its share of the default."""
    prefix_disk_share: float = 1.0


class ContextOptions(TypedDict, total=False):
    """Keyword options of :class:`llamax.Context`; see :class:`ContextConfig` for their meaning."""

    n_ctx: int
    n_seq_max: int
    n_ctx_seq: int | None
    kv_layout: KVLayout
    max_step_ms: float | None
    n_batch: int
    n_ubatch: int | None
    n_threads: int | None
    n_threads_batch: int | None
    adapt_threads: bool | None
    reproducible: bool | None
    n_gpu_layers: int
    use_mmap: bool
    use_extra_bufts: bool | None
    flash_attn: bool | None
    backend_sampling: bool
    kv_type: KVType
    kv_type_k: KVType | None
    kv_type_v: KVType | None
    calibrate: bool | None
    prefix_cache: bool
    chat_template: str | None
    mmproj: str | os.PathLike[str] | None
    rpc_servers: str | None
    speculative: Speculative | None
    verbose: bool
    lora: Mapping[str, str] | None
    prefix_ram_bytes: int | None
    prefix_disk_dir: str | os.PathLike[str] | None
    prefix_disk_bytes: int | None
    prefix_ram_share: float
    prefix_disk_share: float


OPTION_LISTS: dict[str, type] = {"ContextConfig": ContextConfig, "SamplingParams": SamplingParams}
"""The option lists by the names the docs' generated tables use (``<!-- options: … -->``)."""
