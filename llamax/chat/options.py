"""OpenAI request options: their names, and how they map onto :class:`SamplingParams`.

Unknown options raise ``TypeError`` naming the closest valid one, as the ``openai`` client
and llama-cpp-python do, rather than being ignored.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Literal, TypedDict

from ..drafting import PromptLookup
from ..errors import InvalidParameterError
from ..grammar import JSON_OBJECT_SCHEMA
from ..optionspec import openai_defaults
from ..params import SamplingParams
from ..reasoning import ReasoningFormat

__all__ = [
    "CACHE_RETENTIONS",
    "MAX_USER_CHARS",
    "ChatOptions",
    "CompletionOptions",
    "StreamOptions",
    "Truncate",
    "check_flag",
    "check_option_names",
    "check_text",
    "keeps_prefix",
    "one_of",
    "sampling_params",
]

Truncate = Literal["none", "oldest_messages"]

MAX_USER_CHARS = 256
"""Longest ``user`` (or ``safety_identifier``, ``prompt_cache_key``) string taken."""
CACHE_RETENTIONS = ("in_memory", "24h", "in-memory")
"""The ``prompt_cache_retention`` values taken (``in-memory``: an older spelling)."""


class StreamOptions(TypedDict, total=False):
    """OpenAI's ``stream_options``."""

    include_usage: bool


class CompletionOptions(TypedDict, total=False):
    """Options shared by chat and text completions (OpenAI names and defaults).

    A static mirror, for type checkers, of :class:`~llamax.SamplingParams`' OpenAI options
    (the fields whose spec has an ``openai`` default) plus OpenAI's own (``model``, ``user``,
    ``stream_options``, ``logprobs``, ``top_logprobs``, ``response_format``); a test pins
    that the two agree.
    """

    max_tokens: int | None
    temperature: float
    top_p: float
    stop: str | Sequence[str] | None
    n: int
    seed: int | None
    logit_bias: Mapping[str | int, float] | None
    presence_penalty: float
    frequency_penalty: float
    stream_options: StreamOptions | None
    model: str | None
    """Echoed as the response's ``model`` (default: the GGUF's name); picks nothing."""
    user: str | None
    logprobs: bool | int | None
    top_logprobs: int | None
    response_format: Mapping[str, Any] | None
    top_k: int
    """llama.cpp extension (0, OpenAI's behaviour, disables it)."""
    min_p: float
    """llama.cpp extension (0 disables it)."""
    repeat_penalty: float
    """llama.cpp extension (1 disables it)."""
    grammar: str | None
    """llama.cpp extension: a GBNF grammar constraining the output."""
    speculative: bool | Mapping[str, int] | None
    """llamax extension: speculative decoding on (``true``), off (``false``), or on with
    :class:`~llamax.PromptLookup` settings (``{"max_draft": 8}``); default: the context's."""
    lora: Sequence[Mapping[str, Any]] | Mapping[str, float] | None
    """llama-server extension: LoRA adapters for this request, ``[{"name": "a", "scale":
    1.0}]`` (or ``"id"``: the adapter's load index), or ``{"a": 1.0}``; see docs/lora.md."""


class ChatOptions(CompletionOptions, total=False):
    """Chat-only options."""

    truncate: Truncate
    """``"oldest_messages"`` drops the oldest whole turns when the conversation is too long."""
    parse_special_in_content: bool
    """llamax extension: parse special-token text in message content as special tokens
    (default False: content is plain text, so a user cannot forge ``<|im_start|>system``)."""
    tools: Sequence[Mapping[str, Any]] | None
    """OpenAI function tools; see docs/tools.md."""
    tool_choice: str | Mapping[str, Any] | None
    """``"none"``, ``"auto"`` (default with tools), ``"required"`` or a named function."""
    parallel_tool_calls: bool | None
    """Whether one reply may hold several calls (default True with tools)."""
    reasoning_format: ReasoningFormat
    """llamax/llama-server extension: ``"auto"`` (default) puts a thinking model's
    ``<think>…</think>`` in ``message.reasoning_content``; ``"none"`` leaves it in
    ``content`` (:mod:`llamax.reasoning`)."""
    enable_thinking: bool | None
    """llamax extension: passed to chat templates that take it (Qwen3: ``False`` renders an
    empty thinking, so the model answers at once); default: the template's."""
    return_progress: bool
    """llama-server extension: a stream's chunks report the prompt's progress
    (``prompt_progress``: ``total``, ``cache``, ``processed``, ``time_ms``) while it is
    computed, in chunks of their own before the reply (``SamplingParams.prefill_progress``)."""
    prompt_cache_key: str | None
    """OpenAI's cache key (a string of at most 256 characters): any key is a hint that the
    prompt will be asked for again, so its prefix is kept longer
    (``SamplingParams.keep_prefix``). The key itself routes nothing: one server has one
    cache, and every shared prefix is reused whatever the key."""
    prompt_cache_retention: str | None
    """OpenAI's ``in_memory`` or ``24h`` (``in-memory`` too): either is the same hint as
    ``prompt_cache_key``."""
    keep_prefix: bool
    """llamax extension: ``SamplingParams.keep_prefix`` itself (the prefix is kept longer);
    what ``prompt_cache_key`` and Anthropic's ``cache_control`` set."""


