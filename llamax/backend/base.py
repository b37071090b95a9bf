"""The seam between the pure-Python engine and llama.cpp.

Only modules in :mod:`llamax.backend` touch ctypes. The scheduler drives a
:class:`Backend`; :class:`llamax.testing.FakeBackend` implements the same protocol in
pure Python so the scheduler, cache bookkeeping and detokenizer can be tested without a
model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Protocol, TypeAlias, runtime_checkable

import numpy as np
import numpy.typing as npt

from ..adapters import AdapterSet
from ..facts import ModelFacts
from ..params import SamplingParams
from .vision.chunks import MediaPrompt, RgbImage

__all__ = [
    "Backend",
    "BatchDecoder",
    "BatchItem",
    "Calibratable",
    "Clocked",
    "ComputeThreads",
    "DecodeStatus",
    "Drawn",
    "ImageHost",
    "Inspectable",
    "KVMemory",
    "LoadedModel",
    "LoraHost",
    "MachineLoad",
    "Sampler",
    "SamplerFactory",
    "SharedPrefix",
    "Threaded",
]


class DecodeStatus(IntEnum):
    """``llama_decode`` return codes that the engine treats specially. Others are fatal."""

    OK = 0
    NO_SLOT = 1
    """No free KV slot for the batch; memory was restored. Retry smaller or later."""
    ABORTED = 2
    """An abort callback stopped the decode. llamax installs none, so it is treated as fatal."""


@dataclass(frozen=True, slots=True)
class SharedPrefix:
    """In a move to the unified layout: ``seq_id`` holds the first ``num_tokens`` tokens of
    ``source`` and nothing else, so it shares ``source``'s cells instead of a copy."""

    seq_id: int
    source: int
    num_tokens: int


@dataclass(frozen=True, slots=True)
class BatchItem:
    """One sequence's slice of a step: ``token_ids`` at positions ``start_pos...``.

    ``rows`` are the batch indices (within the whole decode) of this item's tokens whose
    outputs are wanted: logits to sample from, or pooled embeddings. Usually empty (a
    prompt chunk) or the item's last token (a decode token, or the final chunk of a
    prompt); speculative verification asks for several.
    """

    seq_id: int
    token_ids: Sequence[int]
    start_pos: int
    rows: tuple[int, ...] = ()
    embeddings: npt.NDArray[np.float32] | None = field(default=None, compare=False, repr=False)
    """An image's rows, ``(len(token_ids), n_embd)``, decoded instead of ``token_ids`` (its
    placeholder ids): such an item goes to :meth:`ImageHost.decode_embeddings`, never to
    ``decode``, and wants no output."""
    non_causal: bool = False
    """With ``embeddings``: decoded with non-causal attention (the whole image at once)."""
    sampler: Any = field(default=None, compare=False, repr=False)
    """With one row, for a backend that samples in the graph (:class:`GraphSampling`): the
    sampler that will sample the row, alone and from nothing but the row (no forks, logits
    processors, logprobs or grammar), which the backend may therefore run in the decode."""

    @property
    def row(self) -> int | None:
        """The last wanted row, or None when the item wants no output."""
        return self.rows[-1] if self.rows else None


Sampler: TypeAlias = Any
"""An opaque per-sequence sampler owned by a backend (each backend picks its own type)."""


class LoadedModel(Protocol):
    """The loaded model: vocabulary, metadata and grammar checks. Safe from any thread."""

    @property
    def facts(self) -> ModelFacts:
        """The model's and the context's facts, computed once at load (they answer after
        :meth:`~Backend.close` too)."""
        ...

    def token_text(self, token: int) -> str:
        """A token's text with special tokens rendered (``<|im_end|>``)."""
        ...

    def metadata(self, key: str) -> str | None:
        """A GGUF metadata value, or None."""
        ...

    def tokenize(
        self, text: str, *, add_special: bool = True, parse_special: bool = True
    ) -> list[int]:
        """Convert text to token ids."""
        ...

    def token_to_piece(self, token: int) -> bytes:
        """The bytes a token stands for (special tokens render as nothing)."""
        ...

    def is_eog(self, token: int) -> bool:
        """Whether a token ends generation (EOS, EOT, <|im_end|> ...)."""
        ...

    def check_grammar(self, grammar: str) -> str | None:
        """Parse a GBNF grammar; return why it is invalid, or None. Safe from any thread."""
        ...

    @property
    def model_identity(self) -> dict[str, object]:
        """What identifies the model, for checking saved sessions."""
        ...


