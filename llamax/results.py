"""What requests produce: streaming :class:`TokenEvent` s and a final :class:`Completion`."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

__all__ = [
    "Choice",
    "Completion",
    "FinishReason",
    "PrefillProgress",
    "TokenEvent",
    "TokenLogprob",
    "TopLogprob",
    "Usage",
]


class FinishReason(str, Enum):
    """Why a sequence ended. Compares equal to its string value (``"stop"`` ...)."""

    STOP = "stop"
    """An end-of-generation token, a stop string or a stop token id."""
    LENGTH = "length"
    """``max_tokens`` was reached, or the sequence filled the context."""
    CANCELLED = "cancelled"
    """The request was cancelled; the text holds what was produced until then."""

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class TopLogprob:
    """One alternative token and its log-probability."""

    token_id: int
    token: str
    """The token's text (invalid UTF-8 shown as U+FFFD; see ``bytes``)."""
    bytes: bytes
    logprob: float


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A generated token's log-probability and the most likely alternatives (sorted)."""

    token_id: int
    token: str
    bytes: bytes
    logprob: float
    top_logprobs: tuple[TopLogprob, ...]


@dataclass(frozen=True, slots=True)
class PrefillProgress:
    """How far a prompt has been computed (``SamplingParams(prefill_progress=True)``)."""

    num_prompt_tokens: int
    num_cached_tokens: int
    """Prompt tokens the cache held when the prompt was admitted (not computed)."""
    num_computed_tokens: int
    """Prompt tokens in the KV cache now, the cached ones included."""


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One streaming step of one choice.

    ``text`` is the newly complete text (possibly empty while a multi-byte character or a
    possible stop string is held back). Joining every event's ``text`` of a choice gives
    that choice's final text. The last event of a choice carries its ``finish_reason``.
    """

    text: str
    token_ids: tuple[int, ...]
    index: int = 0
    finish_reason: FinishReason | None = None
    logprobs: tuple[TokenLogprob, ...] = ()
    """One entry per token in ``token_ids`` when the request asked for ``logprobs``."""
    progress: PrefillProgress | None = None
    """Set on the progress events of a request that asked for ``prefill_progress`` (they
    carry no text and no tokens)."""


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts of one request. The prompt is counted once, whatever ``n`` is.

    With speculative decoding, ``drafted_tokens`` were proposed and verified and
    ``accepted_tokens`` of them were kept (both summed over the ``n`` choices).
    """

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        """Prompt plus completion tokens."""
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class Choice:
    """One continuation of a prompt.

    ``token_ids`` are the generated tokens, without a final end-of-generation or stop token.
    When a stop string matched, ``text`` is cut before it, while ``token_ids`` still hold
    the tokens that spelled it.
    """

    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    logprobs: tuple[TokenLogprob, ...] | None = None
    """Per generated token, when the request asked for ``logprobs``."""


@dataclass(frozen=True, slots=True)
class Completion:
    """The final result of a request: one :class:`Choice` per requested continuation."""

    request_id: str
    choices: tuple[Choice, ...]
    usage: Usage

    @property
    def text(self) -> str:
        """The text of the first choice."""
        return self.choices[0].text

    @property
    def token_ids(self) -> tuple[int, ...]:
        """The generated token ids of the first choice."""
        return self.choices[0].token_ids

    @property
    def finish_reason(self) -> FinishReason:
        """Why the first choice ended."""
        return self.choices[0].finish_reason

    @property
    def logprobs(self) -> tuple[TokenLogprob, ...] | None:
        """The first choice's per-token logprobs (None unless the request asked for them)."""
        return self.choices[0].logprobs
