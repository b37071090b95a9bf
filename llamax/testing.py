"""A deterministic, pure-Python stand-in for llama.cpp, for tests without a model.

:class:`FakeBackend` implements :class:`llamax.backend.Backend`. Its vocabulary is token 0
(end of generation, renders as nothing), tokens 1..256 for the bytes 0..255, and any extra
multi-byte pieces you pass. Its "model" is a function of the sequence's KV contents, so
greedy output is batch-invariant by construction. It checks what the engine sends: every
decode must continue each sequence at the next position, never exceed ``n_batch`` and
never exceed ``n_ctx`` cells (it answers NO_SLOT, like llama.cpp).

It is no kinder than llama.cpp about KV. With one stream per sequence a ``seq_cp`` updates
the destination's cells at once but copies the source stream's buffer only at the next
decode (or :meth:`FakeBackend.run_queued_copies`), while state reads and writes act at
once; a partial copy between streams aborts. And every cell records its *provenance*: the
history it was computed from (a hash chain over the tokens at positions ``0..p``), the
model's weights and the LoRA adapter set. Every decode checks that each sequence attends
only to cells computed from its own tokens, by this model, under the current adapter set,
and raises ``AssertionError`` naming the first that is not.

    ctx = llamax.Context(backend=FakeBackend(), autostart=False)
"""

from __future__ import annotations

import json
import random
import re
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from .adapters import NO_ADAPTERS, AdapterSet
from .backend.base import BatchItem, DecodeStatus
from .backend.native import utf8
from .context import Context
from .errors import ContextClosedError, ModelLoadError, RequestFailedError
from .params import SamplingParams

__all__ = [
    "FAULT_POINTS",
    "FakeBackend",
    "FakeGrammar",
    "FakeSampler",
    "alphabet_model",
    "assert_idle",
]

EOS = 0
_GRAMMAR = re.compile(r"root\s*::=\s*\[([^\]\\]*)\](\*|\+|\{\d+(?:,\d*)?\})")

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
    "close",
)
"""Every backend call that :attr:`FakeBackend.fault` can make fail, by the name it is
given. The protocol has no ``seq_keep`` and no abort callback: llamax calls neither."""


@dataclass(frozen=True, slots=True)
class _Computed:
    """What a cell's K/V came from (its data): the hash chain of the tokens at positions
    ``0..p`` when it was computed, the model's weights and the adapter set."""

    chain: int
    model: str
    adapters: AdapterSet


def _chain(previous: int, token: int) -> int:
    return hash((previous, token))


def alphabet_model(history: Sequence[int]) -> int:
    """Default fake model: the next lowercase letter after the last byte, cycling a..z."""
    last = history[-1] - 1 if history and history[-1] > 0 else ord("a") - 1
    nxt = ord("a") + (last - ord("a") + 1) % 26 if ord("a") <= last <= ord("z") else ord("a")
    return nxt + 1


@dataclass(eq=False, slots=True)
class FakeSampler:
    """What :meth:`FakeBackend.new_sampler` returns: params, seed and the accepted tokens."""

    params: SamplingParams
    seed: int
    rng: random.Random
    accepted: list[int] = field(default_factory=list)
    grammar: FakeGrammar | None = None


@dataclass(frozen=True, slots=True)
class FakeGrammar:
    """The one grammar shape the fake enforces: ``root ::= [chars]{min,max}`` (also ``*``,
    ``+``, ``{n}``; ``a-z`` ranges allowed), that is between ``min`` and ``max`` of the
    listed single-byte characters, then the end of generation. Like llama.cpp's grammar
    sampler it masks what the grammar forbids, and with ``ignore_eos`` (or an empty class)
    it reaches a dead end where :meth:`FakeBackend.sample` raises ``RequestFailedError``.
    Other grammars constrain nothing."""

    allowed: frozenset[int]
    """Token ids of the allowed characters."""
    least: int
    most: int | None

    @classmethod
    def parse(cls, text: str) -> FakeGrammar | None:
        """The fake grammar ``text`` stands for, or None when it is not of that shape."""
        found = _GRAMMAR.fullmatch(text.strip())
        if found is None:
            return None
        chars, repeat = found.group(1), found.group(2)
        allowed: set[int] = set()
        i = 0
        while i < len(chars):
            if i + 2 < len(chars) and chars[i + 1] == "-":
                allowed.update(range(ord(chars[i]), ord(chars[i + 2]) + 1))
                i += 3
            else:
                allowed.add(ord(chars[i]))
                i += 1
        tokens = frozenset(c + 1 for c in allowed if c < 128)
        if repeat in ("*", "+"):
            return cls(tokens, int(repeat == "+"), None)
        low, _, high = repeat.strip("{}").partition(",")
        return cls(tokens, int(low), int(high) if high else None if _ else int(low))