class BatchDecoder(Protocol):
    """Multi-sequence forward passes and their output rows. Engine thread only."""

    @property
    def kv_cells(self) -> int:
        """KV cells allocated in the current layout (what the cache costs in memory)."""
        ...

    @property
    def n_batch(self) -> int:
        """Most tokens one ``decode`` call may carry."""
        ...

    @property
    def cpu_only(self) -> bool:
        """Whether every op runs on ggml's CPU backend: a build with no GPU or RPC device
        (one with a device may send a large batch's products to it even where no layer is
        offloaded)."""
        ...

    @property
    def cpu_attention(self) -> bool:
        """Whether attention runs on ggml's CPU backend, whose flash attention computes
        micro-batches under 64 query rows row by row (the scheduler splits decode steps
        for it; on a GPU a split would only read the weights twice)."""
        ...

    @property
    def attention_tiles(self) -> tuple[int, int] | None:
        """``(query heads, threads)`` when ggml's CPU flash attention computes micro-batches
        of 64 rows or more in tiles, whose padding the step cost model counts
        (:func:`llamax.engine.timing.step_budget.tile_waste_table`); ``None`` otherwise."""
        ...

    def decode(self, items: Sequence[BatchItem]) -> int:
        """Run one multi-sequence forward pass; return the ``llama_decode`` status code."""
        ...

    def logits(self, row: int) -> npt.NDArray[np.float32]:
        """A writable, zero-copy ``(n_vocab,)`` view of batch ``row``'s logits (last decode)."""
        ...

    def batch_logits(self, num_rows: int) -> npt.NDArray[np.float32]:
        """A writable, zero-copy ``(num_rows, n_vocab)`` view of the last decode's outputs."""
        ...


@dataclass(frozen=True, slots=True)
class Drawn:
    """A token a sampler chain drew, and the distribution it drew it from: the candidates
    every sampler of the chain kept, with their probabilities after the last one (for
    greedy, the token alone with probability 1)."""

    token: int
    prob: float
    """The token's probability in that distribution."""
    top_ids: tuple[int, ...]
    """The likeliest candidates, most likely first; only those with a probability above 0."""
    top_probs: tuple[float, ...]


class SamplerFactory(Protocol):
    """Per-sequence native sampler chains. Engine thread only."""

    def new_sampler(
        self,
        params: SamplingParams,
        seed: int,
        history: Sequence[int],
        *,
        grammar: str | None = None,
    ) -> Sampler:
        """Build a sampler chain for one sequence; ``history`` primes its penalties and
        ``grammar`` (GBNF) constrains it."""
        ...

    def sample(self, sampler: Sampler, row: int) -> int:
        """Sample a token from the logits of batch ``row`` of the last decode."""
        ...

    def sample_rows(self, samplers: Sequence[Sampler], rows: Sequence[int]) -> list[int]:
        """:meth:`sample` for each sampler with its batch row (a row may repeat: forks), in
        one call, so a backend may sample many rows together; each sampler moves on
        exactly as with :meth:`sample`."""
        ...

    def sample_drawn(self, sampler: Sampler, row: int, limit: int) -> Drawn:
        """:meth:`sample`, also reporting the distribution the chain drew from (at most
        ``limit`` of its likeliest candidates); the sampler moves on exactly as with
        :meth:`sample`."""
        ...

    def free_sampler(self, sampler: Sampler) -> None:
        """Release a sampler built by :meth:`new_sampler`."""
        ...


