"""The fake backend: :class:`FakeBackend`, its checks on what the engine sends, and fault
injection (:data:`FAULT_POINTS`). Its KV memory is :mod:`~llamax.testing.memory`, its
vocabulary and sampling :mod:`~llamax.testing.model`."""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import numpy.typing as npt

from ..adapters import AdapterSet
from ..backend.base import BatchItem, DecodeStatus, Drawn, SharedPrefix
from ..backend.vision import MediaPrompt, RgbImage
from ..config import KV_TYPES, kv_row_bytes
from ..errors import ContextClosedError, ImageError
from ..facts import ModelFacts
from ..params import SamplingParams
from ..tokens import FimTokens
from .memory import FakeMemory
from .model import (
    EOS,
    FakeAdapters,
    FakeSampler,
    FakeVocab,
    alphabet_model,
    draw,
    row_logits,
    sample,
)
from .vision import FAKE_N_EMBD, FakeVision, ids_of_rows

__all__ = ["FAKE_KV_VALUES", "FAULT_POINTS", "FakeBackend"]

FAKE_KV_VALUES = 256
"""The K values of a fake KV cell (as many V): 1024 bytes a cell in ``f16``."""

FAULT_POINTS = (
    "tokenize",
    "decode",
    "logits",
    "batch_logits",
    "new_sampler",
    "sample",
    "free_sampler",
    "seq_rm",
    "seq_cp",
    "seq_add",
    "seq_pos_min",
    "run_queued_copies",
    "state_seq_get",
    "state_seq_set",
    "relayout",
    "fill_cells",
    "encode_image",
    "decode_embeddings",
    "close",
)
"""Every backend call that :attr:`FakeBackend.fault` can make fail, by the name it is
given. The protocol has no ``seq_keep`` and no abort callback: llamax calls neither."""

_FIM_TEXTS = (("prefix", "fim_prefix"), ("suffix", "fim_suffix"), ("middle", "fim_middle"),
              ("pad", "fim_pad"), ("repo", "repo_name"), ("separator", "file_sep"))  # fmt: skip


