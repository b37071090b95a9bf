"""One small class per llama.cpp handle: model, context, batch and sampler.

Each class owns one native pointer, wraps the calls made on it in one-line methods and frees
it in an idempotent ``close()``, like llama-cpp-python's ``_internals.py``. Their owners
(:class:`~llamax.backend.llama_cpp.LlamaCppBackend`, the embeddings backend, ``llamax info``)
free them in the reverse order of creation: samplers, then the batch, then the context,
then the model, since a context uses its model's weights and a sampler its vocabulary.
Only the backend package touches ctypes.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import InvalidRequestError, ModelLoadError
from .host_sampling import ChainRng, HostChain, pick, sample_rows
from .platform import default_use_extra_bufts

__all__ = [
    "NativeBatch",
    "NativeContext",
    "NativeModel",
    "NativeSampler",
    "bindings",
    "captured_log",
    "check_gguf",
    "context_params",
    "native_log_level",
    "sample_on_host",
    "utf8",
]

LOAD_MODE_NONE = 0
"""llama.h's ``LLAMA_LOAD_MODE_NONE``: the weights read into memory, no map (the model
params' ``load_mode``, which replaced ``use_mmap``)."""

_log = logging.getLogger("llamax.llama_cpp")
_INIT_LOCK = threading.Lock()
"""Serialises :func:`bindings`' one-time set-up (the log callback, ``llama_backend_init``)."""
# ggml_log_level: NONE=0, DEBUG=1, INFO=2, WARN=3, ERROR=4, CONT=5 (continues the last line)
_LEVELS = {1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}
_CANDIDATE = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])
_CAPTURE = threading.local()
"""This thread's :func:`captured_log` list (``lines``), while one is open."""


