"""Engine-side request and sequence records, and their state machine.

Only :mod:`llamax.engine.sched.scheduler` changes ``Sequence.state``. A :class:`Request` holds one
:class:`Sequence` per requested choice (``n``); each sequence owns its own KV sequence id,
sampler, detokenizer and stop matcher.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from concurrent.futures import Future
from enum import Enum
from typing import TYPE_CHECKING, Protocol

from ..adapters import NO_ADAPTERS, AdapterSet
from ..params import SamplingParams
from ..results import Choice, Completion, FinishReason, TokenEvent, TokenLogprob, Usage
from ..text import Detokenizer, StopMatcher, StopStrings

if TYPE_CHECKING:
    from ..backend.base import Sampler
    from .images import PromptImage
    from .kv.kvcache import Slot
    from .spec.speculative import DraftState

__all__ = ["TERMINAL_STATES", "Receiver", "Request", "Sequence", "SequenceState"]


class Receiver(Protocol):
    """What the engine needs of a request's caller side (the facade's ``RequestHandle``):
    the future it settles, and where it publishes the request's events."""

    @property
    def future(self) -> Future[Completion]:
        """Settled with the :class:`Completion` or the request's error."""
        ...

    def _publish(self, events: list[object]) -> None:
        """Deliver events; called on the engine thread, never under an engine lock."""
        ...


class SequenceState(Enum):
    """Lifecycle of one sequence. A preempted sequence goes back to WAITING."""

    WAITING = "waiting"
    """Queued; holds no sequence id and no KV cells."""
    PREFILLING = "prefilling"
    """Holds a sequence id; its prompt is being computed in chunks."""
    DECODING = "decoding"
    """Generating one token per step."""
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_CANCELLED = "finished_cancelled"
    FINISHED_ERROR = "finished_error"


TERMINAL_STATES = frozenset(
    {
        SequenceState.FINISHED_STOPPED,
        SequenceState.FINISHED_LENGTH,
        SequenceState.FINISHED_CANCELLED,
        SequenceState.FINISHED_ERROR,
    }
)

FINISH_REASONS = {
    SequenceState.FINISHED_STOPPED: FinishReason.STOP,
    SequenceState.FINISHED_LENGTH: FinishReason.LENGTH,
    SequenceState.FINISHED_CANCELLED: FinishReason.CANCELLED,
}


class Request:
    """One ``add_request`` call as the engine sees it."""

    __slots__ = (
        "_fair_key",
        "adapters",
        "arrival",
        "grammar",
        "handle",
        "images",
        "num_cached_tokens",
        "params",
        "priority",
        "prompt_token_ids",
        "request_id",
        "seed",
        "sequences",
        "session_id",
        "stop_strings",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        handle: Receiver,
        *,
        token_to_piece: Callable[[int], bytes],
        seed: int = 0,
        priority: int = 0,
        arrival: int = 0,
        num_choices: int = 1,
        session_id: int | None = None,
        grammar: str | None = None,
        adapters: AdapterSet = NO_ADAPTERS,
        images: tuple[PromptImage, ...] = (),
        fair_key: str | None = None,
    ) -> None:
        self.request_id = request_id
        self._fair_key = fair_key
        self.images = images
        """The prompt's images, by position (:mod:`llamax.engine.images`): their positions in
        ``prompt_token_ids`` hold placeholder ids."""
        self.adapters = adapters
        """The LoRA adapter set every step of the request runs under (``()``: none)."""
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.handle = handle
        self.seed = seed
        self.priority = priority
        self.arrival = arrival
        self.num_cached_tokens = 0
        self.session_id = session_id
        """The session whose pinned slot the request runs in, if any."""
        self.grammar = grammar
        """GBNF text (from ``params.grammar`` or the converted ``params.json_schema``)."""
        self.stop_strings = StopStrings(params.stop)
        """``params.stop`` compiled once; every sequence's stop matcher shares it."""
        self.sequences = [Sequence(self, i, token_to_piece) for i in range(num_choices)]

    @property
    def fair_key(self) -> Hashable:
        """Whose share of the sequence ids this request draws on
        (:mod:`llamax.engine.sched.fair_share`): the ``fair_key`` it was submitted with
        (requests that share one take turns as one), else the request itself."""
        return self if self._fair_key is None else self._fair_key

    @property
    def hint_owner(self) -> str | None:
        """Whose share of the prefix tiers' hinted bytes this request's hints draw on:
        the ``fair_key`` it was submitted with (None: the one share of requests without
        a key). See :class:`~llamax.engine.kv.prefix_tier.ByteLRU`."""
        return self._fair_key

    @property
    def is_finished(self) -> bool:
        """Whether every sequence reached a terminal state."""
        return all(seq.state in TERMINAL_STATES for seq in self.sequences)

    def completion(self) -> Completion:
        """Build the final result (only once every sequence is finished)."""
        choices = tuple(seq.choice() for seq in self.sequences)
        drafts = [seq.draft_state for seq in self.sequences if seq.draft_state is not None]
        usage = Usage(
            prompt_tokens=len(self.prompt_token_ids),
            completion_tokens=sum(len(c.token_ids) for c in choices),
            cached_tokens=self.num_cached_tokens,
            drafted_tokens=sum(d.num_drafted for d in drafts),
            accepted_tokens=sum(d.num_accepted for d in drafts),
        )
        return Completion(request_id=self.request_id, choices=choices, usage=usage)


