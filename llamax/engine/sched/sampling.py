"""The sampling stage of a step, between ``decode`` and ``scheduler.update``.

Per row with logits: the batch hook (once per step, over every row), the request's
logits processors (only for requests that have them), the native sampler chain of the
sequence and of any forks sharing the row, and logprobs (only for requests that ask: of
the row, or with ``logprobs_after_sampling`` of the distribution the chain drew from, which
the backend reads back as it samples).
A processor that raises or returns a bad row fails its own request, nobody else's. That
holds for any ``BaseException`` too (``SystemExit``, ``GeneratorExit`` ...). A
``KeyboardInterrupt`` also fails its request alone, and is kept for the thread that ran the
step: ``Context.process()`` re-raises it once the step is complete and published, so Ctrl-C
in a manual loop still stops the program while the engine stays consistent. On the
background loop (which never receives Ctrl-C from the OS) it is not re-raised.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import numpy.typing as npt

from ...backend.base import Backend, BatchItem, Drawn, GraphSampling, Sampler
from ...errors import RequestFailedError
from ...params import LogitsProcessor
from ...results import TokenLogprob, TopLogprob
from ..images import text_only
from ..plan import ScheduledSequence
from ..sequence import Request
from ..sequence import Sequence as Seq

__all__ = [
    "BatchLogitsProcessor",
    "LogitsRow",
    "Sampled",
    "graph_items",
    "keep_interrupt",
    "pop_interrupt",
    "sample_plan",
    "sample_row",
]

_pending = threading.local()  # .interrupt: a KeyboardInterrupt a callback raised in this thread


def pop_interrupt() -> KeyboardInterrupt | None:
    """The ``KeyboardInterrupt`` a logits processor raised in this thread since the last
    call (its request has failed), or None; forgets it."""
    interrupt: KeyboardInterrupt | None = getattr(_pending, "interrupt", None)
    _pending.interrupt = None
    return interrupt


def keep_interrupt(exc: BaseException) -> None:
    """Remember ``exc`` for :func:`pop_interrupt` if it is a ``KeyboardInterrupt``."""
    if isinstance(exc, KeyboardInterrupt):
        _pending.interrupt = exc


def _user_failure(message: str, exc: BaseException) -> RequestFailedError:
    """The error that ends a request whose callback raised ``exc`` (any BaseException)."""
    keep_interrupt(exc)
    error = RequestFailedError(message)
    error.__cause__ = exc
    return error


@dataclass(frozen=True, slots=True)
class LogitsRow:
    """Which sequence a row of the batch hook's logits belongs to."""

    request_id: str
    index: int
    """The choice index (for ``n > 1``)."""
    token_ids: Sequence[int]
    """Prompt plus generated tokens so far."""


class BatchLogitsProcessor(Protocol):
    """``fn(rows, logits)``: edit ``logits`` (``(len(rows), n_vocab)``, zero-copy) in place."""

    def __call__(self, rows: Sequence[LogitsRow], logits: npt.NDArray[np.float32]) -> None: ...


@dataclass(slots=True)
class Sampled:
    """What the stage produced."""

    tokens: dict[Seq, int] = field(default_factory=dict)
    logprobs: dict[Seq, TokenLogprob] = field(default_factory=dict)
    failed: dict[str, tuple[Request, BaseException]] = field(default_factory=dict)
    """By request id."""


def sample_plan(
    backend: Backend,
    entries: Sequence[ScheduledSequence],
    batch_processor: BatchLogitsProcessor | None = None,
) -> Sampled:
    """Sample the last row of every entry (each must want one), for it and its forks: the
    rows of requests with no logits processors, logprobs or grammar in one
    ``backend.sample_rows`` call (which may sample them together), the others row by row."""
    out = Sampled()
    if batch_processor is not None and entries:
        _run_batch_hook(backend, entries, batch_processor, out)
    together: list[ScheduledSequence] = []
    for entry in entries:
        seq, row = entry.seq, entry.item.row
        request = seq.request
        if request.request_id in out.failed:
            continue
        assert row is not None
        if _samples_plainly(request):
            together.append(entry)
            continue
        choices = (seq, *entry.forks)
        try:
            picks = _sample_row(backend, choices, row)
        except RequestFailedError as error:
            out.failed[request.request_id] = (request, error)
            continue
        for s, (token, logprob) in zip(choices, picks, strict=True):
            out.tokens[s] = token
            if logprob is not None:
                out.logprobs[s] = logprob
    if together:
        _sample_together(backend, together, out)
    return out