def bindings() -> Any:
    """llama-cpp-python's raw bindings, with llama.cpp's log routed to ``logging`` once.

    Raises:
        ModelLoadError: llama-cpp-python is not installed.
    """
    try:
        import llama_cpp.llama_cpp as C
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ModelLoadError(
            "llama-cpp-python is not installed; run scripts/bootstrap.sh or "
            "`pip install llama-cpp-python`"
        ) from exc
    with _INIT_LOCK:  # two threads loading their first models at once (a model pool)
        if not getattr(bindings, "log_callback", None):
            # llama-cpp-python prints every native log line to stderr; route them to logging.
            last = [logging.DEBUG]

            @C.llama_log_callback  # type: ignore[untyped-decorator]
            def forward(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
                sink = getattr(_CAPTURE, "lines", None)
                if sink is not None:  # a dry run's lines: read by its caller, not logged
                    sink.append(text.decode("utf-8", "replace"))
                    return
                if level != 5:
                    last[0] = native_log_level(level, text)
                if _log.isEnabledFor(last[0]):
                    _log.log(last[0], "%s", text.decode("utf-8", "replace").rstrip())

            # kept alive before llama.cpp holds it: a callback freed while installed is a
            # segfault in the next log line
            bindings.log_callback = forward  # type: ignore[attr-defined]
            C.llama_log_set(forward, ctypes.c_void_p(0))
            C.llama_backend_init()
    return C


@contextmanager
def captured_log() -> Iterator[list[str]]:
    """Collect the llama.cpp log lines this thread causes, in a list, instead of logging
    them (llama.cpp logs from the calling thread): what a dry run sizes is read from them
    (:mod:`~llamax.backend.memory_probe`). Other threads' lines are logged as usual."""
    bindings()  # the callback is installed
    lines: list[str] = []
    outer = getattr(_CAPTURE, "lines", None)
    _CAPTURE.lines = lines
    try:
        yield lines
    finally:
        _CAPTURE.lines = outer


_EXPECTED = (b"n_ctx is not divisible by n_seq_max",)
"""llama.cpp's warnings about what llamax asks for on purpose: in streams each sequence's
cells are padded to 256, so ``n_ctx=2048, n_seq_max=6`` says "rounding down to 3072" (more
than asked). llamax reports the cells it got (``Context.n_ctx``, ``stats().kv_cells_total``;
docs/kv-cache.md), so the line is noise: it goes to DEBUG."""


def native_log_level(level: int, text: bytes) -> int:
    """The ``logging`` level of a llama.cpp log line of ``level`` (GGML's 1-4)."""
    if any(part in text for part in _EXPECTED):
        return logging.DEBUG
    return _LEVELS.get(level, logging.DEBUG)


def check_gguf(path: Path) -> None:
    """Refuse a missing file or one without GGUF's magic bytes before llama.cpp reads it.

    Raises:
        ModelLoadError: the file is missing, unreadable or not a GGUF.
    """
    if not path.is_file():
        raise ModelLoadError(f"model file not found: {path}")
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise ModelLoadError(f"cannot read model file {path}: {exc}") from exc
    if magic != b"GGUF":
        raise ModelLoadError(f"{path} is not a GGUF model file (magic bytes {magic!r})")


def utf8(text: str) -> bytes:
    """``text`` as UTF-8, for the tokenizer.

    Raises:
        InvalidRequestError: ``text`` holds a lone surrogate (``"\\ud800"``).
    """
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(
            f"text holds a lone surrogate ({text[exc.start]!a} at index {exc.start}), "
            "which is not valid Unicode text"
        ) from exc


def context_params(C: Any, **fields: Any) -> Any:
    """``llama_context_default_params()`` with ``fields`` set (``n_ctx=...``, ...)."""
    cparams = C.llama_context_default_params()
    for name, value in fields.items():
        setattr(cparams, name, value)
    return cparams


class NativeModel:
    """A ``llama_model`` and its vocabulary; freed by :meth:`close`, after its contexts."""

    __slots__ = ("C", "ptr", "vocab")

    def __init__(
        self,
        C: Any,
        path: Path,
        *,
        n_gpu_layers: int,
        use_mmap: bool = True,
        use_extra_bufts: bool | None = None,
        no_alloc: bool = False,
    ) -> None:
        """Check and load a GGUF file (``use_extra_bufts=None``: off where AMX crashes).
        With ``no_alloc``, only its metadata and tensor shapes are read: llama.cpp then
        sizes the contexts made on it without allocating them (a dry run), and it cannot
        decode.

        Raises:
            ModelLoadError: the file is missing, not a GGUF, or llama.cpp refused it.
        """
        check_gguf(path)
        mparams = C.llama_model_default_params()
        mparams.n_gpu_layers = n_gpu_layers
        if not use_mmap:  # llama.cpp's own choice (AUTO: a memory map on the CPU) otherwise
            mparams.load_mode = LOAD_MODE_NONE
        mparams.use_extra_bufts = (
            default_use_extra_bufts() if use_extra_bufts is None else use_extra_bufts
        )
        if no_alloc:  # llama.cpp maps nothing then: load mode NONE (an mmap asserts)
            mparams.no_alloc, mparams.load_mode = True, LOAD_MODE_NONE
        ptr = C.llama_model_load_from_file(str(path).encode(), mparams)
        if not ptr:
            raise ModelLoadError(f"llama.cpp could not load {path} (corrupt or unsupported model?)")
        self.C, self.ptr = C, ptr
        self.vocab = C.llama_model_get_vocab(ptr)

    def close(self) -> None:
        """``llama_model_free``; idempotent."""
        ptr, self.ptr = self.ptr, None
        if ptr is not None:
            self.C.llama_model_free(ptr)

    def meta(self, key: str) -> str | None:
        """A GGUF metadata value as a string, or None."""
        size = 1 << 16
        buf = ctypes.create_string_buffer(size)
        n = self.C.llama_model_meta_val_str(self.ptr, key.encode(), buf, size)
        if n < 0:
            return None
        if n >= size:
            buf = ctypes.create_string_buffer(n + 1)
            self.C.llama_model_meta_val_str(self.ptr, key.encode(), buf, n + 1)
        return buf.value.decode("utf-8", "replace")

    def desc(self) -> str:
        """``llama_model_desc``: architecture, size and type in a few words."""
        buf = ctypes.create_string_buffer(256)
        self.C.llama_model_desc(self.ptr, buf, 256)
        return buf.value.decode("utf-8", "replace")

    def n_params(self) -> int:
        """Parameter count."""
        return int(self.C.llama_model_n_params(self.ptr))

    def size(self) -> int:
        """Bytes of weights."""
        return int(self.C.llama_model_size(self.ptr))

    def n_ctx_train(self) -> int:
        """Context length the model was trained with."""
        return int(self.C.llama_model_n_ctx_train(self.ptr))

    def n_embd(self) -> int:
        """Embedding width."""
        return int(self.C.llama_model_n_embd(self.ptr))

    def n_head(self) -> int:
        """Query heads (at least 1)."""
        return max(1, int(self.C.llama_model_n_head(self.ptr)))

    def n_head_kv(self) -> int:
        """Key/value heads."""
        return int(self.C.llama_model_n_head_kv(self.ptr))

    def n_layer(self) -> int:
        """Layers."""
        return int(self.C.llama_model_n_layer(self.ptr))

    def n_swa(self) -> int:
        """Sliding-window size (0: none)."""
        return int(self.C.llama_model_n_swa(self.ptr))

    def is_recurrent(self) -> bool:
        """Recurrent memory (no partial ranges)."""
        return bool(self.C.llama_model_is_recurrent(self.ptr))

    def is_hybrid(self) -> bool:
        """Hybrid attention and recurrent memory."""
        return bool(self.C.llama_model_is_hybrid(self.ptr))

    def has_chat_template(self) -> bool:
        """Whether the GGUF holds a default chat template."""
        return bool(self.C.llama_model_chat_template(self.ptr, None))

    def n_vocab(self) -> int:
        """Vocabulary size."""
        return int(self.C.llama_vocab_n_tokens(self.vocab))

    def add_bos(self) -> bool:
        """Whether the vocabulary adds BOS to prompts."""
        return bool(self.C.llama_vocab_get_add_bos(self.vocab))

    def bos(self) -> int:
        """The BOS token (negative: none)."""
        return int(self.C.llama_vocab_bos(self.vocab))

    def eos(self) -> int:
        """The EOS token (negative: none)."""
        return int(self.C.llama_vocab_eos(self.vocab))

    def bos_eos(self) -> tuple[int | None, int | None]:
        """``(BOS, EOS)`` as ``ModelFacts`` holds them: BOS only when the vocabulary adds it
        to prompts; None for one the vocabulary lacks."""
        bos, eos = self.bos(), self.eos()
        return (bos if self.add_bos() and bos >= 0 else None), (eos if eos >= 0 else None)

    def is_eog(self, token: int) -> bool:
        """Whether ``token`` ends generation."""
        return bool(self.C.llama_vocab_is_eog(self.vocab, token))

    def fim(self, role: str) -> int:
        """The fill-in-the-middle token of ``role`` (``pre``, ``suf``, ``mid``, ``pad``,
        ``rep``, ``sep``; negative: none)."""
        return int(getattr(self.C, f"llama_vocab_fim_{role}")(self.vocab))

    def tokenize(self, data: bytes, *, add_special: bool, parse_special: bool) -> list[int]:
        """``llama_tokenize`` on UTF-8 ``data``, growing the buffer as llama.cpp asks."""
        cap = len(data) + 8
        while True:
            buf = (ctypes.c_int32 * cap)()
            n = self.C.llama_tokenize(
                self.vocab, data, len(data), buf, cap, add_special, parse_special
            )
            if n >= 0:
                return list(buf[:n])
            cap = -n

    def piece(self, token: int, *, special: bool, size: int = 64) -> bytes:
        """``llama_token_to_piece``: the token's bytes (special tokens rendered if
        ``special``), growing the buffer as llama.cpp asks."""
        buf = ctypes.create_string_buffer(size)
        n = self.C.llama_token_to_piece(self.vocab, token, buf, size, 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = self.C.llama_token_to_piece(self.vocab, token, buf, -n, 0, special)
        return buf.raw[:n]

    def grammar_sampler(self, grammar: str) -> Any:
        """``llama_sampler_init_grammar`` with root ``root``; NULL (falsy) for invalid GBNF."""
        return self.C.llama_sampler_init_grammar(self.vocab, grammar.encode(), b"root")


_ROW_ADDRESS = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32)
"""``llama_get_logits_ith`` returning the row's address as an int (None for NULL)."""

_MAX_ROW_VIEWS = 4096


def _row_address_of(C: Any) -> Any:
    """``llama_get_logits_ith`` of bindings ``C`` as a :data:`_ROW_ADDRESS` function, or
    None where it is not a ctypes function (a test's stand-in)."""
    try:
        address = ctypes.cast(C.llama_get_logits_ith, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return None
    return _ROW_ADDRESS(address) if address else None


class NativeContext:
    """A ``llama_context`` and its memory; freed by :meth:`close`, before its model.

    :meth:`logits` keeps the views it made by row address: after a decode a step reads the
    same rows of the same output buffer again, and a view made once costs a dictionary
    lookup where a new one cost ``np.ctypeslib.as_array`` (tens of microseconds once a
    decode has gone through the caches). A view is handed out only for the address
    llama.cpp gives for the row now, so it reads what a new view would.
    """

    __slots__ = ("C", "_row_address", "_row_views", "memory", "ptr")

    def __init__(self, C: Any, ptr: Any) -> None:
        self.C, self.ptr = C, ptr
        self.memory = C.llama_get_memory(ptr)
        self._row_address = _row_address_of(C)  # None: bindings that are not ctypes
        self._row_views: dict[int, npt.NDArray[np.float32]] = {}

    @classmethod
    def create(cls, model: NativeModel, cparams: Any) -> NativeContext | None:
        """``llama_init_from_model``, or None when llama.cpp refuses (out of memory?)."""
        ptr = model.C.llama_init_from_model(model.ptr, cparams)
        return cls(model.C, ptr) if ptr else None

    def close(self) -> None:
        """``llama_free``; idempotent."""
        ptr, self.ptr = self.ptr, None
        self._row_views.clear()
        if ptr is not None:
            self.C.llama_free(ptr)

    def n_ctx(self) -> int:
        """KV cells granted."""
        return int(self.C.llama_n_ctx(self.ptr))

    def n_ctx_seq(self) -> int:
        """Cells one sequence may hold."""
        return int(self.C.llama_n_ctx_seq(self.ptr))

    def n_seq_max(self) -> int:
        """Sequence ids."""
        return int(self.C.llama_n_seq_max(self.ptr))

    def n_batch(self) -> int:
        """Most tokens per decode."""
        return int(self.C.llama_n_batch(self.ptr))

    def pooling_type(self) -> int:
        """``llama_pooling_type`` in force."""
        return int(self.C.llama_pooling_type(self.ptr))

    def set_n_threads(self, n_threads: int, n_threads_batch: int) -> None:
        """``llama_set_n_threads``: threads for single-token and for batched micro-batches."""
        self.C.llama_set_n_threads(self.ptr, n_threads, n_threads_batch)

    def decode(self, batch: NativeBatch) -> int:
        """``llama_decode``: 0 on success."""
        return int(self.C.llama_decode(self.ptr, batch.ptr))

    def logits(self, row: int, n_vocab: int) -> npt.NDArray[np.float32]:
        """Zero-copy view of output ``row``'s logits.

        Raises:
            ValueError: llama.cpp has no logits for ``row`` (NULL).
        """
        if self._row_address is None:  # bindings that are not ctypes functions (tests)
            return np.ctypeslib.as_array(self.C.llama_get_logits_ith(self.ptr, row), (n_vocab,))
        address = self._row_address(self.ptr, row)
        if not address:
            raise ValueError(f"llama_get_logits_ith returned NULL for row {row}")
        view = self._row_views.get(address)
        if view is None or len(view) != n_vocab:
            if len(self._row_views) >= _MAX_ROW_VIEWS:  # output buffers moved many times
                self._row_views.clear()
            row_data = (ctypes.c_float * n_vocab).from_address(address)
            view = np.frombuffer(memoryview(row_data), np.float32)
            self._row_views[address] = view
        return view

    def all_logits(self, num_rows: int, n_vocab: int) -> npt.NDArray[np.float32]:
        """Zero-copy view of every output's logits, in batch order."""
        ptr = self.C.llama_get_logits(self.ptr)
        return np.ctypeslib.as_array(ptr, shape=(num_rows, n_vocab))

    def embeddings(self, num_rows: int, n_embd: int) -> npt.NDArray[np.float32]:
        """Zero-copy view of every token's embedding (no pooling)."""
        ptr = self.C.llama_get_embeddings(self.ptr)
        return np.ctypeslib.as_array(ptr, shape=(num_rows, n_embd))

    def seq_embedding(self, seq_id: int, n_embd: int) -> npt.NDArray[np.float32] | None:
        """Zero-copy view of ``seq_id``'s pooled embedding, or None when none was pooled."""
        ptr = self.C.llama_get_embeddings_seq(self.ptr, seq_id)
        return np.ctypeslib.as_array(ptr, shape=(n_embd,)) if ptr else None

    def can_shift(self) -> bool:
        """``llama_memory_can_shift``."""
        return bool(self.C.llama_memory_can_shift(self.memory))

    def clear(self) -> None:
        """``llama_memory_clear`` (data too)."""
        self.C.llama_memory_clear(self.memory, True)

    def seq_rm(self, seq_id: int, p0: int, p1: int) -> bool:
        """``llama_memory_seq_rm``."""
        return bool(self.C.llama_memory_seq_rm(self.memory, seq_id, p0, p1))

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        """``llama_memory_seq_cp``."""
        self.C.llama_memory_seq_cp(self.memory, src, dst, p0, p1)

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        """``llama_memory_seq_add``."""
        self.C.llama_memory_seq_add(self.memory, seq_id, p0, p1, delta)

    def seq_pos_min(self, seq_id: int) -> int:
        """``llama_memory_seq_pos_min``."""
        return int(self.C.llama_memory_seq_pos_min(self.memory, seq_id))

    def seq_pos_max(self, seq_id: int) -> int:
        """``llama_memory_seq_pos_max``."""
        return int(self.C.llama_memory_seq_pos_max(self.memory, seq_id))

    def state_seq_get(self, seq_id: int, *, partial: bool = False) -> bytes:
        """``llama_state_seq_get_data_ext``: one sequence's state, as llama.cpp writes it;
        with ``partial``, only what cannot be cut at a position (``LLAMA_STATE_SEQ_FLAGS_
        PARTIAL_ONLY``: a recurrent state, a sliding window's cells), none of the full
        attention cells."""
        flags = self.C.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY if partial else 0
        size = int(self.C.llama_state_seq_get_size_ext(self.ptr, seq_id, flags))
        buf = (ctypes.c_uint8 * size)()
        written = int(self.C.llama_state_seq_get_data_ext(self.ptr, buf, size, seq_id, flags))
        # one copy: slicing the ctypes array would build a list of ints (0.5 s for 28 MB)
        return ctypes.string_at(buf, written)

    def state_seq_set(self, seq_id: int, data: bytes, *, partial: bool = False) -> bool:
        """``llama_state_seq_set_data_ext``; False when llama.cpp refuses it. With
        ``partial``, ``data`` is a partial state (:meth:`state_seq_get`) and the sequence's
        full attention cells are left as they are."""
        flags = self.C.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY if partial else 0
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        return int(self.C.llama_state_seq_set_data_ext(self.ptr, buf, len(data), seq_id, flags)) > 0


class NativeBatch:
    """A ``llama_batch`` of ``n_tokens`` rows, one sequence id each, with numpy views of its
    token, position and output-flag arrays; freed by :meth:`close`, before its context."""

    __slots__ = ("C", "logits", "pos", "ptr", "seq_rows", "tokens")

    def __init__(self, C: Any, n_tokens: int) -> None:
        self.C = C
        self.ptr = ptr = C.llama_batch_init(n_tokens, 0, 1)
        self.tokens = np.ctypeslib.as_array(ptr.token, shape=(n_tokens,))
        self.pos = np.ctypeslib.as_array(ptr.pos, shape=(n_tokens,))
        self.logits = np.ctypeslib.as_array(ptr.logits, shape=(n_tokens,))
        np.ctypeslib.as_array(ptr.n_seq_id, shape=(n_tokens,))[:] = 1
        self.seq_rows = [ptr.seq_id[i] for i in range(n_tokens)]
        """Row ``i``'s sequence ids: write its one id at ``seq_rows[i][0]``."""

    def set_n_tokens(self, n: int) -> None:
        """How many rows the next decode reads."""
        self.ptr.n_tokens = n

    def close(self) -> None:
        """``llama_batch_free``; idempotent."""
        ptr, self.ptr = self.ptr, None
        if ptr is not None:
            self.C.llama_batch_free(ptr)


def first_max(logits: npt.NDArray[np.float32], sampler: NativeSampler) -> int:
    """The first index of the largest ``logits + bias`` (``sampler``'s bias), reading
    ``logits`` without changing it."""
    best = int(np.argmax(logits))
    if not sampler.bias_set or (sampler.bias_lowers and best not in sampler.bias_set):
        return best  # a lowered token cannot overtake, nor tie earlier than, the maximum
    biased = logits.copy()
    biased[sampler.bias_ids] += sampler.bias_values
    return int(np.argmax(biased))


FEW_ROW_VALUES = 1 << 18
"""A step whose host-chain rows hold at most this many logits in all (5 rows of a 49,152
vocabulary, 2 of 128,256) samples each with llama.cpp's whole chain: one stream's sampled
step on a 2-core AMD EPYC, SmolLM2, spent 0.65 ms outside ``llama_decode`` with the chain
against 1.11 ms with the vectorised passes (medians of 6 alternated runs;
``benchmarks/results/issue62/n1-overhead``); ``benchmarks/host_sampling.py`` puts the
crossing at 4-8 rows there and 1-2 at 128,256."""


def sample_on_host(
    samplers: Sequence[NativeSampler], rows: Sequence[npt.NDArray[np.float32]]
) -> list[int]:
    """The tokens of samplers with a host chain, each from its logits row, all together
    (:func:`~llamax.backend.host_sampling.sample_rows`); a row left to llama.cpp's order
    goes through the sampler's :meth:`~NativeSampler.pick`, with the same draw.

    Rows that lie one after another in one buffer (a step's outputs, one per sequence) are
    read in place, the biases added there and taken back exactly afterwards (the values
    they replaced are kept); other rows are copied into one matrix first."""
    draws = [s.uniform() for s in samplers if s.rng is not None]
    chains = [s.host for s in samplers if s.host is not None]
    block = _consecutive(rows)
    saved = []
    if block is None:
        block = np.stack(rows)
    else:
        saved = [(i, c.bias_ids, block[i, c.bias_ids]) for i, c in enumerate(chains)]
    try:
        picks = sample_rows(chains, block, draws)
    finally:
        for i, ids, values in saved:
            block[i, ids] = values
    tokens = []
    for sampler, row, u, token in zip(samplers, rows, draws, picks, strict=True):
        tokens.append(token if token is not None else sampler.pick(row, u))
    return tokens


def _consecutive(rows: Sequence[npt.NDArray[np.float32]]) -> npt.NDArray[np.float32] | None:
    """One writable view of ``rows`` when each starts where the one before ends."""
    first = rows[0]
    size = first.nbytes
    start = first.ctypes.data
    if not all(
        r.flags.c_contiguous and r.ctypes.data == start + i * size for i, r in enumerate(rows)
    ):
        return None
    ptr = ctypes.cast(start, ctypes.POINTER(ctypes.c_float))
    return np.ctypeslib.as_array(ptr, shape=(len(rows), first.size))


class NativeSampler:
    """One sequence's sampler chain, plus its grammar sampler kept outside the chain (see
    :meth:`LlamaCppBackend.sample <llamax.backend.llama_cpp.LlamaCppBackend.sample>`);
    freed by :meth:`close`, before the model whose vocabulary the grammar reads.

    Greedy with at most a logit bias (no penalties or grammar: ``chain`` None, ``argmax``)
    builds no chain: its token is the first maximum of the biased row, which is what
    llama.cpp's ``logit_bias`` then ``greedy`` samplers pick, read with one vectorised pass
    over the logits instead of a candidate array of ``n_vocab`` entries per row. When
    every bias lowers its token (banned tokens, ``ignore_eos``) and the row's maximum is
    not one of them, that maximum is the answer; otherwise a biased copy of the row is
    searched.

    A sampler with a ``host`` chain (:mod:`~llamax.backend.host_sampling`) draws on the host
    with ``rng``, its own copy of ``dist``'s generator: ``chain`` then holds llama.cpp's
    filters without ``dist``, run only for a row whose equal logits leave the order to them.
    ``full`` is llama.cpp's whole chain of the same seed, for steps of few rows
    (:data:`FEW_ROW_VALUES`), where one C call beats the vectorised passes; ``lead`` counts
    the draws ``full``'s generator has made beyond the host copy's (negative: fewer), and
    the one behind skips them before its next draw, so the tokens are those of one
    generator whichever samples a step.

    A ``graph`` sampler (:mod:`~llamax.backend.graph_sampling`) holds llama.cpp's whole chain
    (``dist`` or ``greedy`` included), which llama.cpp may run inside the decode's graph for
    the sequence id it is attached to (``seq_id``, None while it is not). llama.cpp aborts
    the process if a chain is attached twice in its life or sampled on the host after an
    attach, so a detached chain is never used again: :meth:`renew` swaps in a clone (its
    state, the generator and the penalties' counts, carried over) and frees it.
    """

    __slots__ = (
        "C",
        "argmax",
        "banned",
        "bias_ids",
        "bias_lowers",
        "bias_set",
        "bias_values",
        "candidates",
        "chain",
        "full",
        "grammar",
        "graph",
        "host",
        "is_greedy",
        "lead",
        "n_vocab",
        "rng",
        "seq_id",
    )

    def __init__(
        self,
        C: Any,
        chain: Any,
        grammar: Any,
        banned: list[int],
        n_vocab: int,
        *,
        argmax: bool = False,
        bias: dict[int, float] | None = None,
        is_greedy: bool = False,
        host: HostChain | None = None,
        rng: ChainRng | None = None,
        graph: bool = False,
        full: Any = None,
    ) -> None:
        self.C, self.chain, self.grammar = C, chain, grammar
        self.host, self.rng = host, rng
        self.full = full
        self.lead = 0
        self.graph = graph
        """Whether llama.cpp may run the chain in the graph (cleared if it refuses)."""
        self.seq_id: int | None = None
        """The sequence id the chain is attached to, for graph sampling; None if none."""
        self.argmax, self.n_vocab = argmax, n_vocab
        self.is_greedy = is_greedy or argmax
        self.banned = np.asarray(banned, dtype=np.int64)
        bias = bias or {}
        self.bias_ids = np.fromiter(bias, dtype=np.int64, count=len(bias))
        self.bias_values = np.fromiter(bias.values(), dtype=np.float32, count=len(bias))
        self.bias_lowers = bool(np.all(self.bias_values < 0))
        self.bias_set = frozenset(bias)
        self.candidates: npt.NDArray[np.void] | None = None
        if grammar is not None:
            self.candidates = np.zeros(n_vocab, dtype=_CANDIDATE)
            self.candidates["id"] = np.arange(n_vocab, dtype=np.int32)

    def sample(self, context: NativeContext, row: int) -> int:
        """``llama_sampler_sample`` with the chain (which also accepts the token), the host
        chain's draw, or the biased row's first maximum for a greedy sampler without a chain."""
        if self.host is not None:
            return self.sample_full(context, row)
        if not self.argmax:
            return int(self.C.llama_sampler_sample(self.chain, context.ptr, row))
        return first_max(context.logits(row, self.n_vocab), self)

    def sample_full(self, context: NativeContext, row: int) -> int:
        """A host chain's row sampled by llama.cpp's whole chain (``full``), after its
        ``dist`` has caught up with the host copy's draws."""
        if self.lead < 0:  # dist draws once for a one-candidate array
            last = self.C.llama_sampler_chain_n(self.full) - 1
            dist = self.C.llama_sampler_chain_get(self.full, last)
            one = (self.C.llama_token_data * 1)(self.C.llama_token_data(0, 0.0, 0.0))
            data = self.C.llama_token_data_array(one, 1, -1, False)
            for _ in range(-self.lead):
                self.C.llama_sampler_apply(dist, ctypes.byref(data))
            self.lead = 0
        self.lead += 1
        return int(self.C.llama_sampler_sample(self.full, context.ptr, row))

    def uniform(self) -> float:
        """The host copy's next draw, after it has caught up with ``full``'s draws."""
        assert self.rng is not None
        if self.lead > 0:
            self.rng.skip(self.lead)
            self.lead = 0
        self.lead -= 1
        return self.rng.uniform()

    def pick(self, logits: npt.NDArray[np.float32], u: float) -> int:
        """A host chain's token for a row it left to llama.cpp's order: llama.cpp's filters
        on the row, then ``dist`` with the draw ``u`` here."""
        kept, _ = self._apply(logits)
        return int(kept["id"][pick(kept["logit"], u)[0]])

    def draw(self, context: NativeContext, row: int) -> tuple[npt.NDArray[np.void], int]:
        """:meth:`sample` with a chain, done as ``llama_sampler_sample`` does it (the chain
        applied to a candidate array of the row, the selected token accepted), on an array
        it returns: the candidates the chain kept, with the probabilities its last sampler
        (``dist``) gave them, and the index of the selected one. A host chain's ``dist``
        runs here, after llama.cpp's filters."""
        kept, selected = self._apply(context.logits(row, self.n_vocab))
        if self.host is not None:
            assert self.rng is not None
            selected, kept["p"] = pick(kept["logit"], self.uniform())
            return kept, selected
        self.C.llama_sampler_accept(self.chain, int(kept["id"][selected]))
        return kept, selected

    def _apply(self, logits: npt.NDArray[np.float32]) -> tuple[npt.NDArray[np.void], int]:
        """The chain applied to a candidate array of ``logits``: the candidates it kept, in
        its order, and the index it selected (-1 without ``dist``)."""
        candidates = np.empty(self.n_vocab, dtype=_CANDIDATE)
        candidates["id"] = np.arange(self.n_vocab, dtype=np.int32)
        candidates["logit"] = logits
        candidates["p"] = 0.0
        data = self.C.llama_token_data_array(
            candidates.ctypes.data_as(self.C.llama_token_data_p), self.n_vocab, -1, False
        )
        self.C.llama_sampler_apply(self.chain, ctypes.byref(data))
        return candidates[: data.size], int(data.selected)

    def renew(self) -> None:
        """Replace a chain that was attached (and is no longer) by a clone of it: the same
        samplers and state, never attached, so it may be sampled on the host or attached
        again; the old chain is freed."""
        old, self.chain = self.chain, self.C.llama_sampler_clone(self.chain)
        self.seq_id = None
        self.C.llama_sampler_free(old)

    def accept_grammar(self, token: int) -> None:
        """Advance the grammar past ``token``."""
        self.C.llama_sampler_accept(self.grammar, token)

    def apply_grammar(self, data: Any) -> None:
        """``llama_sampler_apply`` of the grammar to a ``llama_token_data_array``."""
        self.C.llama_sampler_apply(self.grammar, ctypes.byref(data))

    def close(self) -> None:
        """Free the chain, llama.cpp's whole chain (a host chain's), then the grammar, each
        even when one before raised; idempotent."""
        chain, grammar, self.chain, self.grammar = self.chain, self.grammar, None, None
        full, self.full = self.full, None
        try:
            if chain is not None:
                self.C.llama_sampler_free(chain)
        finally:
            try:
                if full is not None:
                    self.C.llama_sampler_free(full)
            finally:
                if grammar is not None:
                    self.C.llama_sampler_free(grammar)