class FakeBackend:
    """Pure-Python backend with a scripted next-token function and a checked KV model.

    Besides :class:`~llamax.backend.base.Backend` it implements
    :class:`~llamax.backend.base.Inspectable` (``seq_tokens``, ``num_cells_used``,
    ``num_live_samplers``), so ``Context.audit()`` also checks the tokens and cells it holds.

    ``graph_sampling`` models llama.cpp's backend sampling
    (:class:`~llamax.backend.base.GraphSampling`) with its rules checked: a chain attached
    twice in its life, a row the graph sampled read as logits, or a row the graph sampled
    asked of another sampler raise AssertionError (llama.cpp would abort, or answer from
    rows it never copied); a chain leaving its id is renewed, as the llama.cpp backend's.

    ``kv_type`` (and ``kv_type_v``, V's where it differs) model a quantized KV cache as
    llama.cpp holds one: :attr:`kv_bytes_per_cell` is the types' size of a cell, the model
    identity names them (so a session file or a disk-tier entry of other types is refused),
    and a state of other types does not load. ``sized_states`` makes every whole state as
    long as its cells take (:meth:`state_seq_get`), for tests of what counts bytes.
    """

    def __init__(
        self,
        *,
        n_ctx: int = 256,
        n_seq_max: int = 4,
        n_batch: int = 64,
        next_token: Callable[[Sequence[int]], int] = alphabet_model,
        extra_pieces: Mapping[int, bytes] | None = None,
        model_name: str = "fake",
        can_share_prefix: bool = True,
        recurrent: bool = False,
        sliding_window: int | None = None,
        can_shift: bool = True,
        metadata: Mapping[str, str] | None = None,
        special_tokens: Mapping[str, int] | None = None,
        eog_token_ids: Sequence[int] = (EOS,),
        kv_layout: str = "unified",
        cpu_attention: bool = True,
        attention_tiles: tuple[int, int] | None = None,
        stream_cells: int | None = None,
        log_decodes: bool = True,
        step_seconds: Callable[[Sequence[BatchItem]], float] | None = None,
        weights: str = "w0",
        n_threads: int = 1,
        runnable_tasks: Callable[[], int | None] | None = None,
        image_tokens: int | None = None,
        non_causal_images: bool = False,
        n_ubatch: int | None = None,
        kv_type: str = "f16",
        kv_type_v: str | None = None,
        sized_states: bool = False,
        graph_sampling: bool = False,
    ) -> None:
        self._n_ctx, self._n_seq_max, self._n_batch = n_ctx, n_seq_max, n_batch
        self._graph_sampling = graph_sampling
        self._attached: dict[int, FakeSampler] = {}
        self._graph_rows: dict[int, FakeSampler] = {}
        self.num_attaches = 0
        """Chains attached to a sequence id (graph sampling), each a graph reservation."""
        self.num_graph_draws = 0
        """Rows sampled in the decode (graph sampling)."""
        types = (kv_type, kv_type_v or kv_type)
        if any(t not in KV_TYPES for t in types):
            raise ValueError(f"kv_type and kv_type_v must be among {KV_TYPES}, got {types}")
        self._kv_cache = "/".join(t.upper() for t in types)
        self._kv_bytes_per_cell = sum(kv_row_bytes(t, FAKE_KV_VALUES) for t in types)
        self._sized_states = sized_states
        self._n_ubatch = n_batch if n_ubatch is None else n_ubatch
        self._vision = (
            None
            if image_tokens is None
            else FakeVision(image_tokens, non_causal_images, lambda t: self.tokenize(t))
        )  # a projector: prompts may hold images (:mod:`~llamax.testing.vision`)
        self._stream_cells = n_ctx // n_seq_max if stream_cells is None else stream_cells
        if kv_layout not in ("unified", "streams", "auto"):
            raise ValueError(f"kv_layout must be 'unified', 'streams' or 'auto', got {kv_layout!r}")
        self._can_relayout = kv_layout == "auto"
        self._cpu_attention = cpu_attention
        self._attention_tiles = attention_tiles
        self.num_relayouts = 0
        self._next_token = next_token
        self._vocab = FakeVocab(extra_pieces, special_tokens)
        specials = self._vocab.specials
        self._facts = ModelFacts(
            model_name=model_name,
            n_vocab=max(self._vocab.pieces) + 1,
            n_embd=FAKE_N_EMBD,
            n_ctx_train=n_ctx,
            n_ctx=n_ctx,
            n_ctx_seq=n_ctx if kv_layout != "streams" else self._stream_cells,
            n_seq_max=n_seq_max,
            fim_tokens=FimTokens(**{name: specials.get(f"<{text}>") for name, text in _FIM_TEXTS}),
            sees_images=self._vision is not None,
            eos_token_id=EOS,  # the fake vocabulary adds no BOS
        )
        self._weights = weights
        self._memory = FakeMemory(
            n_seq_max,
            is_unified=kv_layout == "unified",
            model=weights,
            recurrent=recurrent,
            kv_cache=self._kv_cache,
        )
        self.cells = self._memory.cells
        """Tokens each sequence id holds in the fake KV cache, by position."""
        self._can_share = can_share_prefix and not recurrent
        self._window = sliding_window
        self._can_shift_positions = can_shift
        self._metadata = dict(metadata or {})
        self._eog = frozenset(eog_token_ids)
        self._adapters = FakeAdapters()
        self.decode_adapters: list[AdapterSet] = []
        """The adapter set of every successful decode, in order (with ``log_decodes``)."""
        self.decode_log: list[tuple[BatchItem, ...]] = []
        """Every successful decode's items, in order (empty with ``log_decodes=False``,
        which soak tests use: the log grows with every step)."""
        self._log_decodes = log_decodes
        self._step_seconds = step_seconds
        self._clock = 0.0
        self._n_threads = n_threads
        self._runnable_tasks = runnable_tasks
        self.thread_log: list[int] = []
        """Every thread count :meth:`set_n_threads` was given, in order."""
        self.pooled_threads: set[int] = set()
        """Idents of the threads that computed (a decode, an image encoded) and have not
        called :meth:`release_compute_threads` since: those that would keep OpenMP workers
        under llama.cpp's CPU backend (:class:`~llamax.backend.base.ComputeThreads`)."""
        self.num_thread_releases = 0
        """How many times :meth:`release_compute_threads` was called."""
        self.forced_statuses: deque[int] = deque()
        """Statuses to return from the next decodes instead of running them."""
        self.fault: Callable[[str], object] | None = None
        """Fault injection: called with the call's name (one of :data:`FAULT_POINTS`) before
        every backend call the engine makes. It may raise to make that call fail, or return
        a value other than None to make a call that reports failure by its result fail that
        way: ``decode`` returns it as its status, ``state_seq_set`` and a partial ``seq_rm``
        return False (llama.cpp never refuses a whole removal). ``None`` lets the call run."""
        self.fault_calls: Counter[str] = Counter()
        """How many times each fault point was reached (with or without ``fault`` set)."""
        self.live_samplers: set[int] = set()
        self.closed = False
        self._rows: dict[int, int] = {}  # batch row -> output index
        self._logits = np.zeros((0, self._facts.n_vocab), np.float32)

    # ------------------------------------------------------------------ facts
    @property
    def facts(self) -> ModelFacts:
        """As configured: ``model_name``, ``n_ctx`` (also ``n_ctx_train``), ``n_seq_max``;
        ``n_ctx_seq`` is ``n_ctx``, or each stream's ``stream_cells`` with
        ``kv_layout="streams"``; ``n_vocab`` covers every piece; ``n_embd`` is
        :data:`~llamax.testing.vision.FAKE_N_EMBD`; ``fim_tokens`` are found by their text
        among ``special_tokens`` (``<fim_prefix>``, ``<fim_suffix>``, ``<fim_middle>``,
        ``<fim_pad>``, ``<repo_name>``, ``<file_sep>``), as llama.cpp does;
        ``sees_images`` with ``image_tokens`` (a fake projector,
        :mod:`~llamax.testing.vision`); no BOS, token 0 the EOS."""
        return self._facts

    @property
    def kv_cells(self) -> int:
        """Cells the current layout holds: ``n_ctx``, or ``stream_cells`` per sequence with
        streams (llama.cpp pads each stream to 256 cells, so streams may hold more)."""
        return self._n_ctx if self._memory.is_unified else self._stream_cells * self._n_seq_max

    @property
    def is_unified(self) -> bool:
        """As configured by ``kv_layout`` (``"auto"`` starts with streams)."""
        return self._memory.is_unified

    @property
    def n_ctx_stream(self) -> int:
        """``n_ctx`` when unified, ``stream_cells`` (``n_ctx // n_seq_max``) with streams."""
        return self._n_ctx if self._memory.is_unified else self._stream_cells

    @property
    def can_relayout(self) -> bool:
        """With ``kv_layout="auto"``."""
        return self._can_relayout

    def relayout(self, unified: bool, shared: Sequence[SharedPrefix] = ()) -> None:
        """Switch layouts as llama.cpp does: every sequence gets cells of its own, except
        ``shared`` ones moving to the unified layout (tagged on their sources' cells).

        Raises:
            RequestFailedError: the sequences hold more cells than the new layout has (as
                llama.cpp refuses a sequence's state it cannot place).
            AssertionError: a share whose sequence holds anything but its source's first
                tokens, as computed (it would read another sequence's KV).
        """
        if not self._can_relayout:
            raise AssertionError("relayout without kv_layout='auto'")
        self._fault("relayout")
        if unified == self._memory.is_unified:
            return
        limit = self._n_ctx if unified else self._stream_cells
        self._memory.relayout(unified, limit, self._n_ctx, shared if unified else ())
        self.num_relayouts += 1
        self._release_chains()  # a new llama.cpp context: the chains are renewed for it

    @property
    def cpu_only(self) -> bool:
        """As ``cpu_attention`` (a fake with GPU attention acts like a GPU build)."""
        return self._cpu_attention

    @property
    def cpu_attention(self) -> bool:
        """As configured by ``cpu_attention`` (True: act like ggml's CPU backend)."""
        return self._cpu_attention

    @property
    def attention_tiles(self) -> tuple[int, int] | None:
        """As configured by ``attention_tiles`` (None: the cost model counts no tiles)."""
        return self._attention_tiles

    @property
    def kv_bytes_per_cell(self) -> int:
        """What a cell of :data:`FAKE_KV_VALUES` K and as many V values takes at the
        fake's ``kv_type`` (and ``kv_type_v``), as llama.cpp counts it: 1024 bytes in
        ``f16``, 544 in ``q8_0``, 288 in ``q4_0`` (:func:`~llamax.config.kv_row_bytes`)."""
        return self._kv_bytes_per_cell

    @property
    def n_batch(self) -> int:
        """Most tokens per decode."""
        return self._n_batch

    @property
    def num_cells_used(self) -> int:
        """Distinct cells held by any sequence (copied prefixes share cells)."""
        return self._memory.num_cells_used

    @property
    def num_copies(self) -> int:
        """``seq_cp`` calls so far."""
        return self._memory.num_copies

    @property
    def num_shifts(self) -> int:
        """``seq_add`` calls so far."""
        return self._memory.num_shifts

    @property
    def can_checkpoint(self) -> bool:
        """True with ``recurrent``: a checkpoint sets a sequence's state back."""
        return self._memory.recurrent

    @property
    def can_share_prefix(self) -> bool:
        """As configured (False mimics recurrent memory)."""
        return self._can_share

    @property
    def num_live_samplers(self) -> int:
        """Samplers not yet freed."""
        return len(self.live_samplers)

    # ------------------------------------------------------------------ text
    def token_text(self, token: int) -> str:
        """The token's bytes as text; special tokens by name."""
        return self._vocab.token_text(token)

    def metadata(self, key: str) -> str | None:
        """Values passed as ``metadata=``."""
        return self._metadata.get(key)

    def tokenize(
        self, text: str, *, add_special: bool = True, parse_special: bool = True
    ) -> list[int]:
        """One token per UTF-8 byte; ``special_tokens`` are parsed when ``parse_special``
        (user-defined ones, those ``extra_pieces`` renders, always)."""
        self._check_open()
        self._fault("tokenize")
        return self._vocab.tokenize(text, parse_special)

    def token_to_piece(self, token: int) -> bytes:
        """The bytes of a token."""
        self._check_open()
        if token < 0:
            raise AssertionError(f"an image's placeholder id {token} reached detokenization")
        return self._vocab.pieces[token]

    def is_eog(self, token: int) -> bool:
        """Token 0 (and any ``eog_token_ids``) ends generation."""
        return token in self._eog

    # ------------------------------------------------------------------ compute
    def decode(self, items: Sequence[BatchItem]) -> int:
        """Check and apply a batch; remember the next token of every row that wants logits."""
        self.pooled_threads.add(threading.get_ident())
        status = self._faulted("decode")
        if status is not None:
            return status
        if any(i.embeddings is not None or min(i.token_ids, default=0) < 0 for i in items):
            raise AssertionError(f"an image's placeholder ids reached a token decode: {items!r}")
        num = sum(len(i.token_ids) for i in items)
        status = self._admit(items, num)
        if status is not None:
            return status
        self._rows.clear()
        self._bind(items)
        self._logits = np.zeros((sum(len(i.rows) for i in items), self._facts.n_vocab), np.float32)
        offset = 0
        for item in items:
            known = self._memory.history(item.seq_id, item.start_pos)
            for row in item.rows:
                if not offset <= row < offset + len(item.token_ids):
                    raise AssertionError(f"row {row} is outside its item {item!r}")
                history = known + list(item.token_ids[: row - offset + 1])
                self._rows[row] = len(self._rows)
                token = self._adapters.shift(self._next_token(history), self._memory.adapters)
                self._logits[len(self._rows) - 1] = row_logits(token, self._facts.n_vocab)
            self._memory.store(item.seq_id, item.token_ids)
            offset += len(item.token_ids)
        self._applied(items)
        return DecodeStatus.OK

    # ------------------------------------------------------------------ graph sampling
    @property
    def samples_in_graph(self) -> bool:
        """``graph_sampling`` (:class:`~llamax.backend.base.GraphSampling`)."""
        return self._graph_sampling

    @property
    def num_attached(self) -> int:
        """Chains attached to sequence ids now (graph sampling)."""
        return len(self._attached)

    def _bind(self, items: Sequence[BatchItem]) -> None:
        """As :meth:`GraphChains.bind <llamax.backend.graph_sampling.GraphChains.bind>`:
        every item with rows holds its graph sampler's chain, or none."""
        self._graph_rows.clear()
        if not self._graph_sampling:
            return
        for item in items:
            if not item.rows:
                continue
            want = item.sampler
            if not isinstance(want, FakeSampler) or not want.graph or len(item.rows) != 1:
                want = None
            have = self._attached.get(item.seq_id)
            if have is not want:
                if have is not None:
                    self._detach(have)
                if want is not None:
                    if want.seq_id is not None:
                        self._detach(want)
                    if want.attached_once:
                        raise AssertionError("a chain attached twice in its life aborts llama.cpp")
                    want.seq_id, want.attached_once = item.seq_id, True
                    self._attached[item.seq_id] = want
                    self.num_attaches += 1
            if want is not None:
                self._graph_rows[item.rows[0]] = want

    def _detach(self, sampler: FakeSampler) -> None:
        """Detach and renew (a clone with the same state, never attached)."""
        assert sampler.seq_id is not None and self._attached[sampler.seq_id] is sampler
        del self._attached[sampler.seq_id]
        sampler.seq_id, sampler.attached_once = None, False

    def _release_chains(self) -> None:
        for sampler in list(self._attached.values()):
            self._detach(sampler)
        self._graph_rows.clear()

    def _faulted(self, point: str) -> int | None:
        """A decode's injected status at ``point`` (llama.cpp's memory update runs before
        the statuses that come after it), or None to go on."""
        if self.closed:
            raise RuntimeError(f"{point} on a closed FakeBackend")
        status = self._fault(point)
        if status is not None:
            assert isinstance(status, int), f"a decode fault must be a status, got {status!r}"
            if status in (DecodeStatus.OK, DecodeStatus.NO_SLOT, DecodeStatus.ABORTED):
                self._memory.run_queue()
        return status

    def _admit(self, items: Sequence[BatchItem], num: int) -> int | None:
        """What llama.cpp answers a batch of ``num`` rows before computing it: -1 for an
        empty or oversized batch or a sequence twice, a forced status, ``NO_SLOT`` where
        its cells do not fit; None to compute it (the queued copies have run)."""
        if not num or num > self._n_batch or len({i.seq_id for i in items}) != len(items):
            return -1
        self._memory.run_queue()
        if self.forced_statuses:
            return self.forced_statuses.popleft()
        if self.num_cells_used + num > self.kv_cells or any(
            len(self.cells[i.seq_id]) + len(i.token_ids) > self.n_ctx_stream for i in items
        ):
            return DecodeStatus.NO_SLOT
        return None

    def _applied(self, items: Sequence[BatchItem]) -> None:
        """After a decode applied ``items``: its log entry, and the fake clock's time."""
        if self._log_decodes:
            self.decode_log.append(tuple(items))
            self.decode_adapters.append(self._memory.adapters)
        if self._step_seconds is not None:
            self._clock += self._step_seconds(items)

    # ------------------------------------------------------------------ images
    @property
    def projector_identity(self) -> dict[str, object] | None:
        """The fake projector's settings (None without one): another ``image_tokens`` or
        causality is another projector."""
        vision = self._vision
        return (
            None if vision is None else {"fake": vision.n_tokens, "non_causal": vision.non_causal}
        )

    def _fake_vision(self) -> FakeVision:
        if self._vision is None:
            raise ImageError("this fake backend has no projector (image_tokens=None)")
        return self._vision

    @property
    def image_marker(self) -> str:
        """The fake projector's marker ("" without one)."""
        return self._vision.marker if self._vision is not None else ""

    def max_image_rows(self, non_causal: bool) -> int:
        """``n_ubatch`` for a non-causal image, ``n_batch`` for a causal one."""
        return self._n_ubatch if non_causal else self._n_batch

    def read_image(self, data: bytes) -> RgbImage:
        """Any file whose image header reads: its bytes are its pixels."""
        return self._fake_vision().read(data)

    def tokenize_images(
        self, text: str, images: Sequence[RgbImage], *, add_special: bool = True
    ) -> MediaPrompt:
        """Text chunks, one token a byte, and ``image_tokens`` positions an image (the
        fake adds no BOS, so ``add_special`` changes nothing)."""
        return self._fake_vision().tokenize(text, images)

    def encode_image(self, chunk: object) -> npt.NDArray[np.float32]:
        """Rows that encode the chunk's placeholder ids (:mod:`~llamax.testing.vision`)."""
        self.pooled_threads.add(threading.get_ident())  # a failing encode may have computed
        self._fault("encode_image")
        return self._fake_vision().encode(chunk)  # type: ignore[arg-type]

    def release_compute_threads(self) -> None:
        """Forget the calling thread in :attr:`pooled_threads`.
        (:class:`~llamax.backend.base.ComputeThreads`)"""
        self.pooled_threads.discard(threading.get_ident())
        self.num_thread_releases += 1

    def decode_embeddings(self, items: Sequence[BatchItem], *, non_causal: bool) -> int:
        """Check and apply a batch of image rows, as :meth:`decode` a batch of tokens. Each
        cell's provenance is the ids its row encodes (:meth:`FakeMemory.store_embedded`).

        Raises:
            ValueError: a non-causal batch over ``n_ubatch`` rows (llama.cpp would abort).
            AssertionError: an item without embeddings, or of the other attention.
        """
        self.pooled_threads.add(threading.get_ident())
        status = self._faulted("decode_embeddings")
        if status is not None:
            return status
        for item in items:
            e = item.embeddings
            if e is None or len(e) != len(item.token_ids) or item.rows:
                raise AssertionError(f"not an image item (rows of embeddings, no output): {item!r}")
            if item.non_causal != non_causal:
                raise AssertionError(f"a {'non-' * non_causal}causal decode got {item!r}")
        num = sum(len(i.token_ids) for i in items)
        if non_causal and num > self._n_ubatch:
            raise ValueError(f"{num} non-causal rows do not fit a micro-batch of {self._n_ubatch}")
        status = self._admit(items, num)
        if status is not None:
            return status
        self._rows.clear()
        self._logits = np.zeros((0, self._facts.n_vocab), np.float32)
        for item in items:
            self._memory.history(item.seq_id, item.start_pos)  # reads only its own cells
            assert item.embeddings is not None
            inputs = ids_of_rows(item.embeddings)
            self._memory.store_embedded(item.seq_id, item.token_ids, inputs)
        self._applied(items)
        return DecodeStatus.OK

    def run_queued_copies(self) -> None:
        """Run the queued stream copies now, as the next decode would."""
        self._fault("run_queued_copies")
        self._memory.run_queue()

    def load_adapter(self, name: str, path: str) -> None:
        """Accept any file that starts with ``GGUF`` as an adapter; under it, lower-case
        letters the model picks move along the alphabet (:class:`FakeAdapters`).
        (:class:`~llamax.backend.base.LoraHost`)

        Raises:
            ModelLoadError: no such file, or it does not start with ``GGUF``.
        """
        self._fault("load_adapter")
        self._adapters.load(name, path)

    def set_adapters(self, adapters: AdapterSet) -> None:
        """Run the next decodes under ``adapters``."""
        self._fault("set_adapters")
        self._adapters.check(adapters)
        self._memory.adapters = adapters

    @property
    def n_threads(self) -> int:
        """The threads a step uses now (``n_threads=``, then :meth:`set_n_threads`'s);
        a ``step_seconds`` callable may read it. (:class:`~llamax.backend.base.Threaded`)"""
        return self._n_threads

    def set_n_threads(self, n_threads: int) -> None:
        """Record ``n_threads`` (in :attr:`thread_log`) for the next steps."""
        if n_threads < 1:
            raise ValueError(f"n_threads must be >= 1, got {n_threads}")
        self._n_threads = n_threads
        self.thread_log.append(n_threads)

    def clock(self) -> float:
        """Seconds on the engine's clock: with ``step_seconds``, the simulated time of every
        successful decode so far (what each cost) and what :meth:`pass_time` added, nothing
        else; without it, the real ``time.perf_counter()``.
        (:class:`~llamax.backend.base.Clocked`)"""
        if self._step_seconds is None:
            return time.perf_counter()
        return self._clock

    def runnable_tasks(self) -> int | None:
        """Tasks runnable on the simulated machine now: what ``runnable_tasks=`` says, else
        None (unknown: the engine judges by step times alone, never by the real machine's
        load). (:class:`~llamax.backend.base.MachineLoad`)"""
        return self._runnable_tasks() if self._runnable_tasks is not None else None

    def pass_time(self, seconds: float) -> None:
        """Let ``seconds`` pass on the simulated clock outside any decode, as a slow logits
        callback or grammar would (only with ``step_seconds``)."""
        if self._step_seconds is None:
            raise ValueError("pass_time needs a simulated clock (step_seconds)")
        if seconds < 0:
            raise ValueError(f"seconds must be >= 0, got {seconds}")
        self._clock += seconds

    def new_sampler(
        self,
        params: SamplingParams,
        seed: int,
        history: Sequence[int],
        *,
        grammar: str | None = None,
        graph: bool = False,
    ) -> FakeSampler:
        """A sampler honouring greedy/temperature, logit_bias, ignore_eos and a
        :class:`FakeGrammar` (other grammars constrain nothing); with ``graph`` (and
        ``graph_sampling``) one the decode may run."""
        self._fault("new_sampler")
        if any(t < 0 for t in history):
            raise AssertionError("an image's placeholder ids reached a sampler's history")
        sampler = FakeSampler.new(params, seed, grammar)
        sampler.graph = graph and self._graph_sampling and grammar is None
        self.live_samplers.add(id(sampler))
        return sampler

    def check_grammar(self, grammar: str) -> str | None:
        """Grammars containing the word ``INVALID`` are refused (for tests)."""
        return "refused by the fake" if "INVALID" in grammar else None

    def logits(self, row: int) -> npt.NDArray[np.float32]:
        """The writable logits row of batch ``row`` from the last decode."""
        self._fault("logits")
        if row in self._graph_rows:
            raise AssertionError(f"row {row} was sampled in the graph: its logits were not copied")
        view: npt.NDArray[np.float32] = self._logits[self._rows[row]]
        return view

    def batch_logits(self, num_rows: int) -> npt.NDArray[np.float32]:
        """Every output row of the last decode."""
        self._fault("batch_logits")
        if self._graph_rows:
            raise AssertionError("a batch logits read after rows were sampled in the graph")
        return self._logits[:num_rows]

    def sample(self, sampler: FakeSampler, row: int) -> int:
        """Greedy argmax, or a softmax draw at the sampler's temperature, after logit_bias
        and the grammar's mask (:func:`~llamax.testing.model.sample`).

        Raises:
            RequestFailedError: the grammar allows no token here (as llama.cpp's backend).
        """
        self._fault("sample")
        if self._graph_rows.get(row) is sampler:  # drawn in the decode, as on the host
            del self._graph_rows[row]
            self.num_graph_draws += 1
            return sample(sampler, self._logits[self._rows[row]], self._eog)
        if sampler.seq_id is not None:  # its row is wanted on the host: detached, renewed
            self._detach(sampler)
        if row in self._graph_rows:
            raise AssertionError(f"row {row} was sampled in the graph by another chain")
        return sample(sampler, self._logits[self._rows[row]], self._eog)

    def sample_rows(self, samplers: Sequence[FakeSampler], rows: Sequence[int]) -> list[int]:
        """:meth:`sample` for each sampler and its row, in order."""
        return [self.sample(sampler, row) for sampler, row in zip(samplers, rows, strict=True)]

    def sample_drawn(self, sampler: FakeSampler, row: int, limit: int) -> Drawn:
        """:meth:`sample`, with the distribution it drew from
        (:func:`~llamax.testing.model.draw`)."""
        self._fault("sample")
        if sampler.seq_id is not None:
            self._detach(sampler)
        if row in self._graph_rows:
            raise AssertionError(f"row {row} was sampled in the graph: its logits were not copied")
        return draw(sampler, self._logits[self._rows[row]], self._eog, limit)

    def free_sampler(self, sampler: FakeSampler) -> None:
        """Forget a sampler."""
        self._fault("free_sampler")
        if sampler.seq_id is not None:
            self._detach(sampler)
        self._graph_rows = {r: s for r, s in self._graph_rows.items() if s is not sampler}
        self.live_samplers.discard(id(sampler))

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        """Remove positions ``[p0, p1)``. A removal inside the sequence leaves a hole that
        :meth:`seq_add` must close before the next decode. False for non-sharing memory."""
        if self._fault("seq_rm") is not None and (p0 > 0 or p1 >= 0):
            return False  # llama.cpp refuses only partial removals (never a whole one)
        if (p0 > 0 and not self._can_share and not self._memory.recurrent) or not (
            self._memory.can_remove(seq_id, p0, p1)
        ):
            return False
        self._memory.remove(seq_id, p0, p1)
        return True

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        """Shift ``[p0, end)`` left by ``-delta`` into a hole left by :meth:`seq_rm`."""
        self._fault("seq_add")
        self._memory.shift(seq_id, p0, p1, delta)

    @property
    def can_shift(self) -> bool:
        """As configured."""
        return self._can_shift_positions

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """Share ``src``'s cells ``[p0, p1)`` with ``dst``, which must continue at ``p0``.

        With one stream per sequence only whole copies (``p0 = p1 = -1``) exist, and they
        duplicate the cells, as in llama.cpp, where a partial one aborts the process.
        """
        self._fault("seq_cp")
        self._memory.copy(src, dst, p0, p1)

    @property
    def sliding_window(self) -> int:
        """As configured (0: none)."""
        return self._window or 0

    def seq_pos_min(self, seq_id: int) -> int:
        """First position still held: 0, or later once a sliding window has passed it."""
        self._fault("seq_pos_min")
        n, state = len(self.cells[seq_id]), self._memory.position_bounds(seq_id)
        if not n:
            return -1
        if state is not None:
            return state[0]
        return max(0, n - self._window) if self._window else 0

    @property
    def model_identity(self) -> dict[str, object]:
        """The fake model's identity, its weights and KV cache types (``"F16/F16"``, as
        the llama.cpp backend names them) included."""
        return {
            "name": self._facts.model_name,
            "n_vocab": self._facts.n_vocab,
            "weights": self._weights,
            "kv_cache": self._kv_cache,
        }

    def state_seq_get(self, seq_id: int, *, partial: bool = False) -> bytes:
        """The sequence's state as JSON: a header, then its tokens by position (null for a
        removed cell). The header names the model and adapter set the cells were computed
        by and lists the cells whose buffer holds anything else (``[position, chain, model,
        adapters]``, chain null for garbage: a copy still queued has not filled it), and
        its K/V types where they are not f16's. With ``sized_states``, a whole state is
        as long as llama.cpp's would be, at least: blanks after the JSON make it
        :attr:`kv_bytes_per_cell` longer a cell held, so budgets in bytes hold as many
        cells as they would of real states."""
        self._fault("state_seq_get")
        if partial:
            return self._memory.partial_state(seq_id)
        data = self._memory.state(seq_id)
        if self._sized_states:
            held = sum(t is not None for t in self.cells[seq_id])
            data += b" " * (held * self._kv_bytes_per_cell)
        return data

    def state_seq_set(self, seq_id: int, data: bytes, *, partial: bool = False) -> bool:
        """Load tokens from :meth:`state_seq_get` into an empty sequence; False (nothing
        loaded) for a state that is not a list of tokens at positions ``0 .. n-1`` (one
        with a removed cell, as llama.cpp's own check refuses), does not fit, or holds K/V
        of other types than the fake's (as llama.cpp refuses: "mismatched key type")."""
        if self._fault("state_seq_set") is not None:
            return False
        if partial:  # a checkpoint: the recurrent state only, the cells stay
            return self._memory.set_partial_state(seq_id, data)
        return self._memory.load(seq_id, data, n_ctx=self._n_ctx, n_ctx_stream=self.n_ctx_stream)

    def calibration_key(self) -> str | None:
        """None: a fake's calibration is never cached (its costs are the test's).
        (:class:`~llamax.backend.base.Calibratable`)"""
        return None

    def fill_cells(self, seq_id: int, num_cells: int) -> bool:
        """Grow ``seq_id`` to ``num_cells`` cells, its tokens repeated; False when they do
        not fit. (:class:`~llamax.backend.base.Calibratable`)"""
        if self._fault("fill_cells") is not None:
            return False
        return self._memory.fill(
            seq_id, num_cells, n_ctx=self._n_ctx, n_ctx_stream=self.n_ctx_stream
        )

    def seq_tokens(self, seq_id: int) -> list[int | None]:
        """The tokens ``seq_id`` holds, by position (``None`` where a cell was removed)."""
        return list(self.cells[seq_id])

    def seq_pos_max(self, seq_id: int) -> int:
        """Last position held, or -1 (with a recurrent state: the earlier of its cells'
        and its state's, as llama.cpp's hybrid memory answers)."""
        state = self._memory.position_bounds(seq_id)
        return (
            len(self.cells[seq_id]) - 1
            if state is None
            else min(len(self.cells[seq_id]) - 1, state[1])
        )

    def close(self) -> None:
        """Mark closed; later decodes raise, and so do tokenize and token_to_piece
        (:class:`~llamax.errors.ContextClosedError`, as the llama.cpp backend's do). A
        ``close`` fault fires after the mark (the native memory is gone either way; the
        caller sees the error)."""
        self.closed = True
        self._fault("close")

    # ------------------------------------------------------------------ faults
    def _fault(self, where: str) -> object:
        """Count a call at fault point ``where`` and ask :attr:`fault` about it."""
        self.fault_calls[where] += 1
        return None if self.fault is None else self.fault(where)

    def _check_open(self) -> None:
        if self.closed:
            raise ContextClosedError("the context is closed: its (fake) model has been freed")