class FakeBackend:
    """Pure-Python backend with a scripted next-token function and a checked KV model.

    Besides :class:`~llamax.backend.base.Backend` it implements
    :class:`~llamax.backend.base.Inspectable` (``seq_tokens``, ``num_cells_used``,
    ``num_live_samplers``), so ``Context.audit()`` also checks the tokens and cells it holds.
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
    ) -> None:
        self._n_ctx, self._n_seq_max, self._n_batch = n_ctx, n_seq_max, n_batch
        self._stream_cells = n_ctx // n_seq_max if stream_cells is None else stream_cells
        if kv_layout not in ("unified", "streams", "auto"):
            raise ValueError(f"kv_layout must be 'unified', 'streams' or 'auto', got {kv_layout!r}")
        self._is_unified = kv_layout == "unified"
        self._can_relayout = kv_layout == "auto"
        self._cpu_attention = cpu_attention
        self._attention_tiles = attention_tiles
        self._n_ctx_seq = n_ctx if kv_layout != "streams" else self._stream_cells
        self.num_relayouts = 0
        self._next_token = next_token
        self._pieces = {0: b""} | {b + 1: bytes([b]) for b in range(256)} | dict(extra_pieces or {})
        self._model_name = model_name
        self._weights = weights
        self.cells: dict[int, list[int | None]] = {i: [] for i in range(n_seq_max)}
        """Tokens each sequence id holds in the fake KV cache, by position."""
        self._cell_ids: dict[int, list[int | None]] = {i: [] for i in range(n_seq_max)}
        self._chains: dict[int, list[int | None]] = {i: [] for i in range(n_seq_max)}
        # what each cell's data should come from: the chain over the sequence's tokens
        self._data: dict[int, _Computed | None] = {}  # unified: cell id -> its data
        self._buffers: dict[int, dict[int, _Computed | None]] = {i: {} for i in range(n_seq_max)}
        # streams: each sequence's buffer by position; it outlives seq_rm, as llama.cpp's
        self._queued: list[tuple[int, int]] = []  # stream copies the next decode runs
        self.num_queue_runs = 0
        """Times the queued stream copies ran (at a decode or :meth:`run_queued_copies`)."""
        self._refs: dict[int, int] = {}
        self._next_cell = 0
        self._can_share = can_share_prefix
        self._window = sliding_window
        self._can_shift_positions = can_shift
        self._metadata = dict(metadata or {})
        self._specials = dict(special_tokens or {})
        # a special token renders as nothing (a control token), unless ``extra_pieces``
        # gives its text (a user-defined token, such as gpt-oss's ``<|channel|>``);
        # llama.cpp parses such a token's text even without ``parse_special``, as the fake does
        shown = set(extra_pieces or {})
        self._pieces.update({t: b"" for t in self._specials.values() if t not in shown})
        self._user_defined = {text: t for text, t in self._specials.items() if t in shown}
        self._eog = frozenset(eog_token_ids)
        self._adapter_order: dict[str, int] = {}  # name -> load index
        self._adapter_set: AdapterSet = NO_ADAPTERS
        self.decode_adapters: list[AdapterSet] = []
        """The adapter set of every successful decode, in order (with ``log_decodes``)."""
        self.num_copies = 0
        self.num_shifts = 0
        self.decode_log: list[tuple[BatchItem, ...]] = []
        """Every successful decode's items, in order (empty with ``log_decodes=False``,
        which soak tests use: the log grows with every step)."""
        self._log_decodes = log_decodes
        self._step_seconds = step_seconds
        self._clock = 0.0
        self._n_threads = n_threads
        self.thread_log: list[int] = []
        """Every thread count :meth:`set_n_threads` was given, in order."""
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
        self._logits = np.zeros((0, self.n_vocab), np.float32)

    # ------------------------------------------------------------------ facts
    @property
    def n_ctx(self) -> int:
        """Total KV cells."""
        return self._n_ctx

    @property
    def kv_cells(self) -> int:
        """Cells the current layout holds: ``n_ctx``, or ``stream_cells`` per sequence with
        streams (llama.cpp pads each stream to 256 cells, so streams may hold more)."""
        return self._n_ctx if self._is_unified else self._stream_cells * self._n_seq_max

    @property
    def n_ctx_seq(self) -> int:
        """``n_ctx``, or each stream's ``stream_cells`` with ``kv_layout="streams"``."""
        return self._n_ctx_seq

    @property
    def is_unified(self) -> bool:
        """As configured by ``kv_layout`` (``"auto"`` starts with streams)."""
        return self._is_unified

    @property
    def n_ctx_stream(self) -> int:
        """``n_ctx`` when unified, ``stream_cells`` (``n_ctx // n_seq_max``) with streams."""
        return self._n_ctx if self._is_unified else self._stream_cells

    @property
    def can_relayout(self) -> bool:
        """With ``kv_layout="auto"``."""
        return self._can_relayout

    def relayout(self, unified: bool) -> None:
        """Switch layouts as llama.cpp does: every sequence gets cells of its own.

        Raises:
            RequestFailedError: the sequences hold more cells than the new layout has (as
                llama.cpp refuses a sequence's state it cannot place).
        """
        if not self._can_relayout:
            raise AssertionError("relayout without kv_layout='auto'")
        self._fault("relayout")
        if unified == self._is_unified:
            return
        # a new context: each state is read as it is now (a queued copy never runs there)
        limit = self._n_ctx if unified else self._stream_cells
        held_cells = 0
        for seq_id, cells in self.cells.items():
            if None in cells:
                raise AssertionError(f"relayout of seq {seq_id} with a hole")
            if len(cells) > limit:
                raise AssertionError(f"seq {seq_id} holds {len(cells)} cells, a stream {limit}")
            held_cells += len(cells)
            if unified and held_cells > self._n_ctx:
                raise RequestFailedError(f"the new KV layout refused sequence {seq_id}")
        held = {seq_id: (list(held), self._read_all(seq_id)) for seq_id, held in self.cells.items()}
        self._refs.clear()
        self._data.clear()
        self._queued.clear()
        for seq_id in held:
            self._buffers[seq_id] = {}
            self.cells[seq_id], self._cell_ids[seq_id], self._chains[seq_id] = [], [], []
        self._is_unified = unified
        for seq_id, (tokens, data) in held.items():
            self._store(seq_id, [t for t in tokens if t is not None], data)
        self.num_relayouts += 1

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
        """A made-up size."""
        return 1024

    @property
    def n_seq_max(self) -> int:
        """Sequence ids."""
        return self._n_seq_max

    @property
    def n_batch(self) -> int:
        """Most tokens per decode."""
        return self._n_batch

    @property
    def n_vocab(self) -> int:
        """Vocabulary size."""
        return max(self._pieces) + 1

    @property
    def model_name(self) -> str:
        """The fake model's name."""
        return self._model_name

    @property
    def num_cells_used(self) -> int:
        """Distinct cells held by any sequence (copied prefixes share cells)."""
        return len(self._refs)

    @property
    def can_share_prefix(self) -> bool:
        """As configured (False mimics recurrent memory)."""
        return self._can_share

    @property
    def num_live_samplers(self) -> int:
        """Samplers not yet freed."""
        return len(self.live_samplers)

    # ------------------------------------------------------------------ text
    @property
    def bos_token_id(self) -> int | None:
        """The fake vocabulary adds no BOS."""
        return None

    @property
    def eos_token_id(self) -> int | None:
        """Token 0."""
        return EOS

    def token_text(self, token: int) -> str:
        """The token's bytes as text; special tokens by name."""
        for text, special in self._specials.items():
            if special == token:
                return text
        return self._pieces[token].decode("utf-8", "replace")

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
        utf8(text)  # a lone surrogate is refused as by the real tokenizer
        specials = self._specials if parse_special else self._user_defined
        if not specials:
            return [b + 1 for b in text.encode("utf-8")]
        tokens: list[int] = []
        while text:
            hits = [(text.find(s), s) for s in specials if s in text]
            if not hits:
                tokens += [b + 1 for b in text.encode("utf-8")]
                break
            at, special = min(hits)
            tokens += [b + 1 for b in text[:at].encode("utf-8")] + [specials[special]]
            text = text[at + len(special) :]
        return tokens

    def token_to_piece(self, token: int) -> bytes:
        """The bytes of a token."""
        self._check_open()
        return self._pieces[token]

    def is_eog(self, token: int) -> bool:
        """Token 0 (and any ``eog_token_ids``) ends generation."""
        return token in self._eog

    # ------------------------------------------------------------------ compute
    def decode(self, items: Sequence[BatchItem]) -> int:
        """Check and apply a batch; remember the next token of every row that wants logits."""
        if self.closed:
            raise RuntimeError("decode on a closed FakeBackend")
        status = self._fault("decode")
        if status is not None:
            assert isinstance(status, int), f"a decode fault must be a status, got {status!r}"
            if status in (DecodeStatus.OK, DecodeStatus.NO_SLOT, DecodeStatus.ABORTED):
                self._run_queue()  # llama.cpp's memory update comes before these
            return status
        num = sum(len(i.token_ids) for i in items)
        if not num or num > self._n_batch or len({i.seq_id for i in items}) != len(items):
            return -1
        self._run_queue()
        if self.forced_statuses:
            return self.forced_statuses.popleft()
        if self.num_cells_used + num > self.kv_cells or any(
            len(self.cells[i.seq_id]) + len(i.token_ids) > self.n_ctx_stream for i in items
        ):
            return DecodeStatus.NO_SLOT
        self._rows.clear()
        self._logits = np.zeros((sum(len(i.rows) for i in items), self.n_vocab), np.float32)
        offset = 0
        for item in items:
            cells = self.cells[item.seq_id]
            if None in cells:
                raise AssertionError(f"seq {item.seq_id}: decode over a hole left by seq_rm")
            if item.start_pos != len(cells):
                raise AssertionError(
                    f"seq {item.seq_id}: decode at {item.start_pos}, KV holds {len(cells)}"
                )
            known = [t for t in cells if t is not None]
            self._check_provenance(item.seq_id)
            for row in item.rows:
                if not offset <= row < offset + len(item.token_ids):
                    raise AssertionError(f"row {row} is outside its item {item!r}")
                history = known + list(item.token_ids[: row - offset + 1])
                self._rows[row] = len(self._rows)
                token = self._adapted(self._next_token(history))
                self._logits[len(self._rows) - 1] = self._row_logits(token)
            self._store(item.seq_id, item.token_ids)
            offset += len(item.token_ids)
        if self._log_decodes:
            self.decode_log.append(tuple(items))
            self.decode_adapters.append(self._adapter_set)
        if self._step_seconds is not None:
            self._clock += self._step_seconds(items)
        return DecodeStatus.OK

    def run_queued_copies(self) -> None:
        """Run the queued stream copies now, as the next decode would."""
        self._fault("run_queued_copies")
        self._run_queue()

    def _run_queue(self) -> None:
        """Copy each queued source stream's buffer, as it is now, into its destination."""
        if self._queued:
            for src, dst in self._queued:
                self._buffers[dst] = dict(self._buffers[src])
            self._queued.clear()
            self.num_queue_runs += 1

    def _read(self, seq_id: int, pos: int) -> _Computed | None:
        """The data the memory holds for ``seq_id``'s cell at ``pos`` (None: garbage)."""
        if self._is_unified:
            cell = self._cell_ids[seq_id][pos]
            return None if cell is None else self._data.get(cell)
        return self._buffers[seq_id].get(pos)

    def _read_all(self, seq_id: int) -> list[_Computed | None]:
        return [self._read(seq_id, p) for p, t in enumerate(self.cells[seq_id]) if t is not None]

    def _check_provenance(self, seq_id: int) -> None:
        """Every cell ``seq_id`` attends to was computed from its own tokens, by this model,
        under the current adapter set."""
        for pos, expected in enumerate(self._chains[seq_id]):
            if expected is None:
                continue
            data = self._read(seq_id, pos)
            if data is None or data.chain != expected:
                raise AssertionError(
                    f"seq {seq_id} reads KV at position {pos} that was not computed from its "
                    f"own tokens ({'garbage' if data is None else 'another history'})"
                )
            if data.model != self._weights:
                raise AssertionError(
                    f"seq {seq_id}: KV at position {pos} was computed by model {data.model!r}, "
                    f"read by {self._weights!r}"
                )
            if data.adapters != self._adapter_set:
                raise AssertionError(
                    f"seq {seq_id}: KV computed under adapters {data.adapters} is read under "
                    f"{self._adapter_set}"
                )

    def load_adapter(self, name: str, path: str) -> None:
        """Accept any file that starts with ``GGUF`` as an adapter; under it, lower-case
        letters the model picks move ``k`` places along the alphabet, ``k`` being the sum
        of ``load index + 1`` over the set's adapters whose scale is not 0.
        (:class:`~llamax.backend.base.LoraHost`)

        Raises:
            ModelLoadError: no such file, or it does not start with ``GGUF``.
        """
        self._fault("load_adapter")
        try:
            with open(path, "rb") as file:
                magic = file.read(4)
        except OSError as exc:
            raise ModelLoadError(f"LoRA adapter {name!r}: cannot read {path}: {exc}") from exc
        if magic != b"GGUF":
            raise ModelLoadError(f"LoRA adapter {name!r}: {path} is not a GGUF file")
        self._adapter_order.setdefault(name, len(self._adapter_order))

    def set_adapters(self, adapters: AdapterSet) -> None:
        """Run the next decodes under ``adapters``."""
        self._fault("set_adapters")
        unknown = [name for name, _ in adapters if name not in self._adapter_order]
        if unknown:
            raise AssertionError(f"set_adapters with adapters never loaded: {unknown}")
        self._adapter_set = adapters

    def _adapted(self, token: int) -> int:
        shift = sum(self._adapter_order[n] + 1 for n, scale in self._adapter_set if scale != 0)
        if shift % 26 and ord("a") <= token - 1 <= ord("z"):
            return 1 + ord("a") + (token - 1 - ord("a") + shift) % 26
        return token

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
        successful decode so far (what each cost), and nothing else; without it, the real
        ``time.perf_counter()``. (:class:`~llamax.backend.base.Clocked`)"""
        if self._step_seconds is None:
            return time.perf_counter()
        return self._clock

    def _row_logits(self, token: int) -> npt.NDArray[np.float32]:
        """The model's token scores 10; three neighbours 9.5, 9 and 8.5; the rest -10."""
        row = np.full(self.n_vocab, -10.0, np.float32)
        for k in range(3, 0, -1):
            row[1 + (token - 1 + k) % 256] = 10.0 - 0.5 * k
        row[token] = 10.0
        return row

    def new_sampler(
        self,
        params: SamplingParams,
        seed: int,
        history: Sequence[int],
        *,
        grammar: str | None = None,
    ) -> FakeSampler:
        """A sampler honouring greedy/temperature, logit_bias, ignore_eos and a
        :class:`FakeGrammar` (other grammars constrain nothing)."""
        self._fault("new_sampler")
        parsed = None if grammar is None else FakeGrammar.parse(grammar)
        sampler = FakeSampler(params, seed, random.Random(seed), grammar=parsed)
        self.live_samplers.add(id(sampler))
        return sampler

    def check_grammar(self, grammar: str) -> str | None:
        """Grammars containing the word ``INVALID`` are refused (for tests)."""
        return "refused by the fake" if "INVALID" in grammar else None

    def logits(self, row: int) -> npt.NDArray[np.float32]:
        """The writable logits row of batch ``row`` from the last decode."""
        self._fault("logits")
        view: npt.NDArray[np.float32] = self._logits[self._rows[row]]
        return view

    def batch_logits(self, num_rows: int) -> npt.NDArray[np.float32]:
        """Every output row of the last decode."""
        self._fault("batch_logits")
        return self._logits[:num_rows]

    def sample(self, sampler: FakeSampler, row: int) -> int:
        """Greedy argmax, or a softmax draw at the sampler's temperature, after logit_bias
        and the grammar's mask.

        Raises:
            RequestFailedError: the grammar allows no token here (as llama.cpp's backend).
        """
        self._fault("sample")
        logits = self._logits[self._rows[row]].astype(np.float64)
        params = sampler.params
        for token, bias in params.logit_bias.items():
            logits[token] += bias
        grammar = sampler.grammar
        if grammar is not None:
            allowed = set(self._eog) if len(sampler.accepted) >= grammar.least else set()
            if grammar.most is None or len(sampler.accepted) < grammar.most:
                allowed |= grammar.allowed
            forbidden = np.ones(len(logits), bool)
            forbidden[sorted(allowed)] = False
            logits[forbidden] = -np.inf
        if params.ignore_eos:
            logits[list(self._eog)] = -np.inf
        if not np.isfinite(logits).any():
            raise RequestFailedError("the grammar allows no token here")
        if params.is_greedy:
            token = int(np.argmax(logits))
        else:
            probs = np.exp((logits - logits.max()) / params.temperature)
            cumulative = np.cumsum(probs / probs.sum())
            drawn = int(np.searchsorted(cumulative, sampler.rng.random()))
            token = min(drawn, len(probs) - 1)
        sampler.accepted.append(token)
        return token

    def free_sampler(self, sampler: FakeSampler) -> None:
        """Forget a sampler."""
        self._fault("free_sampler")
        self.live_samplers.discard(id(sampler))

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        """Remove positions ``[p0, p1)``. A removal inside the sequence leaves a hole that
        :meth:`seq_add` must close before the next decode. False for non-sharing memory."""
        if self._fault("seq_rm") is not None and (p0 > 0 or p1 >= 0):
            return False  # llama.cpp refuses only partial removals (never a whole one)
        cells, ids = self.cells[seq_id], self._cell_ids[seq_id]
        p0 = max(p0, 0)
        p1 = len(cells) if p1 < 0 else min(p1, len(cells))
        if p0 > 0 and not self._can_share:
            return False
        chains = self._chains[seq_id]
        for cell in ids[p0:p1]:
            if cell is None:
                continue
            self._refs[cell] -= 1
            if not self._refs[cell]:
                del self._refs[cell]
                self._data.pop(cell, None)
        if p1 == len(cells):
            del cells[p0:], ids[p0:], chains[p0:]
        else:
            cells[p0:p1] = [None] * (p1 - p0)
            ids[p0:p1] = [None] * (p1 - p0)
            chains[p0:p1] = [None] * (p1 - p0)
        return True

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        """Shift ``[p0, end)`` left by ``-delta`` into a hole left by :meth:`seq_rm`."""
        self._fault("seq_add")
        cells, ids = self.cells[seq_id], self._cell_ids[seq_id]
        if p1 >= 0 and p1 != len(cells):
            raise AssertionError("the fake only shifts whole tails")
        if delta > 0 or any(c is not None for c in cells[p0 + delta : p0]):
            raise AssertionError(f"seq_add {seq_id} [{p0}, end) by {delta} overwrites cells")
        if self._is_unified and any(c is not None and self._refs[c] > 1 for c in ids[p0:]):
            raise AssertionError(f"seq_add {seq_id} moves cells another sequence holds too")
        # the moved cells keep their K/V, re-rotated: a shift is a deliberate approximation,
        # so cells that were right before stand for the shifted history after
        moved = [
            (data, data is not None and data.chain == chain)
            for data, chain in zip(
                [self._read(seq_id, p) for p in range(p0, len(cells))],
                self._chains[seq_id][p0:],
                strict=True,
            )
        ]
        del cells[p0 + delta : p0], ids[p0 + delta : p0]
        self._chains[seq_id] = self._chain_of(cells)
        if not self._is_unified:
            kept = {p: d for p, d in self._buffers[seq_id].items() if p < p0 + delta}
            self._buffers[seq_id] = kept
        for offset, (data, was_right) in enumerate(moved):
            pos = p0 + delta + offset
            if data is not None and was_right:
                chain = self._chains[seq_id][pos]
                assert chain is not None
                data = _Computed(chain, data.model, data.adapters)
            self._write(seq_id, pos, data)
        self.num_shifts += 1

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
        if not self._is_unified:
            if p0 != -1 or p1 != -1 or self.cells[dst]:
                raise AssertionError(f"partial seq_cp {src}->{dst} between streams aborts")
            if None in self.cells[src]:
                raise AssertionError(f"seq_cp {src}->{dst} copies a hole")
            # the cells now, the buffer at the next decode (whatever the source holds then)
            tokens = [t for t in self.cells[src] if t is not None]
            self.cells[dst].extend(tokens)
            self._chains[dst] = list(self._chains[src])
            for _ in tokens:
                self._refs[self._next_cell] = 1
                self._cell_ids[dst].append(self._next_cell)
                self._next_cell += 1
            self._queued.append((src, dst))
            self.num_copies += 1
            return
        p0 = max(p0, 0)
        p1 = len(self.cells[src]) if p1 < 0 else p1
        if len(self.cells[dst]) != p0 or p1 > len(self.cells[src]):
            raise AssertionError(f"seq_cp {src}->{dst} [{p0}, {p1}) does not continue {dst}")
        if None in self.cells[src][p0:p1]:
            raise AssertionError(f"seq_cp {src}->{dst} copies a hole")
        self.cells[dst].extend(self.cells[src][p0:p1])
        for cell in self._cell_ids[src][p0:p1]:
            assert cell is not None
            self._refs[cell] += 1
            self._cell_ids[dst].append(cell)
        self._chains[dst].extend(self._chains[src][p0:p1])
        self.num_copies += 1

    def seq_pos_min(self, seq_id: int) -> int:
        """First position still held: 0, or later once a sliding window has passed it."""
        self._fault("seq_pos_min")
        n = len(self.cells[seq_id])
        if not n:
            return -1
        return max(0, n - self._window) if self._window else 0

    @property
    def model_identity(self) -> dict[str, object]:
        """The fake model's identity, its weights included."""
        return {"name": self._model_name, "n_vocab": self.n_vocab, "weights": self._weights}

    def state_seq_get(self, seq_id: int) -> bytes:
        """The sequence's state as JSON: a header, then its tokens by position (null for a
        removed cell). The header names the model and adapter set the cells were computed
        by and lists the cells whose buffer holds anything else (``[position, chain, model,
        adapters]``, chain null for garbage: a copy still queued has not filled it)."""
        self._fault("state_seq_get")
        tokens = self.cells[seq_id]
        found = [d for p, t in enumerate(tokens) if t is not None and (d := self._read(seq_id, p))]
        model, adapters = (found[0].model, found[0].adapters) if found else (self._weights, ())
        expected = self._chain_of(tokens)
        odd: list[object] = []
        for pos, token in enumerate(tokens):
            if token is None:
                continue
            data = self._read(seq_id, pos)
            if data is None:
                odd.append([pos, None, None, []])
            elif (data.chain, data.model, data.adapters) != (expected[pos], model, adapters):
                odd.append([pos, data.chain, data.model, [list(a) for a in data.adapters]])
        header = {"m": model, "a": [list(a) for a in adapters], "x": odd}
        return json.dumps([header, *tokens]).encode()

    def state_seq_set(self, seq_id: int, data: bytes) -> bool:
        """Load tokens from :meth:`state_seq_get` into an empty sequence; False (nothing
        loaded) for a state that is not a list of tokens at positions ``0 .. n-1`` (one
        with a removed cell, as llama.cpp's own check refuses) or does not fit."""
        if self._fault("state_seq_set") is not None:
            return False
        try:
            parsed = _parse_state(json.loads(data))
        except (ValueError, TypeError, KeyError, IndexError):
            return False
        if parsed is None:
            return False
        tokens, computed = parsed
        if (
            self.cells[seq_id]
            or self.num_cells_used + len(tokens) > self._n_ctx
            or len(tokens) > self.n_ctx_stream
        ):
            return False
        computed = [  # a hand-written cell (no model named): this model's
            _Computed(c.chain, self._weights, NO_ADAPTERS) if c is not None and not c.model else c
            for c in computed
        ]
        self._store(seq_id, tokens, computed)
        return True

    def calibration_key(self) -> str | None:
        """None: a fake's calibration is never cached (its costs are the test's).
        (:class:`~llamax.backend.base.Calibratable`)"""
        return None

    def fill_cells(self, seq_id: int, num_cells: int) -> bool:
        """Grow ``seq_id`` to ``num_cells`` cells, its tokens repeated; False when they do
        not fit. (:class:`~llamax.backend.base.Calibratable`)"""
        if self._fault("fill_cells") is not None:
            return False
        held = self.cells[seq_id]
        more = num_cells - len(held)
        if (
            not held
            or None in held
            or more < 0
            or num_cells > self.n_ctx_stream
            or self.num_cells_used + more > self._n_ctx
        ):
            return False
        tokens = [t for t in held if t is not None]
        self._store(seq_id, [tokens[i % len(tokens)] for i in range(len(held), num_cells)])
        return True

    def _store(
        self,
        seq_id: int,
        tokens: Sequence[int],
        data: Sequence[_Computed | None] | None = None,
    ) -> None:
        """Append ``tokens`` in new cells holding ``data`` (None: computed now, from the
        sequence's own history, by this model under the current adapter set)."""
        chains = self._chains[seq_id]
        previous = chains[-1] if chains and chains[-1] is not None else 0
        for i, token in enumerate(tokens):
            previous = _chain(previous, token)
            chains.append(previous)
            cell = self._next_cell
            self._next_cell += 1
            self._refs[cell] = 1
            self.cells[seq_id].append(token)
            self._cell_ids[seq_id].append(cell)
            computed = (
                _Computed(previous, self._weights, self._adapter_set) if data is None else data[i]
            )
            self._write(seq_id, len(self.cells[seq_id]) - 1, computed)

    def _write(self, seq_id: int, pos: int, data: _Computed | None) -> None:
        if self._is_unified:
            cell = self._cell_ids[seq_id][pos]
            assert cell is not None
            self._data[cell] = data
        else:
            self._buffers[seq_id][pos] = data

    @staticmethod
    def _chain_of(tokens: Sequence[int | None]) -> list[int | None]:
        chains: list[int | None] = []
        previous = 0
        for token in tokens:
            if token is None:
                chains.append(None)
                continue
            previous = _chain(previous, token)
            chains.append(previous)
        return chains

    def seq_tokens(self, seq_id: int) -> list[int | None]:
        """The tokens ``seq_id`` holds, by position (``None`` where a cell was removed)."""
        return list(self.cells[seq_id])

    def seq_pos_max(self, seq_id: int) -> int:
        """Last position held, or -1."""
        return len(self.cells[seq_id]) - 1

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


