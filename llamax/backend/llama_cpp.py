"""The llama.cpp backend, on llama-cpp-python's raw ctypes bindings.

The native handles (:mod:`llamax.backend.native`) are owned here and freed in a stated order
by :meth:`LlamaCppBackend.close`: samplers, then the batch, then the context, then the model.

Native lifetime: every method a user thread may reach (tokenizing, pieces, metadata, the
model's identity, grammar checks ...) enters a guard that counts its users and raises
:class:`~llamax.errors.ContextClosedError` once the backend is closing; :meth:`close` marks
it closed, waits until the last user is out, and only then frees. The engine's own calls
(decode, sample, the KV operations) need no guard: the engine closes the backend under its
step lock, after the last step.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from ..adapters import NO_ADAPTERS, AdapterSet
from ..config import ContextConfig
from ..errors import ContextClosedError, ModelLoadError, RequestFailedError
from ..params import SamplingParams
from .base import BatchItem
from .fingerprint import weights_fingerprint
from .gguf_file import GGML_TYPE_NAMES
from .lora_file import check_lora_file
from .native import (
    NativeBatch,
    NativeContext,
    NativeModel,
    NativeSampler,
    bindings,
    context_params,
    utf8,
)
from .platform import cpu_description
from .rpc import register_rpc_servers
from .seq_state import cell_positions, restream, tile

__all__ = ["MAX_STREAMS_MEMORY", "LlamaCppBackend"]

MAX_STREAMS_MEMORY = 2
"""``kv_layout="auto"`` adapts (starting with one stream per sequence) only if the streams
cost at most this many times the unified cache's memory. llama.cpp rounds every stream up
to a multiple of 256 cells, so ``n_ctx=8192, n_seq_max=64`` holds 64 x 256 = 16,384 cells
in streams (as ``llama-server -c 8192 -np 64`` does) and 8,192 unified."""
_PAD = 256  # llama.cpp pads n_ctx, and each stream, to a multiple of this


def _padded(n: int) -> int:
    return max(_PAD, -(-n // _PAD) * _PAD)


def _streams_cells(n_ctx: int, n_seq_max: int) -> int:
    """Cells llama.cpp allocates for ``n_seq_max`` streams out of ``n_ctx``."""
    return _padded(_padded(n_ctx) // n_seq_max) * n_seq_max


_log = logging.getLogger("llamax.llama_cpp")


class LlamaCppBackend:
    """One llama.cpp model + context + batch; the KV layout follows ``kv_layout``."""

    def __init__(self, config: ContextConfig) -> None:
        C = bindings()
        self._C = C
        self._gate = threading.Condition()  # guards _users and _closed
        self._users = 0  # threads inside a native call made from outside the engine
        self._closed = False
        if config.verbose and not _log.handlers:
            _log.addHandler(logging.StreamHandler())
            _log.setLevel(logging.DEBUG)
        path = Path(config.model_path)
        self._config = config
        self._samplers: dict[int, NativeSampler] = {}
        self._pieces: dict[int, bytes] = {}
        if config.rpc_servers is not None:
            register_rpc_servers(C, config.rpc_servers)
        with ExitStack() as stack:  # closes in reverse: samplers, batch, context, model
            model = NativeModel(
                C,
                path,
                n_gpu_layers=config.n_gpu_layers,
                use_mmap=config.use_mmap,
                use_extra_bufts=config.use_extra_bufts,
            )
            stack.callback(model.close)
            try:
                self._weights = weights_fingerprint(path)
            except OSError as exc:
                raise ModelLoadError(f"cannot read {path} to fingerprint it: {exc}") from exc
            # one KV section (no sliding window, no recurrent state): a sequence's saved
            # state can move between layouts (seq_state.restream)
            self._plain_kv = not (model.is_recurrent() or model.is_hybrid() or model.n_swa() > 0)
            # streams: one buffer per sequence (a partial seq_cp between them aborts the
            # process, so the KV cache copies whole streams); unified: one shared buffer.
            # "auto" without n_ctx_seq starts in streams and moves (relayout) as needed.
            layout = config.resolved_kv_layout
            self._can_relayout = (
                config.kv_layout == "auto"
                and layout == "unified"
                and self._plain_kv
                and config.n_seq_max > 1
                and _streams_cells(config.n_ctx, config.n_seq_max)
                <= MAX_STREAMS_MEMORY * max(config.n_ctx, _PAD)
            )
            self._is_unified = layout == "unified" and not self._can_relayout
            self._cparams = context_params(
                C,
                n_ctx=config.n_ctx,
                n_batch=config.n_batch,
                n_ubatch=config.n_ubatch or min(config.n_batch, 512),
                n_seq_max=config.n_seq_max,
                n_threads=config.resolved_n_threads,
                n_threads_batch=config.n_threads_batch or config.resolved_n_threads,
                kv_unified=self._is_unified,
            )
            if config.flash_attn is not None:
                self._cparams.flash_attn_type = 1 if config.flash_attn else 0
            context = NativeContext.create(model, self._cparams)
            if context is None:
                raise ModelLoadError(
                    f"llama.cpp could not create a context for {path} "
                    f"(n_ctx={config.n_ctx}, n_seq_max={config.n_seq_max}); out of memory?"
                )
            self._context = context
            stack.callback(self._close_context)  # the current one: relayout replaces it
            self._n_batch = config.n_batch
            self._batch = NativeBatch(C, self._n_batch)
            stack.callback(self._batch.close)
            stack.callback(self._free_samplers)
            self._stack = stack.pop_all()
        self._model = model
        self._cpu_attention = config.n_gpu_layers == 0 or not C.llama_supports_gpu_offload()
        self._attention_tiles = (
            (model.n_head(), config.n_threads_batch or config.resolved_n_threads)
            if self._cpu_attention and config.flash_attn is not False
            else None
        )
        self._kv_cells = context.n_ctx()
        # a unified cache's cells: what n_ctx asked for, padded as llama.cpp pads it
        self._n_ctx = _padded(config.n_ctx) if self._can_relayout else self._kv_cells
        self._n_seq_max = context.n_seq_max()
        self._n_ctx_stream = context.n_ctx_seq() if not self._is_unified else self._n_ctx
        native_seq = config.n_ctx if self._can_relayout else self._n_ctx_stream
        self._n_ctx_seq = min(native_seq, config.n_ctx_seq or native_seq)
        kv_dim = model.n_embd() // model.n_head() * model.n_head_kv()
        self._kv_bytes_per_cell = 2 * 2 * kv_dim * model.n_layer()  # K+V, f16
        self._n_vocab = model.n_vocab()
        self._add_bos = model.add_bos()
        self._eog = frozenset(t for t in range(self._n_vocab) if model.is_eog(t))
        self._model_name = self.metadata("general.name") or path.stem
        self._model_path = path
        self._kv_types = "/".join(
            GGML_TYPE_NAMES.get(t, str(t)) for t in (self._cparams.type_k, self._cparams.type_v)
        )
        self._adapters: dict[str, Any] = {}  # name -> llama_adapter_lora*, freed with the model
        self._adapter_set: AdapterSet | None = NO_ADAPTERS  # None: not yet applied

    # ------------------------------------------------------------------ facts
    @property
    def n_ctx(self) -> int:
        """KV cells of the unified cache, as granted (``n_ctx`` padded to a multiple of 256);
        with a fixed ``"streams"`` layout, all the streams' cells."""
        return self._n_ctx

    @property
    def kv_cells(self) -> int:
        """KV cells allocated now: ``kv_layout="auto"`` in streams may hold more than
        :attr:`n_ctx`, since llama.cpp rounds each stream up to 256 cells."""
        return self._kv_cells

    @property
    def n_seq_max(self) -> int:
        """Sequence ids available."""
        return self._n_seq_max

    @property
    def n_ctx_seq(self) -> int:
        """Most tokens one sequence may hold (its stream's cells, or ``n_ctx_seq``)."""
        return self._n_ctx_seq

    @property
    def is_unified(self) -> bool:
        """Whether all sequences share one KV buffer (copies share cells)."""
        return self._is_unified

    @property
    def n_ctx_stream(self) -> int:
        """Cells one sequence may hold in the current layout: its stream's, or ``n_ctx``."""
        return self._kv_cells if self._is_unified else self._n_ctx_stream

    @property
    def n_threads(self) -> int:
        """The threads a single-token step uses now. (:class:`~llamax.backend.base.Threaded`)"""
        return int(self._cparams.n_threads)

    def set_n_threads(self, n_threads: int) -> None:
        """Use ``n_threads`` from the next step on, for prompt batches too unless
        ``n_threads_batch`` was given. (:class:`~llamax.backend.base.Threaded`)"""
        batch = self._config.n_threads_batch or n_threads
        self._cparams.n_threads, self._cparams.n_threads_batch = n_threads, batch
        self._context.set_n_threads(n_threads, batch)  # and a relayout's context, from cparams

    @property
    def can_relayout(self) -> bool:
        """Whether :meth:`relayout` may switch layouts (``kv_layout="auto"``, plain KV)."""
        return self._can_relayout

    def relayout(self, unified: bool) -> None:
        """Move every sequence's cells into a new context with the other KV layout.

        The new context is made first, so a failure leaves the old one as it was. Each
        sequence's state moves with ``llama_state_seq_get_data``/``set_data`` (rewritten for
        the new stream count): copied prefixes no longer share cells afterwards.

        Raises:
            RequestFailedError: llama.cpp could not create the context, or a state could not
                be moved (a sequence that does not fit its stream).
        """
        if unified == self._is_unified:
            return
        self._cparams.kv_unified = unified
        new = NativeContext.create(self._model, self._cparams)
        if new is None:
            raise RequestFailedError("llama.cpp could not create a context for the new KV layout")
        n_stream = 1 if unified else self._n_seq_max
        try:
            for seq_id in range(self._n_seq_max):
                if self.seq_pos_max(seq_id) < 0:
                    continue
                try:
                    data = restream(self._context.state_seq_get(seq_id), n_stream)
                except ValueError as exc:
                    raise RequestFailedError(f"sequence {seq_id}'s state: {exc}") from exc
                if not new.state_seq_set(seq_id, data):
                    raise RequestFailedError(f"the new KV layout refused sequence {seq_id}")
        except BaseException:
            new.close()
            raise
        old, self._context, self._is_unified = self._context, new, unified
        old.close()
        self._adapter_set = None  # the new context has none applied yet
        self._kv_cells = new.n_ctx()
        if unified:
            self._n_ctx = self._kv_cells

    def _close_context(self) -> None:
        self._context.close()

    def _free_samplers(self) -> None:
        for sampler in list(self._samplers.values()):
            self.free_sampler(sampler)

    @contextmanager
    def _entered(self) -> Iterator[None]:
        """Count the caller as a user of the native handles for the ``with`` block.

        Raises:
            ContextClosedError: the backend is closed or closing.
        """
        with self._gate:
            if self._closed:
                raise ContextClosedError("the context is closed: its model has been freed")
            self._users += 1
        try:
            yield
        finally:
            with self._gate:
                self._users -= 1
                if not self._users:
                    self._gate.notify_all()

    @property
    def cpu_attention(self) -> bool:
        """No layer is offloaded: no GPU or RPC device, or ``n_gpu_layers=0``."""
        return self._cpu_attention

    @property
    def attention_tiles(self) -> tuple[int, int] | None:
        """The model's query heads and the batch threads, when attention is ggml's CPU
        flash attention (``flash_attn`` not False, nothing offloaded)."""
        return self._attention_tiles

    @property
    def kv_bytes_per_cell(self) -> int:
        """Approximate memory of one KV cell (K and V in f16, every layer)."""
        return self._kv_bytes_per_cell

    @property
    def n_batch(self) -> int:
        """Most tokens per decode."""
        return self._n_batch

    @property
    def n_vocab(self) -> int:
        """Vocabulary size."""
        return self._n_vocab

    @property
    def model_name(self) -> str:
        """``general.name`` from the GGUF metadata, else the file name."""
        return self._model_name

    @property
    def model_path(self) -> Path:
        """The loaded file."""
        return self._model_path

    @property
    def eog_token_ids(self) -> frozenset[int]:
        """Every end-of-generation token of the vocabulary."""
        return self._eog

    @property
    def can_shift(self) -> bool:
        """Whether the memory supports position shifts (``seq_add``)."""
        with self._entered():
            return self._context.can_shift()

    @property
    def num_live_samplers(self) -> int:
        """Samplers built and not yet freed (for leak checks)."""
        return len(self._samplers)

    @property
    def num_cells_used(self) -> int | None:
        """None: llama.cpp does not tell how many cells its sequences share (``Inspectable``)."""
        return None

    def seq_tokens(self, seq_id: int) -> Sequence[int | None] | None:
        """None: llama.cpp does not show a sequence's tokens (``Inspectable``)."""
        return None

    @property
    def bos_token_id(self) -> int | None:
        """BOS when the vocabulary adds it to prompts."""
        with self._entered():
            bos = self._model.bos()
        return bos if self._add_bos and bos >= 0 else None

    @property
    def eos_token_id(self) -> int | None:
        """The EOS token, if the vocabulary has one."""
        with self._entered():
            eos = self._model.eos()
        return eos if eos >= 0 else None

    def token_text(self, token: int) -> str:
        """The token's text with special tokens rendered."""
        with self._entered():
            return self._model.piece(token, special=True, size=256).decode("utf-8", "replace")

    def metadata(self, key: str) -> str | None:
        """A GGUF metadata value as a string, or None."""
        with self._entered():
            return self._model.meta(key)

    # ------------------------------------------------------------------ text (any thread)
    def tokenize(
        self, text: str, *, add_special: bool = True, parse_special: bool = True
    ) -> list[int]:
        """Tokenize ``text``; read-only on the vocabulary, so safe from any thread.

        Raises:
            InvalidRequestError: ``text`` holds a lone surrogate (not encodable as UTF-8).
            ContextClosedError: the backend is closed.
        """
        data = utf8(text)
        with self._entered():
            return self._model.tokenize(data, add_special=add_special, parse_special=parse_special)

    def token_to_piece(self, token: int) -> bytes:
        """The bytes of ``token`` (special tokens render as empty), cached per id.

        Raises:
            ContextClosedError: the backend is closed (and the piece was not cached).
        """
        piece = self._pieces.get(token)
        if piece is None:
            with self._entered():
                piece = self._pieces[token] = self._model.piece(token, special=False)
        return piece

    def is_eog(self, token: int) -> bool:
        """Whether ``token`` ends generation."""
        return token in self._eog

    # ------------------------------------------------------------------ adapters
    def load_adapter(self, name: str, path: str) -> None:
        """``llama_adapter_lora_init``: load a LoRA GGUF for this model under ``name``
        (:class:`~llamax.backend.base.LoraHost`). llama.cpp frees it with the model.

        The file is checked first (:func:`~llamax.backend.lora_file.check_lora_file`):
        llama.cpp loads tensor types it cannot multiply and NaN weights, and crashes or
        answers nothing later.

        Raises:
            ModelLoadError: the file is missing, fails those checks (the message names the
                tensor or key), or llama.cpp refused it (not a LoRA, another architecture,
                shapes that do not fit the model); its log says why.
        """
        if not Path(path).is_file():
            raise ModelLoadError(f"LoRA adapter {name!r}: no file at {path}")
        try:
            check_lora_file(path)  # what llama.cpp lets through and then crashes on
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"LoRA adapter {name!r}: could not load {path}: {exc}") from None
        with self._entered():
            adapter = self._C.llama_adapter_lora_init(self._model.ptr, os.fsencode(path))
        if not adapter:
            raise ModelLoadError(
                f"LoRA adapter {name!r}: llama.cpp could not load {path} for this model "
                "(not a LoRA GGUF, another architecture, or tensors of the wrong shape; "
                "verbose=True shows llama.cpp's reason)"
            )
        self._adapters[name] = adapter

    def set_adapters(self, adapters: AdapterSet) -> None:
        """``llama_set_adapters_lora`` for the next decodes; nothing when already applied."""
        if adapters == self._adapter_set:
            return
        C = self._C
        n = len(adapters)
        handles = (C.llama_adapter_lora_p_ctypes * max(n, 1))(
            *(self._adapters[name] for name, _ in adapters)
        )
        scales = (ctypes.c_float * max(n, 1))(*(scale for _, scale in adapters))
        status = C.llama_set_adapters_lora(self._context.ptr, handles if n else None, n, scales)
        if status != 0:
            self._adapter_set = None
            raise RequestFailedError(f"llama_set_adapters_lora failed with status {status}")
        self._adapter_set = adapters

    # ------------------------------------------------------------------ engine thread
    def decode(self, items: Sequence[BatchItem]) -> int:
        """Lay ``items`` out in one batch and run ``llama_decode``."""
        tokens: list[int] = []
        positions: list[int] = []
        batch = self._batch
        rows = batch.seq_rows
        for item in items:
            first = len(tokens)
            tokens.extend(item.token_ids)
            positions.extend(range(item.start_pos, item.start_pos + len(item.token_ids)))
            for i in range(first, len(tokens)):
                rows[i][0] = item.seq_id
        n = len(tokens)
        batch.tokens[:n] = tokens
        batch.pos[:n] = positions
        batch.logits[:n] = 0
        for item in items:
            for row in item.rows:
                batch.logits[row] = 1
        batch.set_n_tokens(n)
        return self._context.decode(batch)

    def run_queued_copies(self) -> None:
        """Run the cross-stream copies llama.cpp has queued (see
        :mod:`~llamax.engine.kv.stream_copies`). llama.cpp runs them only at the start of a
        decode, so this decodes one token, with no output, into an empty sequence (or past
        the end of one with room) and removes it again. The last decode's logits are gone
        afterwards.

        Raises:
            RequestFailedError: no sequence has room for the token, or the decode failed.
        """
        found = next(
            (
                (seq_id, pos + 1)
                for seq_id in sorted(range(self._n_seq_max), key=self.seq_pos_max)
                if (pos := self.seq_pos_max(seq_id)) + 1 < self.n_ctx_stream
            ),
            None,
        )
        if found is None:
            raise RequestFailedError("no KV room to run llama.cpp's queued stream copies")
        seq_id, pos = found
        batch = self._batch
        batch.tokens[0] = max(self._model.bos(), 0)
        batch.pos[0] = pos
        batch.logits[0] = 0
        batch.seq_rows[0][0] = seq_id
        batch.set_n_tokens(1)
        status = self._context.decode(batch)
        self._context.seq_rm(seq_id, pos, -1)
        if status not in (0, 1, 2):  # these three come after the memory update
            raise RequestFailedError(f"llama_decode failed with status {status}")

    def check_grammar(self, grammar: str) -> str | None:
        """Build and free a grammar sampler: llama.cpp returns NULL for invalid GBNF.

        Raises:
            ContextClosedError: the backend is closed.
        """
        with self._entered():
            sampler = self._model.grammar_sampler(grammar)
            if not sampler:
                return "llama.cpp could not parse it (its parser prints the reason to stderr)"
            self._C.llama_sampler_free(sampler)
        return None

    def logits(self, row: int) -> npt.NDArray[np.float32]:
        """Zero-copy view of ``llama_get_logits_ith(ctx, row)``."""
        return self._context.logits(row, self._n_vocab)

    def batch_logits(self, num_rows: int) -> npt.NDArray[np.float32]:
        """Zero-copy view of ``llama_get_logits(ctx)``: one row per output, in batch order."""
        return self._context.all_logits(num_rows, self._n_vocab)

    def new_sampler(
        self,
        params: SamplingParams,
        seed: int,
        history: Sequence[int],
        *,
        grammar: str | None = None,
    ) -> Any:
        """Build the native sampler chain for one sequence (none for greedy with at most a
        bias: see :class:`~llamax.backend.native.NativeSampler`)."""
        C = self._C
        bias = dict(params.logit_bias)
        if params.ignore_eos:
            bias.update(dict.fromkeys(self._eog, float("-inf")))
        bias = {t: b for t, b in bias.items() if t < self._n_vocab}
        if params.is_greedy and not params.has_penalties and grammar is None:
            greedy = NativeSampler(C, None, None, [], self._n_vocab, argmax=True, bias=bias)
            self._samplers[id(greedy)] = greedy
            return greedy
        chain = C.llama_sampler_chain_init(C.llama_sampler_chain_default_params())
        if bias:
            arr = (C.llama_logit_bias * len(bias))(
                *(C.llama_logit_bias(t, b) for t, b in bias.items())
            )
            C.llama_sampler_chain_add(
                chain, C.llama_sampler_init_logit_bias(self._n_vocab, len(bias), arr)
            )
        if params.has_penalties:
            last_n = self._n_ctx if params.penalty_last_n == -1 else params.penalty_last_n
            penalties = C.llama_sampler_init_penalties(
                self._n_vocab,
                last_n,
                params.repeat_penalty,
                params.frequency_penalty,
                params.presence_penalty,
            )
            C.llama_sampler_chain_add(chain, penalties)
            for token in history[-last_n:]:
                C.llama_sampler_accept(penalties, token)
        if params.is_greedy:
            C.llama_sampler_chain_add(chain, C.llama_sampler_init_greedy())
        else:
            if params.top_k > 0:
                C.llama_sampler_chain_add(chain, C.llama_sampler_init_top_k(params.top_k))
            if params.typical_p < 1:
                C.llama_sampler_chain_add(chain, C.llama_sampler_init_typical(params.typical_p, 1))
            if params.top_p < 1:
                C.llama_sampler_chain_add(chain, C.llama_sampler_init_top_p(params.top_p, 1))
            if params.min_p > 0:
                C.llama_sampler_chain_add(chain, C.llama_sampler_init_min_p(params.min_p, 1))
            C.llama_sampler_chain_add(chain, C.llama_sampler_init_temp(params.temperature))
            C.llama_sampler_chain_add(chain, C.llama_sampler_init_dist(seed))
        constraint = None
        if grammar is not None:
            constraint = self._model.grammar_sampler(grammar)
            if not constraint:  # checked at add_request; never hand llama.cpp a NULL sampler
                C.llama_sampler_free(chain)
                raise RequestFailedError("llama.cpp could not parse the grammar")
        banned = [t for t, b in bias.items() if b == float("-inf")]
        sampler = NativeSampler(C, chain, constraint, banned, self._n_vocab)
        self._samplers[id(sampler)] = sampler
        return sampler

    def sample(self, sampler: Any, row: int) -> int:
        """Sample from batch ``row`` with the sequence's chain (which also accepts the token).

        A grammar is applied here rather than inside the chain: its mask is written into the
        logits row, and if no token survives the mask, logit_bias bans (``ignore_eos``) and
        logits processors together, the request fails with :class:`RequestFailedError`.
        Inside the chain llama.cpp would sample a forbidden token and abort the process.

        Raises:
            RequestFailedError: the grammar allows no token at this point.
        """
        if sampler.grammar is not None:
            self._constrain(sampler, row)
        token: int = sampler.sample(self._context, row)
        if sampler.grammar is not None:
            sampler.accept_grammar(token)
        return token

    def _constrain(self, sampler: NativeSampler, row: int) -> None:
        C = self._C
        logits = self.logits(row)
        candidates = sampler.candidates
        assert candidates is not None
        candidates["logit"] = logits
        data = C.llama_token_data_array(
            candidates.ctypes.data_as(C.llama_token_data_p), self._n_vocab, -1, False
        )
        sampler.apply_grammar(data)
        kept = candidates[: data.size]
        logits[kept["id"][np.isneginf(kept["logit"])]] = -np.inf
        alive = np.isfinite(logits)
        alive[sampler.banned] = False
        if not alive.any():
            raise RequestFailedError(
                "the grammar allows no token here (are its end-of-generation tokens banned by "
                "ignore_eos or logit_bias, or did a logits processor remove every allowed token?)"
            )

    def free_sampler(self, sampler: Any) -> None:
        """Free a sampler from :meth:`new_sampler` (its chain and grammar)."""
        if self._samplers.pop(id(sampler), None) is not None:
            sampler.close()

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        """``llama_memory_seq_rm``."""
        return self._context.seq_rm(seq_id, p0, p1)

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """``llama_memory_seq_cp``. Between streams llama.cpp updates the cells at once but
        queues the buffer copy until the next decode (:meth:`run_queued_copies`)."""
        self._context.seq_cp(src, dst, p0, p1)

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        """``llama_memory_seq_add``: llama.cpp re-rotates the keys at the next decode."""
        self._context.seq_add(seq_id, p0, p1, delta)

    def seq_pos_min(self, seq_id: int) -> int:
        """``llama_memory_seq_pos_min``."""
        return self._context.seq_pos_min(seq_id)

    @property
    def can_share_prefix(self) -> bool:
        """False for recurrent and hybrid memories, which cannot drop or copy partial ranges."""
        with self._entered():
            return not (self._model.is_recurrent() or self._model.is_hybrid())

    @property
    def model_identity(self) -> dict[str, object]:
        """What a saved session and the disk tier's entries must match: name, description,
        sizes, vocabulary, a fingerprint of the weights
        (:func:`~llamax.backend.fingerprint.weights_fingerprint`) and the KV cache's types."""
        with self._entered():
            desc, n_params, size = self._model.desc(), self._model.n_params(), self._model.size()
        return {
            "name": self._model_name,
            "desc": desc,
            "n_params": n_params,
            "size": size,
            "n_vocab": self._n_vocab,
            "weights": self._weights,
            "kv_cache": self._kv_types,
        }

    def state_seq_get(self, seq_id: int) -> bytes:
        """Serialise one sequence's KV state (``llama_state_seq_get_data``); with a plain KV
        cache, written as a unified cache would, so it loads in either layout.

        Raises:
            ContextClosedError: the backend is closed.
        """
        with self._entered():
            data = self._context.state_seq_get(seq_id)
        return restream(data, 1) if self._plain_kv and data else data

    def calibration_key(self) -> str | None:
        """The model, llama.cpp's build and version, the settings step costs depend on, and
        the CPU (model and SIMD flags). (:class:`~llamax.backend.base.Calibratable`)"""
        import json

        import llama_cpp

        c = self._config
        system = self._C.llama_print_system_info()
        return json.dumps(
            {
                "model": self.model_identity,
                "llama_cpp": [llama_cpp.__version__, bytes(system or b"").decode(errors="replace")],
                "cpu": cpu_description(),
                "settings": [
                    c.n_batch, c.n_ubatch, c.resolved_n_threads, c.n_threads_batch, c.flash_attn,
                    c.n_gpu_layers, c.rpc_servers, self._is_unified, self.n_ctx_stream,
                    self._n_seq_max, self._cpu_attention,
                ],
            },
            sort_keys=True,
            default=str,
        )  # fmt: skip

    def fill_cells(self, seq_id: int, num_cells: int) -> bool:
        """Grow ``seq_id`` to ``num_cells`` cells of its own K/V rows repeated
        (:func:`~llamax.backend.seq_state.tile`); a plain KV cache only.
        (:class:`~llamax.backend.base.Calibratable`)"""
        if not self._plain_kv or num_cells > self.n_ctx_stream:
            return False
        try:
            data = tile(self.state_seq_get(seq_id), num_cells)
        except ValueError:
            return False
        self.seq_rm(seq_id)
        return self.state_seq_set(seq_id, data)

    def state_seq_set(self, seq_id: int, data: bytes) -> bool:
        """Load a state from :meth:`state_seq_get` into ``seq_id``; False if refused.

        With a plain KV cache the state is parsed first, so llama.cpp never reads a damaged
        one: it must be whole (no byte missing or left over), hold cells of one sequence in
        one stream, at positions ``0 .. n-1`` exactly once each, and fit that stream.

        Raises:
            ContextClosedError: the backend is closed.
        """
        if self._plain_kv:
            try:
                positions = cell_positions(data)
                data = restream(data, 1 if self._is_unified else self._n_seq_max)
            except ValueError as exc:
                _log.warning("refused a saved sequence state: %s", exc)
                return False
            n = len(positions)
            if n > self.n_ctx_stream or sorted(positions) != list(range(n)):
                _log.warning("refused a saved sequence state: its positions are not 0..%d", n - 1)
                return False
        with self._entered():
            return self._context.state_seq_set(seq_id, data)

    def seq_pos_max(self, seq_id: int) -> int:
        """``llama_memory_seq_pos_max``."""
        return self._context.seq_pos_max(seq_id)

    def close(self) -> None:
        """Free samplers, batch, context and model, in that order. Idempotent.

        New native calls from other threads raise :class:`ContextClosedError` from now on;
        the memory is freed once the last one already inside has returned.
        """
        with self._gate:
            if self._closed:
                return
            self._closed = True
            while self._users:
                self._gate.wait()
        self._stack.close()  # each handle is freed even when an earlier free raises