def graph_items(backend: Backend, entries: Sequence[ScheduledSequence]) -> list[BatchItem]:
    """The batch of ``entries`` for a backend that samples in the graph: an entry whose one
    row its own sampler alone samples, from nothing but the row (no forks, drafts, logits
    processors, logprobs or grammar), names that sampler (built now if it is the
    sequence's first row), so the decode may sample the row."""
    items: list[BatchItem] = []
    for entry in entries:
        item = entry.item
        if (
            len(item.rows) == 1
            and not entry.forks
            and not entry.draft
            and _samples_plainly(entry.seq.request)
        ):
            try:
                sampler = _sampler_of(backend, entry.seq)
            except Exception:  # the sampling stage builds it again and fails the request
                sampler = None
            if sampler is not None:
                item = BatchItem(
                    item.seq_id, item.token_ids, item.start_pos, item.rows, sampler=sampler
                )
        items.append(item)
    return items


def _samples_plainly(request: Request) -> bool:
    """Whether a request's rows need only its sampler: no processors, logprobs, grammar."""
    params = request.params
    return not params.logits_processors and params.logprobs is None and request.grammar is None


def _sample_together(backend: Backend, entries: Sequence[ScheduledSequence], out: Sampled) -> None:
    """Sample every entry's row for it and its forks with one ``backend.sample_rows``; a
    sampler that cannot be built fails its own request. When the call fails, each row is
    sampled again on its own, so only the request whose row fails fails."""
    seqs: list[Seq] = []
    samplers: list[Sampler] = []
    rows: list[int] = []
    for entry in entries:
        choices = (entry.seq, *entry.forks)
        try:
            built = [_sampler_of(backend, s) for s in choices]
        except Exception as exc:  # a grammar llama.cpp refused, a chain it could not build
            request = entry.seq.request
            out.failed[request.request_id] = (request, _sampler_failure(exc))
            continue
        assert entry.item.row is not None
        seqs.extend(choices)
        samplers.extend(built)
        rows.extend([entry.item.row] * len(choices))
    if not seqs:
        return
    try:
        tokens = backend.sample_rows(samplers, rows)
    except Exception:
        for seq, sampler, row in zip(seqs, samplers, rows, strict=True):
            if seq.request.request_id in out.failed:
                continue
            try:
                (out.tokens[seq],) = backend.sample_rows([sampler], [row])
            except Exception as exc:
                out.failed[seq.request.request_id] = (seq.request, _sampler_failure(exc))
        return
    for seq, token in zip(seqs, tokens, strict=True):
        out.tokens[seq] = token


def _sampler_failure(exc: Exception) -> RequestFailedError:
    if isinstance(exc, RequestFailedError):
        return exc
    error = RequestFailedError(f"the native sampler failed: {exc!r}")
    error.__cause__ = exc
    return error


def sample_row(backend: Backend, seq: Seq, row: int) -> tuple[int, TokenLogprob | None]:
    """Sample ``seq``'s next token from ``row`` as :func:`sample_plan` would (processors,
    native chain, logprobs), for speculative verification, which samples row by row.

    Raises:
        RequestFailedError: a logits processor or the native sampler failed.
    """
    return _sample_row(backend, (seq,), row)[0]


def _sample_row(
    backend: Backend, seqs: Sequence[Seq], row: int
) -> list[tuple[int, TokenLogprob | None]]:
    """Run the request's processors on ``row`` once (with the first sequence's history),
    then sample it for each of ``seqs`` (a sequence and the forks sharing its row).

    Raises:
        RequestFailedError: a logits processor or a native sampler failed.
    """
    params = seqs[0].request.params
    after = params.logprobs_after_sampling  # the chain reports them as it samples
    wants_logprobs = params.logprobs is not None and not after
    logits = backend.logits(row) if params.logits_processors or wants_logprobs else None
    if params.logits_processors:
        assert logits is not None
        error = _run_processors(params.logits_processors, _history(seqs[0]), logits)
        if error is not None:
            raise error
    log_z = _log_partition(logits) if wants_logprobs and logits is not None else 0.0
    picks: list[tuple[int, TokenLogprob | None]] = []
    for seq in seqs:
        logprob = None
        try:
            if after:
                drawn = _sample_drawn(backend, seq, row, params.logprobs or 0)
                token, logprob = drawn.token, _drawn_logprob(backend, drawn)
            else:
                token = _sample(backend, seq, row)
        except RequestFailedError:
            raise
        except Exception as exc:  # a sampler llama.cpp could not build or run
            raise RequestFailedError(f"the native sampler failed: {exc!r}") from exc
        if wants_logprobs and logits is not None and params.logprobs is not None:
            logprob = _token_logprob(backend, logits, log_z, token, params.logprobs)
        picks.append((token, logprob))
    return picks