class Sequence:
    """One continuation being generated. ``token_ids`` is prompt + generated so far."""

    __slots__ = (
        "branch_at",
        "checkpoint_from",
        "detokenizer",
        "draft_state",
        "head_at",
        "index",
        "logprobs",
        "num_prompt_tokens",
        "request",
        "sampler",
        "slot",
        "state",
        "stop_matcher",
        "text_parts",
        "token_ids",
    )

    def __init__(
        self, request: Request, index: int, token_to_piece: Callable[[int], bytes]
    ) -> None:
        self.request = request
        self.index = index
        self.token_ids: list[int] = list(request.prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.slot: Slot | None = None
        self.sampler: Sampler | None = None
        self.draft_state: DraftState | None = None
        """Set by the scheduler when the sequence may draft (speculative decoding)."""
        self.branch_at = 0
        """Where the prompt parts from a prefix another slot holds but cannot be cut at (a
        memory cut only at checkpoints): the prompt takes a checkpoint there too, so the
        next prompt that shares it reuses it (0: none; set at admission)."""
        self.checkpoint_from = 0
        """Where the prompt's computation started (the prefix it reused; set at admission)
        on a memory cut only at checkpoints: its interval checkpoints count from there
        (:func:`~llamax.engine.kv.checkpoints.checkpoint_positions`)."""
        self.head_at = 0
        """Where the prompt's head ends (just past its first end-of-turn token: a chat's
        system message) on a memory cut only at checkpoints: the prompt takes a checkpoint
        there, so a later prompt that keeps the head and drops what followed it (a history
        shift) reuses it (:func:`~llamax.engine.kv.checkpoints.head_point`). 0: none."""
        self.state = SequenceState.WAITING
        self.detokenizer = Detokenizer(token_to_piece)
        self.stop_matcher = StopMatcher(request.stop_strings)
        self.text_parts: list[str] = []
        self.logprobs: list[TokenLogprob] | None = (
            [] if request.params.logprobs is not None else None
        )

    @property
    def num_computed(self) -> int:
        """Tokens of this sequence held in the KV cache (its slot's tokens)."""
        return len(self.slot.tokens) if self.slot is not None else 0

    @property
    def num_generated(self) -> int:
        """Tokens generated so far (kept across preemption)."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_pending(self) -> int:
        """Tokens known but not yet in the KV cache."""
        return len(self.token_ids) - self.num_computed

    @property
    def sort_key(self) -> tuple[int, int, int]:
        """Queue order: priority (lower first), then arrival, then choice index."""
        return (self.request.priority, self.request.arrival, self.index)

    def push_token(self, token: int) -> tuple[str, bool]:
        """Append a generated token; return the text it releases and whether a stop matched."""
        self.token_ids.append(token)
        text, matched = self.stop_matcher.feed(self.detokenizer.feed(token))
        self.text_parts.append(text)
        return text, matched

    def drain_text(self) -> str:
        """At the end of a stream that did not hit a stop string, release what is held back."""
        text, matched = self.stop_matcher.feed(self.detokenizer.flush())
        if not matched:
            text += self.stop_matcher.flush()
        self.text_parts.append(text)
        return text

    def final_event(
        self, text: str, token_ids: tuple[int, ...], logprobs: tuple[TokenLogprob, ...] = ()
    ) -> TokenEvent:
        """The last event of this sequence (its state must be terminal)."""
        return TokenEvent(text, token_ids, self.index, FINISH_REASONS.get(self.state), logprobs)

    def choice(self) -> Choice:
        """This sequence as a finished :class:`Choice`."""
        return Choice(
            index=self.index,
            text="".join(self.text_parts),
            token_ids=tuple(self.token_ids[self.num_prompt_tokens :]),
            finish_reason=FINISH_REASONS[self.state],
            logprobs=tuple(self.logprobs) if self.logprobs is not None else None,
        )