@runtime_checkable
class GraphSampling(Protocol):
    """A backend that can sample rows inside the decode (llama.cpp's backend sampling)."""

    @property
    def samples_in_graph(self) -> bool:
        """Whether a :class:`BatchItem`'s ``sampler`` may be run in the decode: its row's
        token is then what :meth:`SamplerFactory.sample_rows` returns for it."""

    @property
    def num_attached(self) -> int:
        """Samplers attached to sequence ids now (each a live sampler: for leak checks)."""

    def new_sampler(
        self,
        params: SamplingParams,
        seed: int,
        history: Sequence[int],
        *,
        grammar: str | None = None,
        graph: bool = False,
    ) -> Sampler:
        """:meth:`SamplerFactory.new_sampler`; with ``graph``, a sampler the decode may run
        when it is named by a :class:`BatchItem` (the engine asks only for samplers that
        sample their rows alone, from nothing but the rows)."""


class KVMemory(Protocol):
    """llama.cpp's KV memory, addressed by sequence id. Only :mod:`llamax.engine.kv.kvcache` calls
    these, on the engine thread."""

    @property
    def is_unified(self) -> bool:
        """True for one buffer shared by all sequences (``seq_cp`` tags cells, copying
        nothing); False for one stream per sequence (only whole-stream copies)."""
        ...

    @property
    def kv_bytes_per_cell(self) -> int:
        """Approximate memory of one KV cell."""
        ...

    @property
    def n_ctx_stream(self) -> int:
        """Cells one sequence may hold in the current layout: ``n_ctx`` when unified, its
        stream's ``n_ctx // n_seq_max`` otherwise."""
        ...

    @property
    def can_relayout(self) -> bool:
        """Whether :meth:`relayout` may be called (``kv_layout="auto"``)."""
        ...

    def relayout(self, unified: bool, shared: Sequence[SharedPrefix] = ()) -> None:
        """Move every sequence's cells into the other layout; each must fit the new
        layout's :attr:`n_ctx_stream`. Afterwards no two sequences share a cell, except
        that, moving to the unified layout, each of ``shared`` is tagged on its source's
        first cells (a ``seq_cp`` once the source has moved) instead of getting copies:
        a chat's earlier turns, kept for their prefix, then take no cells of their own,
        and a decode does not attend over duplicates of them."""
        ...

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        """Remove a sequence's cells in ``[p0, p1)`` (negative: open ended)."""
        ...

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """Tag the cells of ``src`` in ``[p0, p1)`` with ``dst`` too (no new cells). Between
        streams: copy the whole stream, the buffer only at the next decode (or
        :meth:`run_queued_copies`), as llama.cpp does."""
        ...

    def run_queued_copies(self) -> None:
        """Run the cross-stream buffer copies queued by :meth:`seq_cp` now, as the next
        decode would (see :mod:`llamax.engine.kv.stream_copies`)."""
        ...

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        """Shift the positions of a sequence's cells in ``[p0, p1)`` by ``delta``."""
        ...

    @property
    def can_shift(self) -> bool:
        """Whether the memory supports :meth:`seq_add` (RoPE shifts)."""
        ...

    def seq_pos_min(self, seq_id: int) -> int:
        """Smallest position a sequence holds in KV, or -1 when it holds none."""
        ...

    def seq_pos_max(self, seq_id: int) -> int:
        """Largest position a sequence holds in KV, or -1 when it holds none."""
        ...

    @property
    def can_share_prefix(self) -> bool:
        """Whether partial ``seq_rm``/``seq_cp`` work (not for recurrent or hybrid memory,
        which the engine cuts at checkpoints instead: :meth:`state_seq_set` with
        ``partial``)."""
        ...

    @property
    def can_checkpoint(self) -> bool:
        """Whether a memory that cannot be cut (:attr:`can_share_prefix` False) reads and
        writes checkpoints (:meth:`state_seq_get` with ``partial``), so the engine can cut
        a sequence where it took one."""
        ...

    @property
    def sliding_window(self) -> int:
        """Positions a sliding-window layer attends back (0: the model has none). Such a
        cache may no longer hold a sequence's first cells (a saved state never does), yet
        still hold what a continuation needs: the last ``sliding_window`` positions."""
        ...

    def state_seq_get(self, seq_id: int, *, partial: bool = False) -> bytes:
        """Serialise one sequence's KV state; with ``partial``, only the part that cannot
        be cut at a position (a recurrent state, a sliding window's cells): a checkpoint."""
        ...

    def state_seq_set(self, seq_id: int, data: bytes, *, partial: bool = False) -> bool:
        """Restore a serialised state into ``seq_id`` (empty); False if refused. With
        ``partial``, a checkpoint replaces the sequence's recurrent state (or window) and
        leaves its other cells as they are."""
        ...