OPENAI_ONLY = frozenset(
    {"model", "user", "stream", "stream_options", "logprobs", "top_logprobs", "response_format"}
)
"""Completion options that are OpenAI's own shapes rather than ``SamplingParams`` fields."""
COMPLETION_OPTIONS = frozenset(openai_defaults(SamplingParams)) | OPENAI_ONLY
CHAT_OPTIONS = frozenset(ChatOptions.__annotations__) | COMPLETION_OPTIONS


def check_flag(value: object, name: str) -> bool:
    """``value`` (a request's ``stream``, ``store`` ...) as a bool: it must be one (or
    ``None``, False). A string such as ``"no"`` is truthy, so taking it would stream or store
    what the client asked not to.

    Raises:
        InvalidParameterError: ``value`` is neither a bool nor None.
    """
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidParameterError(
            f"{name} must be a boolean, got {type(value).__name__}", param=name
        )
    return value


def check_option_names(options: Collection[str], allowed: Collection[str], where: str) -> None:
    """Raise ``TypeError`` for the first unknown option, suggesting the closest valid one.

    Raises:
        TypeError: ``where() got an unexpected keyword argument 'temprature' (did you mean
            'temperature'?)``.
    """
    for name in options:
        if name not in allowed:
            close = difflib.get_close_matches(name, sorted(allowed), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise TypeError(f"{where}() got an unexpected keyword argument {name!r}{hint}")


def check_text(name: str, value: Any) -> None:
    """A string of at most :data:`MAX_USER_CHARS` characters, or null."""
    if value is not None and (not isinstance(value, str) or len(value) > MAX_USER_CHARS):
        raise InvalidParameterError(
            f"{name} must be a string of at most {MAX_USER_CHARS} characters", param=name
        )


def one_of(*values: str) -> Callable[[str, Any], None]:
    """A check that the value is one of ``values`` (or null)."""

    def check(name: str, value: Any) -> None:
        if value is not None and value not in values:
            raise InvalidParameterError(
                f"{name} must be one of {', '.join(values)}; got {value!r}", param=name
            )

    return check


def keeps_prefix(options: Mapping[str, Any]) -> bool:
    """Whether a chat request's options hint that its prompt will be asked for again:
    ``keep_prefix``, or OpenAI's ``prompt_cache_key`` or ``prompt_cache_retention`` given
    (``SamplingParams.keep_prefix``).

    Raises:
        InvalidParameterError: ``keep_prefix`` is not a bool, the key not a string of at
            most 256 characters, or the retention not ``in_memory`` or ``24h``.
    """
    keep = check_flag(options.get("keep_prefix"), "keep_prefix")
    key, retention = options.get("prompt_cache_key"), options.get("prompt_cache_retention")
    check_text("prompt_cache_key", key)
    one_of(*CACHE_RETENTIONS)("prompt_cache_retention", retention)
    return keep or key is not None or retention is not None


def sampling_params(options: CompletionOptions, *, chat: bool) -> SamplingParams:
    """Map OpenAI's knobs onto :class:`SamplingParams`. Like OpenAI, top-k and min-p are off
    unless the llama.cpp extensions ``top_k``/``min_p`` ask for them.

    Raises:
        InvalidParameterError: a value is out of range or of the wrong shape.
    """
    special = _SPECIAL
    defaults = openai_defaults(SamplingParams)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(SamplingParams):  # in field order, as errors are raised
        if f.name in special:
            kwargs[f.name] = special[f.name](options, chat)
        elif f.name in defaults:
            kwargs[f.name] = options.get(f.name, defaults[f.name])
    return SamplingParams(**kwargs)


def _lora(value: object) -> dict[str | int, float] | None:
    """llama-server's ``[{"id" | "name", "scale"}]`` (or a name -> scale object) as
    ``SamplingParams.lora``."""
    if value is None or isinstance(value, Mapping):
        return None if value is None else dict(value)
    if not isinstance(value, list):
        raise InvalidParameterError(
            f"lora must be a list of adapters, got {type(value).__name__}", param="lora"
        )
    adapters: dict[str | int, float] = {}
    for index, entry in enumerate(value):
        where = f"lora[{index}]"
        if not isinstance(entry, Mapping):
            raise InvalidParameterError(f"{where} must be an object, got {entry!r}", param=where)
        unknown = sorted(set(entry) - {"id", "name", "scale"})
        if unknown:
            raise InvalidParameterError(f"{where} has unknown field {unknown[0]!r}", param=where)
        if ("id" in entry) == ("name" in entry):
            raise InvalidParameterError(f"{where} needs one of 'id' or 'name'", param=where)
        key = entry["id"] if "id" in entry else entry["name"]
        if isinstance(key, bool) or not isinstance(key, (int, str)):
            raise InvalidParameterError(f"{where}: id must be an int and name a str", param=where)
        if key in adapters:
            raise InvalidParameterError(f"{where}: adapter {key!r} is given twice", param=where)
        adapters[key] = entry.get("scale", 1.0)
    return adapters


def _speculative(value: object) -> bool | PromptLookup | None:
    if value is None or isinstance(value, bool):
        return value
    if not isinstance(value, Mapping):
        raise InvalidParameterError(
            f"speculative must be a bool or an object, got {type(value).__name__}",
            param="speculative",
        )
    known = {f.name for f in dataclasses.fields(PromptLookup)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise InvalidParameterError(
            f"speculative has unknown field {unknown[0]!r}; known: {', '.join(sorted(known))}",
            param="speculative",
        )
    try:
        return PromptLookup(**value)
    except InvalidParameterError as exc:  # about a PromptLookup field: name it in the request
        exc.param = f"speculative.{exc.param}" if exc.param else "speculative"
        raise


def _logit_bias(logit_bias: Mapping[str | int, float] | None) -> dict[int, float]:
    bias: dict[int, float] = {}
    if not isinstance(logit_bias, (Mapping, type(None))):
        raise InvalidParameterError(
            f"logit_bias must be a dict, got {type(logit_bias).__name__}", param="logit_bias"
        )
    for token, value in (logit_bias or {}).items():
        try:
            token_id = int(token)
        except (TypeError, ValueError) as exc:
            raise InvalidParameterError(
                f"logit_bias keys must be token ids, got {token!r}", param="logit_bias"
            ) from exc
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InvalidParameterError(
                f"logit_bias values must be numbers, got {value!r}", param="logit_bias"
            )
        if not -100 <= value <= 100:
            raise InvalidParameterError(
                f"logit_bias values must be in [-100, 100], got {value}", param="logit_bias"
            )
        bias[token_id] = -math.inf if value == -100 else float(value)
    return bias


def _logprobs(options: CompletionOptions, *, chat: bool) -> int | None:
    """Chat: ``logprobs=True`` plus ``top_logprobs=k``; text: ``logprobs=k``."""
    wanted = options.get("logprobs")
    if chat:
        top = options.get("top_logprobs")
        if top and not wanted:
            raise InvalidParameterError("top_logprobs needs logprobs=True", param="top_logprobs")
        if top is not None and (isinstance(top, bool) or not isinstance(top, int)
                                or not 0 <= top <= 20):  # fmt: skip
            raise InvalidParameterError(  # OpenAI's name, not SamplingParams' logprobs
                f"top_logprobs must be an int in [0, 20], got {top!r}", param="top_logprobs"
            )
        return (top or 0) if wanted else None
    if wanted is None or wanted is False:
        return None
    if not isinstance(wanted, int):
        raise InvalidParameterError(
            f"logprobs must be an int in [0, 20], got {wanted!r}", param="logprobs"
        )
    return int(wanted)


def _response_schema(response_format: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """``{"type": "json_object"}`` → any object; ``{"type": "json_schema", "json_schema":
    {"schema": {...}}}`` → that schema; ``{"type": "text"}`` or None → unconstrained.

    Raises:
        InvalidParameterError: ``response_format`` or its ``json_schema`` is not an object,
            the type is unknown, or the schema is missing.
    """
    if response_format is None:
        return None
    if not isinstance(response_format, Mapping):
        raise InvalidParameterError(
            f"response_format must be an object, got {type(response_format).__name__}",
            param="response_format",
        )
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return JSON_OBJECT_SCHEMA
    if kind == "json_schema":
        wrapper = response_format.get("json_schema")
        if not isinstance(wrapper, Mapping):
            raise InvalidParameterError(
                'response_format json_schema must be an object like {"name": ..., '
                f'"schema": {{...}}}}, got {type(wrapper).__name__}',
                param="response_format.json_schema",
            )
        schema = wrapper.get("schema")
        if not isinstance(schema, Mapping):
            raise InvalidParameterError(
                "response_format json_schema needs a 'schema' object",
                param="response_format.json_schema",
            )
        return schema
    raise InvalidParameterError(
        f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
        param="response_format.type",
    )


def _stop(options: CompletionOptions, chat: bool) -> Sequence[str]:
    stop = options.get("stop")
    return () if stop is None else stop


_SPECIAL: dict[str, Callable[[CompletionOptions, bool], Any]] = {
    "stop": _stop,
    "logit_bias": lambda options, chat: _logit_bias(options.get("logit_bias")),
    "logprobs": lambda options, chat: _logprobs(options, chat=chat),
    "json_schema": lambda options, chat: _response_schema(options.get("response_format")),
    "speculative": lambda options, chat: _speculative(options.get("speculative")),
    "lora": lambda options, chat: _lora(options.get("lora")),
}
"""``SamplingParams`` fields whose OpenAI shape differs, and how each is read from the
options; every other OpenAI option is passed on as it is, with its OpenAI default."""
