"""OpenAI's chat and text completions, the request side: :func:`parse_chat` and
:func:`parse_text` take a ``POST /v1/chat/completions`` or ``POST /v1/completions`` body to
the call it asks for (:class:`~llamax.chat.ChatCall`, :class:`~llamax.chat.TextCall`) and
what reading its reply needs. Pure: no context, no server. The fields are checked against
:data:`~llamax.dialects.openai.CHAT` and :data:`~llamax.dialects.openai.COMPLETIONS`, then
their JSON types strictly (:mod:`llamax.dialects.json_types`); the sampling fields come from
:class:`~llamax.SamplingParams` (each option with an OpenAI default), and their value ranges
are the call's business, so the two layers never disagree about what is valid.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, Union

from typing_extensions import TypedDict

from ..chat import ChatCall, TextCall
from ..params import SamplingParams
from .json_types import FieldError, read_fields
from .openai import CHAT, COMPLETIONS

__all__ = [
    "CHAT_TYPES",
    "DEFAULT_COMPLETION_TOKENS",
    "MAX_STOP_STRINGS",
    "MAX_TEMPERATURE",
    "TEXT_TYPES",
    "ChatRequest",
    "StreamOptions",
    "TextRequest",
    "chat_options",
    "parse_chat",
    "parse_text",
    "sampling_types",
]

MAX_STOP_STRINGS = 400
"""Most ``stop`` strings one request may give over HTTP."""
MAX_TEMPERATURE = 2.0
"""OpenAI's largest ``temperature``."""
DEFAULT_COMPLETION_TOKENS = 16
"""``/v1/completions``' ``max_tokens`` when a request gives none (OpenAI's default)."""


class StreamOptions(TypedDict):
    """OpenAI's ``stream_options`` (each false when not given)."""

    include_usage: bool
    include_obfuscation: bool
    """Accepted; no obfuscation padding is ever sent."""


_WIRE_TYPES: dict[str, Any] = {
    "stop": str | list[str] | None,
    "logit_bias": dict[str, float] | None,
    "speculative": bool | dict[str, int] | None,
    "lora": list[dict[str, str | int | float]] | dict[str, float] | None,
}
"""JSON shapes of the OpenAI options whose Python type is not a plain scalar."""

_SCALARS = (int, float, bool, str, type(None))


def _wire_type(name: str, hint: Any) -> Any:
    """``hint | None`` for a scalar option; a non-scalar one needs :data:`_WIRE_TYPES`.

    Raises:
        TypeError: a non-scalar option has no JSON shape.
    """
    if name in _WIRE_TYPES:
        return _WIRE_TYPES[name]
    parts = typing.get_args(hint) if typing.get_origin(hint) in (Union, types.UnionType) else ()
    if hint in _SCALARS or (parts and all(p in _SCALARS for p in parts)):
        return hint | None
    raise TypeError(f"the OpenAI option {name!r} ({hint}) needs a JSON shape in _WIRE_TYPES")


def sampling_types(params: type[SamplingParams] = SamplingParams) -> dict[str, Any]:
    """The JSON types of the fields chat and text completions share, in order: ``model``,
    each OpenAI option of ``params`` (``T | None``), then the streaming fields,
    ``response_format`` and ``user``.

    Args:
        params: ``SamplingParams`` or a subclass with more options.
    """
    hints = typing.get_type_hints(params)
    fields: dict[str, Any] = {"model": str | None}
    for f in dataclasses.fields(params):
        spec = f.metadata.get("llamax")  # an option's spec (llamax.optionspec)
        if spec is not None and spec.is_openai:
            fields[f.name] = _wire_type(f.name, hints[f.name])
    return fields | {
        "stream": bool | None,
        "stream_options": StreamOptions | None,
        "response_format": dict[str, Any] | None,
        "user": str | None,
    }


CHAT_TYPES: dict[str, Any] = sampling_types() | {
    "messages": list[dict[str, Any]],
    "max_completion_tokens": int | None,
    "logprobs": bool | None,
    "top_logprobs": int | None,
    "truncate": Literal["none", "oldest_messages"] | None,
    "tools": list[dict[str, Any]] | None,
    "tool_choice": str | dict[str, Any] | None,
    "parallel_tool_calls": bool | None,
    "reasoning_format": Literal["auto", "deepseek", "none"] | None,
    "enable_thinking": bool | None,
    "chat_template_kwargs": dict[str, Any] | None,
    "reasoning_effort": Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None,
    "timings_per_token": bool | None,
    "verbose": bool | None,
    "return_progress": bool | None,
    "prompt_cache_key": str | None,
    "prompt_cache_retention": Literal["in_memory", "24h", "in-memory"] | None,
}
"""``POST /v1/chat/completions``' fields and their JSON types (``messages`` is required
and not empty)."""

TEXT_TYPES: dict[str, Any] = sampling_types() | {
    "prompt": str | list[int],
    "logprobs": int | None,
    "echo": bool | None,
    "suffix": str | None,
}
"""``POST /v1/completions``' fields and their JSON types (``prompt`` is required)."""

_NOT_OPTIONS = ("model", "user", "stream", "stream_options", "timings_per_token", "verbose")
"""Fields that are not call options (``user`` is accepted and ignored; llama-server's
``timings_per_token`` and ``verbose`` are added to the response by the server)."""


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """A chat completion request, parsed: the call (the request's ``model`` in it), whether
    the reply streams, whether a stream ends with a usage chunk, the ``model`` as given,
    and llama-server's extras (a stream's usage chunk carries ``timings``; a whole reply
    carries ``__verbose``)."""

    call: ChatCall
    stream: bool
    include_usage: bool
    model: str | None
    timings_per_token: bool = False
    verbose: bool = False