def _sample(backend: Backend, seq: Seq, row: int) -> int:
    """Sample ``seq``'s token from ``row``, building its sampler chain on first use."""
    return backend.sample(_sampler_of(backend, seq), row)


def _sample_drawn(backend: Backend, seq: Seq, row: int, limit: int) -> Drawn:
    """:func:`_sample`, with the distribution the chain drew from."""
    return backend.sample_drawn(_sampler_of(backend, seq), row, limit)


def _sampler_of(backend: Backend, seq: Seq) -> Sampler:
    if seq.sampler is None:
        request = seq.request
        seed = (request.seed + seq.index) % 2**32
        # a sequence that may draft verifies several rows a step on the host: going back
        # and forth would make llama.cpp reserve its graph again at every step
        plain = _samples_plainly(request) and seq.draft_state is None
        if plain and isinstance(backend, GraphSampling) and backend.samples_in_graph:
            seq.sampler = backend.new_sampler(  # a chain the decode may run
                request.params, seed, _history(seq), grammar=request.grammar, graph=True
            )
            return seq.sampler
        seq.sampler = backend.new_sampler(
            request.params, seed, _history(seq), grammar=request.grammar
        )
    return seq.sampler


def _run_batch_hook(
    backend: Backend,
    entries: Sequence[ScheduledSequence],
    hook: BatchLogitsProcessor,
    out: Sampled,
) -> None:
    view = backend.batch_logits(len(entries))
    described = [LogitsRow(e.seq.request.request_id, e.seq.index, _history(e.seq)) for e in entries]
    try:
        hook(described, view)
    except BaseException as exc:  # a user callback: its failure ends these requests only
        for entry in entries:
            request = entry.seq.request
            error = _user_failure(f"the batch logits processor failed: {exc!r}", exc)
            out.failed.setdefault(request.request_id, (request, error))


def _history(seq: Seq) -> list[int]:
    """The tokens a sampler or a logits processor sees: image placeholders left out."""
    return text_only(seq.token_ids) if seq.request.images else seq.token_ids


def _run_processors(
    processors: Sequence[LogitsProcessor], token_ids: Sequence[int], logits: npt.NDArray[np.float32]
) -> RequestFailedError | None:
    history = np.asarray(token_ids, dtype=np.int32)
    for fn in processors:
        try:
            result = fn(history, logits)
        except BaseException as exc:  # a user callback: its failure ends its request only
            return _user_failure(f"logits processor {fn!r} raised {exc!r}", exc)
        if result is None or result is logits:
            continue
        if (
            not isinstance(result, np.ndarray)
            or result.shape != logits.shape
            or result.dtype != np.float32
        ):
            shape = getattr(result, "shape", None)
            dtype = getattr(result, "dtype", type(result).__name__)
            return RequestFailedError(
                f"logits processor {fn!r} must return None or a float32 array of shape "
                f"{logits.shape}, got {dtype} {shape}"
            )
        logits[:] = result
    return None


def _log_partition(logits: npt.NDArray[np.float32]) -> float:
    peak = float(logits.max())
    return peak + float(np.log(np.exp(logits - peak, dtype=np.float64).sum()))


def _token_logprob(
    backend: Backend, logits: npt.NDArray[np.float32], log_z: float, token: int, k: int
) -> TokenLogprob:
    top: list[TopLogprob] = []
    if k:
        best = np.argpartition(logits, -k)[-k:]
        for t in best[np.argsort(-logits[best], kind="stable")]:
            top.append(_top(backend, int(t), float(logits[t]) - log_z))
    first = _top(backend, token, float(logits[token]) - log_z)
    return TokenLogprob(first.token_id, first.token, first.bytes, first.logprob, tuple(top))


def _drawn_logprob(backend: Backend, drawn: Drawn) -> TokenLogprob:
    """The logprobs of the distribution the chain drew from (``logprobs_after_sampling``)."""
    top = tuple(
        _top(backend, t, math.log(p)) for t, p in zip(drawn.top_ids, drawn.top_probs, strict=True)
    )
    first = _top(backend, drawn.token, math.log(drawn.prob) if drawn.prob > 0 else -math.inf)
    return TokenLogprob(first.token_id, first.token, first.bytes, first.logprob, top)


def _top(backend: Backend, token: int, logprob: float) -> TopLogprob:
    piece = backend.token_to_piece(token)
    return TopLogprob(token, piece.decode("utf-8", "replace"), piece, logprob)
