"""The llama.cpp backend, on llama-cpp-python's raw ctypes bindings.

The native handles (:mod:`llamax.backend.native`) are owned here and freed in a stated order
by :meth:`LlamaCppBackend.close`: samplers, then the batches, then the context, then the
projector (``mmproj``), then the model.
The model's side, which any thread may reach behind a guard, is
:class:`~llamax.backend.llama_model.LlamaCppModel`; this module adds the context: the KV
layout, decoding, sampling and the KV operations.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from contextlib import ExitStack
from typing import Any

import numpy as np
import numpy.typing as npt

from ..adapters import NO_ADAPTERS, AdapterSet
from ..config import ContextConfig, is_quantized, kv_row_bytes
from ..errors import ImageError, ModelLoadError, RequestFailedError
from ..facts import ModelFacts
from ..params import SamplingParams
from .base import BatchItem, Drawn, SharedPrefix
from .fingerprint import weights_fingerprint
from .gguf_file import GGML_TYPE_NAMES, GGML_TYPES
from .graph_sampling import GraphChains
from .host_sampling import host_sampling_enabled
from .kv_layout import adapts_layout, loadable_state, move_states, padded, run_queued_copies
from .llama_model import LlamaCppModel
from .memory_probe import check_context_memory
from .native import (
    FEW_ROW_VALUES,
    NativeBatch,
    NativeContext,
    NativeSampler,
    bindings,
    context_params,
    sample_on_host,
)
from .openmp import release_threads
from .platform import calibration_key
from .rpc import register_rpc_servers
from .sampler_chain import constrain, new_sampler
from .seq_state import restream, tile
from .vision import (
    MAX_IMAGE_PIXELS,
    MAX_IMAGE_SIDE,
    EmbeddingItem,
    MediaPrompt,
    NativeEmbdBatch,
    Projector,
    RgbImage,
    decode_embeddings,
)

__all__ = ["LlamaCppBackend"]

_log = logging.getLogger("llamax.llama_cpp")


def _kv_types_refused(type_k: str, type_v: str) -> str:
    """What may have made llama.cpp refuse a context with these KV types ("" for f16's)."""
    if (type_k, type_v) == ("f16", "f16"):
        return ""
    return (
        f", K/V cache types {type_k}/{type_v}: a quantized type needs every attention head's "
        "size to be a multiple of 32, and some models (MLA) one type for K and V"
    )


class LlamaCppBackend(LlamaCppModel):
    """One llama.cpp model + context + batch; the KV layout follows ``kv_layout``."""

    def __init__(self, config: ContextConfig) -> None:
        C = bindings()
        if config.verbose and not _log.handlers:
            _log.addHandler(logging.StreamHandler())
            _log.setLevel(logging.DEBUG)
        self._config = config
        self._samplers: dict[int, NativeSampler] = {}
        self._host_sampling = host_sampling_enabled()
        self._graph = GraphChains(C) if config.backend_sampling else None
        if config.rpc_servers is not None:
            register_rpc_servers(C, config.rpc_servers)
        with (
            ExitStack() as stack
        ):  # closes in reverse: samplers, batches, context, projector, model
            super().__init__(C, config, stack)
            model = self._model
            self._projector: Projector | None = None
            self._projector_identity: dict[str, object] | None = None
            if config.mmproj is not None:  # loaded after the model, freed before it
                self._projector = Projector.load(
                    model,
                    config.mmproj,
                    n_threads=config.resolved_n_threads,
                    use_gpu=config.n_gpu_layers != 0,
                )
                stack.callback(self._projector.close)
                # what a saved session whose KV holds images must match
                self._projector_identity = {"weights": weights_fingerprint(config.mmproj)}
            sees_images = self._projector is not None and self._projector.supports_vision
            # one KV section (no sliding window, no recurrent state): a sequence's saved
            # state can move between layouts (seq_state.restream)
            self._plain_kv = not (model.is_recurrent() or model.is_hybrid() or model.n_swa() > 0)
            # a hybrid without a sliding window: one attention KV section, then the
            # recurrent state, which moves as it is (restream(tail=True))
            self._hybrid_kv = model.is_hybrid() and model.n_swa() == 0
            # streams: one buffer per sequence (a partial seq_cp between them aborts the
            # process, so the KV cache copies whole streams); unified: one shared buffer.
            # "auto" without n_ctx_seq starts in streams and moves (relayout) as needed.
            self._can_relayout = adapts_layout(config, self._plain_kv or self._hybrid_kv)
            self._is_unified = config.resolved_kv_layout == "unified" and not self._can_relayout
            # a cache that cannot fit is refused here, not zeroed until the kernel kills us
            check_context_memory(model, config, unified=self._is_unified, dims=kv_dims(model))
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
            if config.backend_sampling:  # penalties then run in the graph too
                self._cparams.n_outputs_max_per_seq = 1
            type_k, type_v = config.kv_types
            self._cparams.type_k, self._cparams.type_v = GGML_TYPES[type_k], GGML_TYPES[type_v]
            if config.flash_attn is not None:
                self._cparams.flash_attn_type = 1 if config.flash_attn else 0
            elif is_quantized(type_v):  # what llama.cpp's auto does: V needs flash attention
                self._cparams.flash_attn_type = 1
            context = NativeContext.create(model, self._cparams)
            if context is None:
                raise ModelLoadError(
                    f"llama.cpp could not create a context for {self._model_path} "
                    f"(n_ctx={config.n_ctx}, n_seq_max={config.n_seq_max}"
                    f"{_kv_types_refused(type_k, type_v)}); out of memory?"
                )
            self._context = context
            stack.callback(self._close_context)  # the current one: relayout replaces it
            self._n_batch = config.n_batch
            self._batch = NativeBatch(C, self._n_batch)
            stack.callback(self._batch.close)
            self._embd_batch: NativeEmbdBatch | None = None
            if self._projector is not None:
                self._embd_batch = NativeEmbdBatch(C, self._n_batch, model.n_embd())
                stack.callback(self._embd_batch.close)
            stack.callback(self._free_samplers)
            self._stack = stack.pop_all()
        self._cpu_only = not C.llama_supports_gpu_offload()
        self._cpu_attention = config.n_gpu_layers == 0 or self._cpu_only
        self._attention_tiles = (
            (model.n_head(), config.n_threads_batch or config.resolved_n_threads)
            if self._cpu_attention and config.flash_attn is not False
            else None
        )
        self._kv_cells = context.n_ctx()
        # a unified cache's cells: what n_ctx asked for, padded as llama.cpp pads it
        self._n_ctx = padded(config.n_ctx) if self._can_relayout else self._kv_cells
        if config.n_ctx < self._n_ctx and config.n_ctx < padded(1):
            _log.warning(
                "n_ctx=%d is below llama.cpp's smallest context, %d cells: the context "
                "holds %d tokens",
                config.n_ctx, padded(1), self._n_ctx,
            )  # fmt: skip
        self._n_seq_max = context.n_seq_max()
        self._n_ctx_stream = context.n_ctx_seq() if not self._is_unified else self._n_ctx
        native_seq = config.n_ctx if self._can_relayout else self._n_ctx_stream
        self._facts = ModelFacts(  # known at load: they answer after close
            model_name=self._model_name,
            n_vocab=self._n_vocab,
            n_embd=model.n_embd(),
            n_ctx_train=model.n_ctx_train(),
            n_ctx=self._n_ctx,
            n_ctx_seq=min(native_seq, config.n_ctx_seq or native_seq),
            n_seq_max=self._n_seq_max,
            fim_tokens=self._fim,
            sees_images=sees_images,
            bos_token_id=self._bos_eos[0],
            eos_token_id=self._bos_eos[1],
        )
        k_dim, v_dim = kv_dims(model)
        row_bytes = kv_row_bytes(type_k, k_dim) + kv_row_bytes(type_v, v_dim)
        self._kv_bytes_per_cell = row_bytes * model.n_layer()  # K+V, every layer
        self._adapter_set: AdapterSet | None = NO_ADAPTERS  # None: not yet applied
        self._kv_types = "/".join(
            GGML_TYPE_NAMES.get(t, str(t)) for t in (self._cparams.type_k, self._cparams.type_v)
        )

    # ------------------------------------------------------------------ facts
    @property
    def facts(self) -> ModelFacts:
        """The model's and the context's facts, computed at load. Their ``n_ctx``: the
        unified cache's cells, as granted (``n_ctx`` padded to a multiple of 256); with a
        fixed ``"streams"`` layout, all the streams' cells."""
        return self._facts

    @property
    def kv_cells(self) -> int:
        """KV cells allocated now: ``kv_layout="auto"`` in streams may hold more than
        ``facts.n_ctx``, since llama.cpp rounds each stream up to 256 cells."""
        return self._kv_cells

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

    def release_compute_threads(self) -> None:
        """Free the OpenMP workers this thread's compute keeps
        (:func:`~llamax.backend.openmp.release_threads`).
        (:class:`~llamax.backend.base.ComputeThreads`)"""
        release_threads()

    @property
    def can_relayout(self) -> bool:
        """Whether :meth:`relayout` may switch layouts (``kv_layout="auto"``, one
        full-attention KV cache, alone or in a hybrid)."""
        return self._can_relayout

    def relayout(self, unified: bool, shared: Sequence[SharedPrefix] = ()) -> None:
        """Move every sequence's cells into a new context with the other KV layout.

        The new context is made first, so a failure leaves the old one as it was. Each
        sequence's state moves with ``llama_state_seq_get_data``/``set_data`` (rewritten for
        the new stream count): copied prefixes no longer share cells afterwards, except
        ``shared`` ones in a move to the unified layout (``seq_cp`` from their sources).

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
        try:
            move_states(
                self._context,
                new,
                self._n_seq_max,
                1 if unified else self._n_seq_max,
                shared if unified else (),
                tail=self._hybrid_kv,
            )
        except BaseException:
            new.close()
            raise
        old, self._context, self._is_unified = self._context, new, unified
        if self._graph is not None:
            self._graph.release_all(old.ptr)
        old.close()
        self._adapter_set = None  # the new context has none applied yet
        self._kv_cells = new.n_ctx()
        if unified and self._kv_cells != self._n_ctx:  # facts.n_ctx predicted them
            _log.warning(
                "the unified KV cache holds %d cells, not the %d reported as n_ctx",
                self._kv_cells, self._n_ctx,
            )  # fmt: skip

    def _close_context(self) -> None:
        self._context.close()

    def _free_samplers(self) -> None:
        for sampler in list(self._samplers.values()):
            self.free_sampler(sampler)

    @property
    def cpu_only(self) -> bool:
        """A build of llama.cpp with no GPU or RPC device: every op runs on the CPU."""
        return self._cpu_only

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
        """Approximate memory of one KV cell (K and V at their types, every layer)."""
        return self._kv_bytes_per_cell

    @property
    def n_batch(self) -> int:
        """Most tokens per decode."""
        return self._n_batch

    @property
    def can_shift(self) -> bool:
        """Whether the memory supports position shifts (``seq_add``)."""
        with self._guard.entered():
            return self._context.can_shift()

    @property
    def samples_in_graph(self) -> bool:
        """``backend_sampling``: a batch item's plain sampler runs in the decode
        (:class:`~llamax.backend.base.GraphSampling`, :mod:`~llamax.backend.graph_sampling`)."""
        return self._graph is not None

    @property
    def num_attached(self) -> int:
        """Chains attached to sequence ids now (backend sampling; 0 without it)."""
        return 0 if self._graph is None else self._graph.num_attached

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
        if self._graph is not None:
            self._graph.bind(self._context.ptr, items)
        return self._context.decode(batch)

    # ------------------------------------------------------------------ images
    @property
    def projector_identity(self) -> dict[str, object] | None:
        """A fingerprint of the projector file's weights (None without one); known at load.
        (:class:`~llamax.backend.base.ImageHost`)"""
        return self._projector_identity

    def _vision(self) -> Projector:
        if self._projector is None:
            raise ImageError("this context has no projector (mmproj): it cannot read images")
        return self._projector

    @property
    def image_marker(self) -> str:
        """The projector's marker for one image in a prompt's text ("" without one)."""
        if self._projector is None:
            return ""
        with self._guard.entered():
            return self._projector.marker

    def max_image_rows(self, non_causal: bool) -> int:
        """``n_ubatch`` for a non-causal image, ``n_batch`` for a causal one."""
        return int(self._cparams.n_ubatch) if non_causal else self._n_batch

    def read_image(self, data: bytes) -> RgbImage:
        """Decode an image file with ``mtmd`` (:meth:`Projector.decode_image`)."""
        with self._guard.entered():
            return self._vision().decode_image(
                data, max_side=MAX_IMAGE_SIDE, max_pixels=MAX_IMAGE_PIXELS
            )

    def tokenize_images(
        self, text: str, images: Sequence[RgbImage], *, add_special: bool = True
    ) -> MediaPrompt:
        """``mtmd_tokenize`` (:meth:`Projector.tokenize`)."""
        with self._guard.entered():
            return self._vision().tokenize(text, images, add_special=add_special)

    def encode_image(self, chunk: Any) -> npt.NDArray[np.float32]:
        """Run the vision encoder (:meth:`Projector.encode`); one caller at a time."""
        with self._guard.entered():
            return self._vision().encode(chunk)

    def decode_embeddings(self, items: Sequence[BatchItem], *, non_causal: bool) -> int:
        """Decode image rows (:func:`~llamax.backend.vision.decode_embeddings`)."""
        if self._embd_batch is None:
            raise ImageError("this context has no projector (mmproj): it cannot read images")
        embedded = []
        for item in items:
            if item.embeddings is None:
                raise ValueError(f"an embedding decode got a token item: {item!r}")
            embedded.append(EmbeddingItem(item.seq_id, item.embeddings, item.start_pos))
        return decode_embeddings(self._context, self._embd_batch, embedded, non_causal=non_causal)

    def run_queued_copies(self) -> None:
        """Run the cross-stream copies llama.cpp has queued, by decoding one token and
        removing it again (:func:`~llamax.backend.kv_layout.run_queued_copies`). The last
        decode's logits are gone afterwards.

        Raises:
            RequestFailedError: no sequence has room for the token, or the decode failed.
        """
        seq_pos_max = [self._context.seq_pos_max(i) for i in range(self._n_seq_max)]
        bos = max(self._model.bos(), 0)
        run_queued_copies(
            self._context,
            self._batch,
            bos,
            seq_pos_max,
            self.n_ctx_stream,
            can_cut=self.can_share_prefix,
        )

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
        graph: bool = False,
    ) -> Any:
        """Build the native sampler chain for one sequence
        (:func:`~llamax.backend.sampler_chain.new_sampler`); with ``graph`` (and
        ``backend_sampling``), one llama.cpp may run in the decode."""
        sampler = new_sampler(
            self._C, self._model, params, seed, history, grammar,
            eog=self._eog, n_vocab=self._n_vocab, n_ctx=self._n_ctx, host=self._host_sampling,
            graph=graph and self._graph is not None,
        )  # fmt: skip
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
        if sampler.graph and self._graph is not None:
            drawn = self._graph.sampled(self._context.ptr, sampler, row)
            if drawn is not None:
                return drawn
            self._graph.host_ready(self._context.ptr, sampler)
        if sampler.grammar is not None:
            constrain(self._C, sampler, self.logits(row))
        token: int = sampler.sample(self._context, row)
        if sampler.grammar is not None:
            sampler.accept_grammar(token)
        return token

    def sample_rows(self, samplers: Sequence[Any], rows: Sequence[int]) -> list[int]:
        """:meth:`sample` for each sampler and its batch row: the samplers with a host chain
        (:mod:`~llamax.backend.host_sampling`) all together, from one copy of their rows,
        unless they are few (:data:`~llamax.backend.native.FEW_ROW_VALUES`: then each by
        llama.cpp's chain, the same tokens).

        Raises:
            RequestFailedError: a grammar allows no token at this point.
        """
        tokens = [0] * len(rows)
        host = [i for i, s in enumerate(samplers) if s.host is not None]
        if len(host) * self._n_vocab <= FEW_ROW_VALUES:  # few rows: llama.cpp's chain
            host = []
        for i, sampler in enumerate(samplers):
            if sampler.host is None or not host:
                tokens[i] = self.sample(sampler, rows[i])
        if host:
            picks = sample_on_host(
                [samplers[i] for i in host], [self.logits(rows[i]) for i in host]
            )
            for i, token in zip(host, picks, strict=True):
                tokens[i] = token
        return tokens

    def sample_drawn(self, sampler: Any, row: int, limit: int) -> Drawn:
        """:meth:`sample`, also reporting the distribution the chain drew from: the
        candidates it kept, with the probabilities of its last sampler (``dist``), read
        back from :meth:`NativeSampler.draw <llamax.backend.native.NativeSampler.draw>`.

        Raises:
            RequestFailedError: the grammar allows no token at this point.
        """
        if sampler.graph and self._graph is not None:
            self._graph.host_ready(self._context.ptr, sampler)
        if sampler.grammar is not None:
            constrain(self._C, sampler, self.logits(row))
        if sampler.is_greedy:  # llama.cpp's temperature 0 leaves the maximum alone
            token: int = sampler.sample(self._context, row)
            drawn = Drawn(token, 1.0, (token,), (1.0,))
        else:
            kept, selected = sampler.draw(self._context, row)
            probs = kept["p"]
            order = np.argsort(-probs, kind="stable")[:limit]
            order = order[probs[order] > 0]
            drawn = Drawn(
                int(kept["id"][selected]),
                float(probs[selected]),
                tuple(int(t) for t in kept["id"][order]),
                tuple(float(p) for p in probs[order]),
            )
        if sampler.grammar is not None:
            sampler.accept_grammar(drawn.token)
        return drawn

    def free_sampler(self, sampler: Any) -> None:
        """Free a sampler from :meth:`new_sampler` (its chain and grammar)."""
        if self._samplers.pop(id(sampler), None) is not None:
            if self._graph is not None:
                self._graph.release(self._context.ptr, sampler)
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
    def model_identity(self) -> dict[str, object]:
        """What a saved session and the disk tier's entries must match: name, description,
        sizes, vocabulary, a fingerprint of the weights
        (:func:`~llamax.backend.fingerprint.weights_fingerprint`) and the KV cache's types."""
        with self._guard.entered():
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

    def state_seq_get(self, seq_id: int, *, partial: bool = False) -> bytes:
        """Serialise one sequence's KV state (``llama_state_seq_get_data``); with a plain KV
        cache, written as a unified cache would, so it loads in either layout. With
        ``partial``, only the part that cannot be cut at a position (a recurrent state, a
        sliding window's cells): a checkpoint, to set back with ``state_seq_set(partial=True)``.

        Raises:
            ContextClosedError: the backend is closed.
        """
        with self._guard.entered():
            data = self._context.state_seq_get(seq_id, partial=partial)
        if not data or partial or not (self._plain_kv or self._hybrid_kv):
            return data
        try:
            return restream(data, 1, tail=self._hybrid_kv)
        except ValueError:  # not a state this module can read: as llama.cpp wrote it
            return data

    def calibration_key(self) -> str | None:
        """The model, llama.cpp's build and version, the settings step costs depend on, and
        the CPU (model and SIMD flags). (:class:`~llamax.backend.base.Calibratable`)"""
        c = self._config
        settings = [
            c.n_batch, c.n_ubatch, c.resolved_n_threads, c.n_threads_batch, c.flash_attn,
            c.n_gpu_layers, c.rpc_servers, self._is_unified, self.n_ctx_stream,
            self._n_seq_max, self._cpu_attention,
        ]  # fmt: skip
        return calibration_key(self._C, self.model_identity, settings)

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

    def state_seq_set(self, seq_id: int, data: bytes, *, partial: bool = False) -> bool:
        """Load a state from :meth:`state_seq_get` into ``seq_id``; False if refused.

        With a plain KV cache the state is parsed first, so llama.cpp never reads a damaged
        one: it must be whole (no byte missing or left over), hold cells of one sequence in
        one stream, at positions ``0 .. n-1`` exactly once each, and fit that stream. With
        ``partial``, ``data`` is a partial state: it replaces the sequence's recurrent state
        or window and leaves its full attention cells as they are.

        Raises:
            ContextClosedError: the backend is closed.
        """
        if partial:
            with self._guard.entered():
                return self._context.state_seq_set(seq_id, data, partial=True)
        if self._plain_kv:
            n_stream = 1 if self._is_unified else self._n_seq_max
            checked = loadable_state(data, n_stream, self.n_ctx_stream)
            if checked is None:
                return False
            data = checked
        elif self._hybrid_kv:
            try:
                data = restream(data, 1 if self._is_unified else self._n_seq_max, tail=True)
            except ValueError:
                return False
        with self._guard.entered():
            return self._context.state_seq_set(seq_id, data)

    def seq_pos_max(self, seq_id: int) -> int:
        """``llama_memory_seq_pos_max``."""
        return self._context.seq_pos_max(seq_id)

    def close(self) -> None:
        """Free samplers, batch, context and model, in that order. Idempotent.

        New native calls from other threads raise :class:`ContextClosedError` from now on;
        the memory is freed once the last one already inside has returned.
        """
        if self._guard.close():
            self._stack.close()  # each handle is freed even when an earlier free raises


def kv_dims(model: Any) -> tuple[int, int]:
    """The K and V values one KV cell holds in a layer: the heads' size times the KV heads.
    The size is the GGUF's ``<arch>.attention.key_length`` / ``value_length`` where given
    (Gemma 3 270M: 256, not ``n_embd / n_head`` = 160), else ``n_embd / n_head``."""
    n_head_kv = model.n_head_kv()
    head = model.n_embd() // max(1, model.n_head())
    arch = model.meta("general.architecture") or ""
    dims = []
    for key in ("key_length", "value_length"):
        value = model.meta(f"{arch}.attention.{key}")
        dims.append(int(value) * n_head_kv if value and value.isdigit() else head * n_head_kv)
    return dims[0], dims[1]