@dataclass(frozen=True, slots=True)
class TextRequest:
    """A text completion request, parsed: as :class:`ChatRequest`, with ``echo`` (the
    prompt's text goes before each choice's) and ``suffix`` (the text after the
    completion: a fill-in-the-middle prompt; null or empty: none)."""

    call: TextCall
    stream: bool
    include_usage: bool
    model: str | None
    echo: bool = False
    suffix: str | None = None


def parse_chat(body: Mapping[str, Any], *, defaults: Mapping[str, Any] = {}) -> ChatRequest:
    """The call a ``POST /v1/chat/completions`` body asks for (:func:`chat_options`, then
    :meth:`ChatCall.of <llamax.chat.ChatCall.of>`). ``defaults``: call options for what
    the body leaves unset (a server's ``max_tokens`` and ``seed``).

    Raises:
        FieldError: a refused, unknown or missing field, a field of the wrong type, or a
            bad value of its own (:func:`chat_options`).
        InvalidRequestError: a bad value the call refuses.
    """
    values, options = chat_options(body)
    messages = options.pop("messages")
    call = ChatCall.of(messages, model=values.get("model"), **{**defaults, **options})
    return ChatRequest(call, *_reading(values), timings_per_token=bool(values.get(
        "timings_per_token")), verbose=bool(values.get("verbose")))  # fmt: skip


def chat_options(body: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A chat body's checked fields, and the call options they make (``messages`` among
    them): every check but the call's own (what llama-server's ``/apply-template`` needs
    to render a prompt). ``max_completion_tokens`` is read as ``max_tokens``,
    ``chat_template_kwargs.enable_thinking`` and ``reasoning_effort`` as
    ``enable_thinking`` (``none``/``minimal``: off), and ``parallel_tool_calls`` is
    dropped without tools (where it means nothing).

    Raises:
        FieldError: a refused, unknown or missing field, a field of the wrong type, or a
            bad ``temperature``, ``stop``, ``chat_template_kwargs`` or
            ``max_completion_tokens``.
    """
    values = read_fields(body, CHAT_TYPES, CHAT, "messages", non_empty=True)
    options = _options(values)
    effort = options.pop("reasoning_effort", None)
    if not options.get("tools"):
        options.pop("parallel_tool_calls", None)
    kwargs = options.pop("chat_template_kwargs", None)
    if kwargs is not None:
        unknown = sorted(set(kwargs) - {"enable_thinking"})
        thinking = kwargs.get("enable_thinking")
        if unknown or not isinstance(thinking, bool | None):
            raise _invalid(
                "chat_template_kwargs takes only enable_thinking (a boolean)"
                + (f"; got {', '.join(unknown)}" if unknown else ""),
                "chat_template_kwargs",
            )
        if thinking is not None:
            options.setdefault("enable_thinking", thinking)
    if effort is not None:
        options.setdefault("enable_thinking", effort not in ("none", "minimal"))
    newer = options.pop("max_completion_tokens", None)
    if newer is not None:
        if "max_tokens" in options:
            raise _invalid(
                "give max_tokens or max_completion_tokens, not both", "max_completion_tokens"
            )
        options["max_tokens"] = newer
    return values, options


def parse_text(body: Mapping[str, Any], *, defaults: Mapping[str, Any] = {}) -> TextRequest:
    """The call a ``POST /v1/completions`` body asks for: OpenAI's default of 16
    ``max_tokens`` unless the body or ``defaults`` (as :func:`parse_chat`) give one;
    ``echo`` and ``suffix`` are the caller's to apply.

    Raises:
        FieldError: a refused, unknown or missing field, or one of the wrong type.
        InvalidRequestError: a bad value (the call's own errors as well).
    """
    values = read_fields(body, TEXT_TYPES, COMPLETIONS, "prompt")
    options = {**defaults, **_options(values)}
    options.setdefault("max_tokens", DEFAULT_COMPLETION_TOKENS)
    prompt, echo, suffix = options.pop("prompt"), options.pop("echo", False), options.pop(
        "suffix", None)  # fmt: skip
    call = TextCall.of(prompt, model=values.get("model"), **options)
    return TextRequest(call, *_reading(values), echo=echo, suffix=suffix)


def _options(values: Mapping[str, Any]) -> dict[str, Any]:
    """The call options of checked fields (with the prompt field), their HTTP bounds
    checked: ``temperature`` up to OpenAI's :data:`MAX_TEMPERATURE` and at most
    :data:`MAX_STOP_STRINGS` stop strings."""
    temperature = values.get("temperature")
    if temperature is not None and temperature > MAX_TEMPERATURE:
        raise _invalid(
            f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {temperature}", "temperature"
        )
    stop = values.get("stop")
    if isinstance(stop, list) and len(stop) > MAX_STOP_STRINGS:
        raise _invalid(
            f"stop has {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed", "stop"
        )
    return {name: value for name, value in values.items() if name not in _NOT_OPTIONS}


def _reading(values: Mapping[str, Any]) -> tuple[bool, bool, str | None]:
    """``stream``, ``include_usage`` and ``model`` of checked fields."""
    usage = bool((values.get("stream_options") or {}).get("include_usage"))
    return bool(values.get("stream")), usage, values.get("model")


def _invalid(message: str, param: str) -> FieldError:
    return FieldError(message, param=param, code="invalid_value")