class Backend(LoadedModel, BatchDecoder, SamplerFactory, KVMemory, Protocol):
    """Everything the engine needs from an inference backend: the four roles above, plus
    :meth:`close`. :class:`llamax.testing.FakeBackend` implements it in pure Python."""

    def close(self) -> None:
        """Free native resources. Idempotent."""
        ...


@runtime_checkable
class Clocked(Protocol):
    """Optional: a backend that keeps its own time, such as
    :class:`llamax.testing.FakeBackend` with simulated step costs. The engine times its
    steps with :meth:`clock` instead of ``time.perf_counter`` (what the step-cost models
    learn from), so a test can give the engine any machine's costs, deterministically."""

    def clock(self) -> float:
        """Seconds on the backend's clock (only differences are read)."""
        ...


@runtime_checkable
class Threaded(Protocol):
    """Optional: a CPU backend whose compute threads may change between steps (the engine
    lowers them while another process holds a core; :mod:`llamax.engine.timing.contention`)."""

    @property
    def n_threads(self) -> int:
        """The threads a step uses now."""
        ...

    def set_n_threads(self, n_threads: int) -> None:
        """Use ``n_threads`` threads from the next step on (decode and prompt batches)."""
        ...


@runtime_checkable
class ComputeThreads(Protocol):
    """Optional: a backend whose compute keeps worker threads per calling thread (llama.cpp's
    CPU backend under GNU OpenMP: :mod:`llamax.backend.openmp`). Pooled workers of a thread
    that no longer computes make every other thread's compute slower, so the engine gives
    them back when its loop goes idle, after calibrating on the constructing thread, and
    after compute on a caller's thread (an image, a manual step that left no work)."""

    def release_compute_threads(self) -> None:
        """Free the worker threads the calling thread's compute keeps (the next compute on
        it makes them again)."""
        ...


@runtime_checkable
class MachineLoad(Protocol):
    """Optional: a backend that simulates the machine it runs on, such as
    :class:`llamax.testing.FakeBackend` with ``runnable_tasks=``. The engine asks it, instead
    of the operating system, how many tasks are runnable right now, to tell a crowded
    machine from a quiet one (:mod:`llamax.engine.timing.contention`)."""

    def runnable_tasks(self) -> int | None:
        """Tasks runnable on the machine now, this backend's own threads included (None:
        unknown)."""
        ...


@runtime_checkable
class Calibratable(Protocol):
    """Optional: a backend whose step costs :mod:`llamax.engine.timing.calibration` may measure
    before the engine starts (both :class:`~llamax.backend.llama_cpp.LlamaCppBackend` and
    :class:`llamax.testing.FakeBackend` are)."""

    def calibration_key(self) -> str | None:
        """Everything step costs depend on (the model, the build and settings of the
        library, the machine), as one string to cache a calibration under; None: do not
        cache."""
        ...

    def fill_cells(self, seq_id: int, num_cells: int) -> bool:
        """Grow ``seq_id``, which holds cells at positions ``0..n-1``, to ``num_cells`` cells
        without computing them: filler K/V, repeated from its own cells, that attention
        costs the same over (its values mean nothing). False when the backend cannot."""
        ...


