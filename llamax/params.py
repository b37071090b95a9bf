"""Frozen, validated sampling parameters: :class:`SamplingParams` (a request's options; the
context's are in :mod:`llamax.config`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from .checks import field_checks, is_int, is_real, iterable, real, refuse_huge_ints, require, where
from .drafting import DraftMethod, Speculative
from .optionspec import spec

__all__ = [
    "MAX_LORA_SCALE",
    "MAX_STOP_CHARS",
    "MAX_STOP_STRINGS",
    "LogitsProcessor",
    "SamplingParams",
]


class LogitsProcessor(Protocol):
    """``fn(token_ids, logits) -> None | new_logits``; see :class:`SamplingParams`."""

    def __call__(
        self, token_ids: npt.NDArray[np.int32], logits: npt.NDArray[np.float32]
    ) -> npt.NDArray[np.float32] | None: ...


def _token_ids(name: str, value: Any) -> tuple[int, ...]:
    ids = iterable(name, value)
    for token in ids:
        require(
            isinstance(token, int) and token >= 0,
            f"{name} must hold token ids >= 0, got {token!r}",
            name,
        )
    return ids


def _processors(name: str, value: Any) -> tuple[Any, ...]:
    processors = iterable(name, value)
    for fn in processors:
        require(callable(fn), f"{name} must hold callables, got {fn!r}", name)
    return processors


def _logit_bias(name: str, value: Any) -> Mapping[int, float]:
    require(isinstance(value, Mapping), f"{name} must be a dict, got {type(value).__name__}", name)
    bias: dict[int, float] = {}
    for token, number in dict(value).items():
        require(
            isinstance(token, int) and token >= 0,
            f"{name} keys must be token ids >= 0, got {token!r}",
            name,
        )
        require(
            is_real(number) and not math.isnan(float(number)),
            f"{name} values must be numbers, got {number!r} for token {token}",
            name,
        )
        bias[token] = float(number)
    return MappingProxyType(bias)


def _speculative(name: str, value: Any) -> Any:
    require(
        value is None or isinstance(value, (bool, DraftMethod)),
        f"{name} must be None, a bool or a llamax.PromptLookup, got {type(value).__name__}",
        name,
    )
    return value


_penalty = real(lambda v: math.isfinite(v) and -2 <= v <= 2, "in [-2, 2]")


MAX_STOP_STRINGS = 1024
"""At most this many ``stop`` strings per request."""
MAX_STOP_CHARS = 65_536
"""At most this many characters in all of a request's ``stop`` strings together (64 Ki)."""


def _freeze_stop(name: str, value: Any) -> tuple[str, ...]:
    """``stop`` as a tuple of non-empty strings, within the count and size caps."""
    if value is None:
        return ()
    if isinstance(value, str):
        value = (value,)
    items = iterable("stop", value)
    require(
        len(items) <= MAX_STOP_STRINGS,
        f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(items)}",
        "stop",
    )
    for item in items:
        require(
            isinstance(item, str) and item != "",
            f"stop must hold non-empty strings, got {item!r}",
            "stop",
        )
    num_chars = sum(map(len, items))
    require(
        num_chars <= MAX_STOP_CHARS,
        f"stop strings may hold at most {MAX_STOP_CHARS} characters in all, got {num_chars}",
        "stop",
    )
    return items


_REAL_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "typical_p",
    "repeat_penalty",
    "presence_penalty",
    "frequency_penalty",
)


_NUMBER_FIELDS = (
    *_REAL_FIELDS,
    "max_tokens",
    "n",
    "top_k",
    "penalty_last_n",
    "seed",
    "logprobs",
    "logit_bias",
    "stop_token_ids",
    "lora",
)
"""The fields of :class:`SamplingParams` that are (or hold) numbers."""

MAX_LORA_SCALE = 100.0
"""A request's LoRA scales lie in ``[-MAX_LORA_SCALE, MAX_LORA_SCALE]`` (llama.cpp takes them
as ``float32``: ``1e39`` would run as infinity, and far smaller ones give only noise)."""