def _adapter_set(raw: object) -> AdapterSet:
    if not isinstance(raw, list):
        raise TypeError("not an adapter set")
    return AdapterSet((str(name), float(scale)) for name, scale in raw)


def _parse_state(held: object) -> tuple[list[int], list[_Computed | None]] | None:
    """A state from :meth:`FakeBackend.state_seq_get`: its tokens and cell data. A bare
    list of tokens (a hand-written state) stands for cells computed from those tokens
    under no adapters by the model that loads it (model ``""``). None: not a state (a
    removed cell, a wrong type)."""
    if not isinstance(held, list):
        return None
    model: str = ""
    adapters: AdapterSet = NO_ADAPTERS
    odd: dict[int, _Computed | None] = {}
    if held and isinstance(held[0], dict):
        header, *held = held
        model, adapters = str(header["m"]), _adapter_set(header["a"])
        for pos, chain, other, other_adapters in header["x"]:
            odd[int(pos)] = (
                None
                if chain is None
                else _Computed(int(chain), str(other), _adapter_set(other_adapters))
            )
    if not all(type(t) is int for t in held):
        return None
    tokens = [int(t) for t in held]
    computed: list[_Computed | None] = []
    previous = 0
    for pos, token in enumerate(tokens):
        previous = _chain(previous, token)
        computed.append(odd[pos] if pos in odd else _Computed(previous, model, adapters))
    return tokens, computed