@runtime_checkable
class LoraHost(Protocol):
    """Optional: a backend that loads LoRA adapters and runs each decode under a set of
    them (both :class:`~llamax.backend.llama_cpp.LlamaCppBackend` and
    :class:`llamax.testing.FakeBackend` are). llama.cpp applies adapters to a whole
    context, so one decode carries one set; the scheduler groups its steps by set."""

    def load_adapter(self, name: str, path: str) -> None:
        """Load the LoRA GGUF at ``path`` under ``name`` (not applied until a set names it).

        Raises:
            ModelLoadError: the file is missing or not an adapter for this model.
        """
        ...

    def set_adapters(self, adapters: AdapterSet) -> None:
        """Run the next decodes under ``adapters`` (loaded names with their scales; ``()``:
        the base model). Cheap when the set is the current one."""
        ...


@runtime_checkable
class ImageHost(Protocol):
    """Optional: a backend that may load a multimodal projector (``mmproj``), whose prompts
    may then hold images (:mod:`llamax.engine.images`; ``facts.sees_images`` says whether
    one that encodes images is loaded). Reading, tokenizing and encoding images may run
    on any thread (encodes one at a time); :meth:`decode_embeddings` on the engine's."""

    @property
    def projector_identity(self) -> dict[str, object] | None:
        """What identifies the projector (a fingerprint of its weights), or None when none
        is loaded: a saved session whose KV holds images must match it, since the same
        pixels through another projector give other cells. Known at load; never raises."""
        ...

    @property
    def image_marker(self) -> str:
        """The text that stands for one image in :meth:`tokenize_images`' text ("" when
        no projector is loaded: a property here never raises, so ``isinstance`` works)."""
        ...

    def max_image_rows(self, non_causal: bool) -> int:
        """Most embedding rows one image may have: a non-causal image is decoded in one
        micro-batch (``n_ubatch``), a causal one in pieces of at most ``n_batch``."""
        ...

    def read_image(self, data: bytes) -> RgbImage:
        """Decode an image file's bytes (PNG, JPEG, GIF, BMP).

        Raises:
            ImageError: not such a file, damaged, or over the size limits.
        """
        ...

    def tokenize_images(
        self, text: str, images: Sequence[RgbImage], *, add_special: bool = True
    ) -> MediaPrompt:
        """Tokenize ``text``, with ``images`` at its :attr:`image_marker` s, into chunks
        (``add_special``: BOS first, when the model adds one)."""
        ...

    def encode_image(self, chunk: Any) -> npt.NDArray[np.float32]:
        """An image chunk's embeddings, ``(n_tokens, n_embd)``; one caller at a time."""
        ...

    def decode_embeddings(self, items: Sequence[BatchItem], *, non_causal: bool) -> int:
        """Decode ``items`` (each with ``embeddings``) in one ``llama_decode``; its status.

        Raises:
            ValueError: rows of the wrong shape, too many, or a non-causal batch larger
                than one micro-batch.
        """
        ...


@runtime_checkable
class Inspectable(Protocol):
    """Optional: what a backend can show of its own state, for ``Context.audit()``.

    :func:`llamax.engine.kv.audit.audit` checks ``isinstance(backend, Inspectable)`` and compares
    each answer that is not None with the scheduler's bookkeeping. Both
    :class:`~llamax.backend.llama_cpp.LlamaCppBackend` and :class:`llamax.testing.FakeBackend`
    implement it; a backend without it is audited on ``seq_pos_max`` alone.
    """

    @property
    def num_live_samplers(self) -> int:
        """Samplers built by ``new_sampler`` and not yet freed."""
        ...

    @property
    def num_cells_used(self) -> int | None:
        """Distinct KV cells held by any sequence, or None when the backend cannot tell."""
        ...

    def seq_tokens(self, seq_id: int) -> Sequence[int | None] | None:
        """The tokens ``seq_id`` holds, by position (None where a cell was removed), or None
        when the backend cannot tell."""
        ...