def _lora(name: str, value: object) -> dict[str | int, float] | None:
    """``SamplingParams.lora`` checked: adapter names (or load indices) to finite scales."""
    if value is None:
        return None
    require(
        isinstance(value, Mapping), f"lora must be a dict of name -> scale, got {value!r}", "lora"
    )
    assert isinstance(value, Mapping)
    checked: dict[str | int, float] = {}
    for key, scale in value.items():
        require(
            (isinstance(key, str) and key != "") or (is_int(key) and key >= 0),
            f"lora keys must be adapter names or load indices >= 0, got {key!r}",
            "lora",
        )
        require(
            is_real(scale) and math.isfinite(scale) and abs(scale) <= MAX_LORA_SCALE,
            f"lora scale for {key!r} must be a finite number in [-{MAX_LORA_SCALE:g}, "
            f"{MAX_LORA_SCALE:g}], got {scale!r}",
            "lora",
        )
        checked[key] = float(scale)
    return checked


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to sample one request. Immutable; every field is validated on construction.

    ``temperature=0`` means greedy decoding. Penalties look at the last ``penalty_last_n``
    tokens of prompt plus output (``-1`` means the whole context). ``seed=None`` draws a
    random seed; choice ``i`` of ``n`` uses ``seed + i``. ``stop`` strings are held back
    while they may still match and are trimmed from the text; there may be at most
    :data:`MAX_STOP_STRINGS` (1,024) of them, non-empty, with at most :data:`MAX_STOP_CHARS`
    (65,536) characters in all, and their cost per token does not grow with their number.
    ``stop_token_ids`` end the
    request when sampled. With ``ignore_eos`` the end-of-generation tokens are banned and
    generation runs to ``max_tokens``. ``n`` continuations share one prompt prefill.

    ``logprobs=k`` (0..20) reports each generated token's log-probability and its ``k`` most
    likely alternatives; with ``logprobs_after_sampling`` they are those of the distribution
    the sampler chain drew the token from (the candidates that top-k, typical-p, top-p and
    min-p kept, at the temperature; greedy: the token alone, probability 1), at most ``k``
    alternatives with a probability above 0. ``logits_processors`` are called in the engine
    thread as ``fn(token_ids, logits)`` with the sequence so far (``int32``) and a writable,
    zero-copy ``float32`` view of its logits row; they edit it in place (return ``None``) or
    return a new row, before the native sampler chain runs. ``grammar`` (GBNF) or ``json_schema``
    constrain the output through llama.cpp's grammar sampler.

    ``speculative`` turns speculative decoding on or off for this request (see
    docs/speculative.md): ``None`` follows the context's ``speculative`` setting, ``False``
    turns it off, ``True`` turns it on (with the context's method, else the default
    :class:`~llamax.PromptLookup`), and a :class:`~llamax.PromptLookup` picks the method.
    It never changes what is generated, only how fast.

    ``keep_prefix`` is a hint that this request's prompt will be asked for again (an
    agent's system prompt and tools; Anthropic's ``cache_control`` and OpenAI's
    ``prompt_cache_key`` set it): when the request ends, its cached prefix is kept longer
    than those of unhinted requests, in KV and in the RAM and disk tiers below it (see
    docs/kv-cache.md, "Hints: what is kept longest"). Like ``speculative``, it never
    changes what is generated.
    """

    max_tokens: int | None = field(
        default=256,
        metadata=spec(
            check=where(
                lambda v: v is None or (isinstance(v, int) and v >= 1),
                "must be a positive int or None",
            ),
            doc="most tokens to generate; `None`: until the sequence fills its context",
            flag=True,
            openai=None,
        ),
    )
    temperature: float = field(
        default=0.8,
        metadata=spec(
            check=real(lambda v: math.isfinite(v) and v >= 0, ">= 0"),
            doc="`0` is greedy",
            flag=True,
            openai=1.0,
        ),
    )
    top_k: int = field(
        default=40,
        metadata=spec(
            check=where(
                lambda v: is_int(v) and 0 <= v < 2**31, "must be an int >= 0 (0 disables it)"
            ),
            doc="sample among the `k` most likely tokens; `0` disables it",
            flag=True,
            openai=0,
        ),
    )
    top_p: float = field(
        default=0.95,
        metadata=spec(
            check=real(lambda v: 0 < v <= 1, "in (0, 1]"),
            doc="nucleus sampling: the most likely tokens whose probabilities sum to `p`; `1` "
            "disables it",
            flag=True,
            openai=1.0,
        ),
    )
    min_p: float = field(
        default=0.05,
        metadata=spec(
            check=real(lambda v: 0 <= v <= 1, "in [0, 1]"),
            doc="drop tokens less likely than `min_p` times the most likely one; `0` disables it",
            flag=True,
            openai=0.0,
        ),
    )
    typical_p: float = field(
        default=1.0,
        metadata=spec(
            check=real(lambda v: 0 < v <= 1, "in (0, 1]"),
            doc="locally typical sampling; `1` disables it",
            flag=True,
        ),
    )
    repeat_penalty: float = field(
        default=1.0,
        metadata=spec(
            check=real(lambda v: math.isfinite(v) and v > 0, "> 0"),
            doc="divides the logits of recent tokens; `1` disables it",
            flag=True,
            openai=1.0,
        ),
    )
    presence_penalty: float = field(
        default=0.0,
        metadata=spec(
            check=_penalty, doc="OpenAI's presence penalty, in [-2, 2]", flag=True, openai=0.0
        ),
    )
    frequency_penalty: float = field(
        default=0.0,
        metadata=spec(
            check=_penalty, doc="OpenAI's frequency penalty, in [-2, 2]", flag=True, openai=0.0
        ),
    )
    penalty_last_n: int = field(
        default=64,
        metadata=spec(
            check=where(lambda v: is_int(v) and v >= -1, "must be an int >= -1"),
            doc="how many recent tokens the penalties look at; `-1`: the whole context",
            flag=True,
        ),
    )
    logit_bias: Mapping[int, float] = field(
        default_factory=lambda: MappingProxyType({}),
        metadata=spec(
            check=_logit_bias,
            default_doc="`{}`",
            doc="`{token_id: bias}` added to the logits",
            openai=None,
            openai_doc="`{token_id: bias}`, keys as `int` or numeric `str`, values in [-100, 100]; "
            "-100 bans the token",
        ),
    )
    seed: int | None = field(
        default=None,
        metadata=spec(
            check=where(
                lambda v: v is None or (isinstance(v, int) and 0 <= v < 2**32),
                "must be None or an int in [0, 2**32)",
            ),
            doc="fixes the sampling; choice `i` of `n` uses `seed + i` (`None`: a random seed)",
            flag=True,
            openai=None,
        ),
    )
    stop: Sequence[str] = field(
        default=(),
        metadata=spec(
            check=_freeze_stop,
            doc="strings that end the reply, cut from the text (at most 1,024, with 65,536 "
            "characters in all)",
            openai=None,
            openai_doc="a string or a list of strings that end the reply, cut from the text",
        ),
    )
    stop_token_ids: Sequence[int] = field(
        default=(), metadata=spec(check=_token_ids, doc="token ids that end the reply when sampled")
    )
    ignore_eos: bool = field(
        default=False,
        metadata=spec(doc="ban the end-of-generation tokens: generate `max_tokens` tokens"),
    )
    n: int = field(
        default=1,
        metadata=spec(
            check=where(lambda v: isinstance(v, int) and 1 <= v <= 256, "must be in [1, 256]"),
            doc="choices, sharing one prompt prefill (at most 256)",
            openai=1,
        ),
    )
    logprobs: int | None = field(
        default=None,
        metadata=spec(
            check=where(
                lambda v: v is None or (isinstance(v, int) and 0 <= v <= 20),
                "must be None or an int in [0, 20]",
            ),
            doc="report each token's log-probability and its `k` (0..20) likeliest alternatives",
        ),
    )
    logprobs_after_sampling: bool = field(
        default=False,
        metadata=spec(
            check=where(lambda v: isinstance(v, bool), "must be a bool", show_type=True),
            doc="report `logprobs` of the distribution the sampler chain drew from (after "
            "top-k, typical-p, top-p, min-p and temperature; llama-server's "
            "`post_sampling_probs`), not the model's",
        ),
    )
    prefill_progress: bool = field(
        default=False,
        metadata=spec(
            check=where(lambda v: isinstance(v, bool), "must be a bool", show_type=True),
            doc="stream the prompt's prefill progress: events with `progress` (no text), one "
            "when it is admitted (what the cache held), one after each chunk computed",
        ),
    )
    logits_processors: Sequence[LogitsProcessor] = field(
        default=(),
        metadata=spec(
            check=_processors,
            doc="`fn(token_ids, logits)` called on each logits row before sampling",
        ),
    )
    grammar: str | None = field(
        default=None,
        metadata=spec(
            check=where(
                lambda v: v is None or (isinstance(v, str) and v.strip() != ""),
                "must be non-empty GBNF text",
            ),
            doc="a GBNF grammar the output must follow",
            openai=None,
        ),
    )
    json_schema: Mapping[str, Any] | None = field(
        default=None,
        metadata=spec(
            check=where(
                lambda v: v is None or isinstance(v, Mapping), "must be a dict", show_type=True
            ),
            doc="a JSON schema the output must follow (not with `grammar`)",
        ),
    )
    speculative: bool | Speculative | None = field(
        default=None,
        metadata=spec(
            check=_speculative,
            doc="speculative decoding: `None` follows the context, `True`/`False` turns it on/off, "
            "a `PromptLookup` picks the method",
            openai=None,
            openai_doc="speculative decoding on (`true`), off (`false`) or on with `PromptLookup` "
            'settings (`{"max_draft": 8}`); default: the context\'s',
        ),
    )

    keep_prefix: bool = field(
        default=False,
        metadata=spec(
            check=where(lambda v: isinstance(v, bool), "must be a bool", show_type=True),
            doc="a hint that this prompt will be asked for again: its prefix is kept longer "
            "than unhinted ones in KV and in the RAM and disk tiers (docs/kv-cache.md)",
        ),
    )

    lora: Mapping[str, float] | Mapping[int, float] | Mapping[str | int, float] | None = field(
        default=None,
        metadata=spec(
            check=_lora,
            doc="LoRA adapters for this request, by name (or load index) with their scales; "
            "`None` or `{}`: the base model (see docs/lora.md)",
            openai=None,
            openai_doc='adapters as llama-server takes them: `[{"name": "a", "scale": 1.0}]` '
            '(or `"id"`: the load index), or `{"a": 1.0}`',
        ),
    )

    def __post_init__(self) -> None:
        refuse_huge_ints(self, _NUMBER_FIELDS)
        for name, check in _SAMPLING_CHECKS:
            value = getattr(self, name)
            stored = check(name, value)
            if stored is not value:
                object.__setattr__(self, name, stored)
        require(
            self.grammar is None or self.json_schema is None,
            "grammar and json_schema cannot both be set",
            "json_schema",
        )
        require(
            self.logprobs is not None or not self.logprobs_after_sampling,
            "logprobs_after_sampling needs logprobs (how many alternatives to report)",
            "logprobs_after_sampling",
        )

    @property
    def is_greedy(self) -> bool:
        """Whether sampling always takes the most likely token."""
        return self.temperature == 0

    def with_stop_token_ids(self, token_ids: Sequence[int]) -> SamplingParams:
        """These params, also stopping at ``token_ids`` (those not already listed)."""
        extra = tuple(t for t in token_ids if t not in self.stop_token_ids)
        if not extra:
            return self
        return dataclasses.replace(self, stop_token_ids=(*self.stop_token_ids, *extra))

    @property
    def has_penalties(self) -> bool:
        """Whether any repetition penalty is active."""
        return (
            self.repeat_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        ) and self.penalty_last_n != 0


_SAMPLING_CHECKS = field_checks(SamplingParams)
"""What :meth:`SamplingParams.__post_init__` runs: every field's own check."""