def assert_idle(ctx: Context, timeout: float = 60.0, *, clear_cache: bool = True) -> None:
    """Assert that ``ctx`` leaked nothing, using only its public API.

    Checks (from :meth:`Context.stats` and :meth:`Context.audit`): no queued or running
    sequence, no unsettled request, no open session; the bookkeeping agrees with the
    backend's memory (every sequence id free or held by a slot whose KV extent matches its
    tokens, cell counts, live samplers). Then, with ``clear_cache``, drops the retained
    prefixes and checks that no KV cell is left in use. Waits up to ``timeout`` seconds for
    the background loop to go idle; it waits only while work remains, so the generous
    default costs an idle context nothing and holds on a busy machine.

    Raises:
        AssertionError: something leaked; the message says what.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and (ctx.has_work() or ctx.stats().num_unsettled):
        time.sleep(0.005)
    problems = _leaks(ctx)
    if not problems and clear_cache and not ctx.closed:
        ctx.clear_cache()
        problems = _leaks(ctx)
        stats = ctx.stats()
        if stats.kv_cells_used or stats.num_retained:
            problems.append(
                f"{stats.kv_cells_used} cells in {stats.num_retained} retained sequences "
                "after clear_cache()"
            )
        if stats.prefix_ram_entries or stats.prefix_ram_bytes:
            problems.append(
                f"{stats.prefix_ram_bytes} bytes in {stats.prefix_ram_entries} RAM prefixes "
                "after clear_cache()"
            )
        if stats.prefix_disk_entries or stats.prefix_disk_bytes:
            problems.append(
                f"{stats.prefix_disk_bytes} bytes in {stats.prefix_disk_entries} disk prefixes "
                "after clear_cache()"
            )
    if problems:
        raise AssertionError("engine not idle: " + "; ".join(problems))


def _leaks(ctx: Context) -> list[str]:
    stats = ctx.stats()
    problems = []
    if ctx.has_work():
        problems.append("engine still has work")
    if stats.num_running or stats.num_waiting:
        problems.append(f"{stats.num_running} running / {stats.num_waiting} waiting sequences")
    if stats.num_unsettled:
        problems.append(f"{stats.num_unsettled} requests never settled")
    if stats.num_sessions:
        problems.append(f"{stats.num_sessions} sessions still open")
    if not ctx.closed:
        problems += ctx.audit()
    return problems
