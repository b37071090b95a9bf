"""Request bodies: pydantic models that refuse unknown fields and wrong types.

Types are checked here (strictly: ``"3"`` is not a number, ``1`` is not ``true``); value
ranges are llamax's business (``SamplingParams`` raises ``InvalidParameterError`` naming the
field), so the two layers never disagree about what is valid.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import types
import typing
from typing import TYPE_CHECKING, Any, Literal, TypeVar, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from llamax import InvalidParameterError, SamplingParams
from llamax.dialects.anthropic import MESSAGES
from llamax.dialects.fields import FieldTable, accept_fields
from llamax.dialects.openai import CHAT, COMPLETIONS, EMBEDDINGS, ROUTES

from .errors import APIError

__all__ = [
    "ChatCompletionRequest",
    "CompletionRequest",
    "DetokenizeRequest",
    "EmbeddingRequest",
    "TokenizeRequest",
    "parse_body",
    "without_unknown",
]

RequestT = TypeVar("RequestT", bound=BaseModel)

MAX_JSON_DEPTH = 64
"""Deepest nesting of arrays and objects a body may have (a JSON schema rarely needs 10)."""

MAX_STOP_STRINGS = 400
"""Most ``stop`` strings one request may give over HTTP."""

_NOT_OPTIONS = frozenset(
    {"model", "user", "stream", "stream_options", "messages", "prompt", "timings_per_token",
     "verbose"}
)  # fmt: skip
"""Fields the server handles itself (``model`` picks the model and is echoed; ``user`` is
accepted and ignored; llama-server's ``timings_per_token`` and ``verbose`` are added to the
response by the route)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    """OpenAI's ``stream_options``."""

    include_usage: bool = False
    include_obfuscation: bool = False
    """Accepted; no obfuscation padding is ever sent."""


MAX_TEMPERATURE = 2.0
"""OpenAI's largest ``temperature``."""


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


class _SamplingBase(_Strict):
    """Fields chat and text completions share; ``None`` means llamax's OpenAI default.

    The sampling fields are derived from :class:`~llamax.SamplingParams` (those with an
    OpenAI default), by :func:`sampling_fields`.
    """

    if TYPE_CHECKING:  # the fields this class's own methods read
        stop: str | list[str] | None
        stream: bool | None
        stream_options: StreamOptions | None

    @property
    def is_stream(self) -> bool:
        """Whether the client asked for server-sent events."""
        return bool(self.stream)

    @property
    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)

    def options(self) -> dict[str, Any]:
        """The keyword options for ``Context.achat_completion`` / ``acompletion``.

        Raises:
            APIError: 400 for more than :data:`MAX_STOP_STRINGS` stop strings, or a
                ``temperature`` above OpenAI's :data:`MAX_TEMPERATURE`.
        """
        temperature = getattr(self, "temperature", None)
        if temperature is not None and temperature > MAX_TEMPERATURE:
            raise APIError(
                400,
                f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {temperature}",
                param="temperature",
                code="invalid_value",
            )
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOP_STRINGS:
            raise APIError(
                400,
                f"stop has {len(self.stop)} strings; at most {MAX_STOP_STRINGS} are allowed",
                param="stop",
                code="invalid_value",
            )
        return self.model_dump(exclude_none=True, exclude=set(_NOT_OPTIONS))


def sampling_fields(params: type[SamplingParams] = SamplingParams) -> type[_SamplingBase]:
    """The request model of the fields chat and text completions share: ``model``, each
    OpenAI option of ``params`` (typed ``T | None``, default ``None``), then the server's own.

    Args:
        params: ``SamplingParams`` or a subclass with more options.

    Returns:
        A pydantic model class deriving from the shared base.
    """
    hints = typing.get_type_hints(params)
    fields: dict[str, Any] = {"model": (str | None, None)}
    for f in dataclasses.fields(params):
        spec = f.metadata.get("llamax")  # an option's spec (llamax.optionspec)
        if spec is not None and spec.is_openai:
            fields[f.name] = (_wire_type(f.name, hints[f.name]), None)
    fields |= {
        "stream": (bool | None, None),
        "stream_options": (StreamOptions | None, None),
        "response_format": (dict[str, Any] | None, None),
        "user": (str | None, None),
    }
    model: type[_SamplingBase] = create_model(
        "_SamplingFields", __base__=_SamplingBase, __module__=__name__, **fields
    )
    return model


if TYPE_CHECKING:
    _SamplingFields = _SamplingBase
else:
    _SamplingFields = sampling_fields()


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    truncate: Literal["none", "oldest_messages"] | None = None
    """llamax extension: drop the oldest turns when the conversation does not fit."""
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning_format: Literal["auto", "deepseek", "none"] | None = None
    """llamax/llama-server extension: where a thinking model's thinking goes."""
    enable_thinking: bool | None = None
    """llamax extension: passed to chat templates that take it."""
    chat_template_kwargs: dict[str, Any] | None = None
    """vLLM's and llama-server's way to say ``enable_thinking`` (the only key taken)."""
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    """OpenAI's effort, mapped to the template's thinking switch (``none``/``minimal``: off)."""
    timings_per_token: bool | None = None
    """llama-server extension: a stream's usage chunk carries ``timings`` (the route adds it)."""
    verbose: bool | None = None
    """llama-server extension: a whole reply carries ``__verbose`` (the route adds it)."""
    return_progress: bool | None = None
    """llama-server extension: a stream reports the prompt's progress (``prompt_progress``)."""
    prompt_cache_key: str | None = None
    """OpenAI's cache key: a hint that the prompt's prefix is kept longer (``keep_prefix``)."""
    prompt_cache_retention: Literal["in_memory", "24h", "in-memory"] | None = None
    """OpenAI's cache retention: the same hint."""

    def options(self) -> dict[str, Any]:
        """As the base class, with ``max_completion_tokens`` read as ``max_tokens``,
        ``chat_template_kwargs.enable_thinking`` and ``reasoning_effort`` as
        ``enable_thinking``, and ``parallel_tool_calls`` dropped without tools (where it
        means nothing)."""
        options = super().options()
        effort = options.pop("reasoning_effort", None)
        if not self.tools:
            options.pop("parallel_tool_calls", None)
        kwargs = options.pop("chat_template_kwargs", None)
        if kwargs is not None:
            unknown = sorted(set(kwargs) - {"enable_thinking"})
            thinking = kwargs.get("enable_thinking")
            if unknown or not isinstance(thinking, bool | None):
                raise APIError(
                    400,
                    "chat_template_kwargs takes only enable_thinking (a boolean)"
                    + (f"; got {', '.join(unknown)}" if unknown else ""),
                    param="chat_template_kwargs",
                    code="invalid_value",
                )
            if thinking is not None:
                options.setdefault("enable_thinking", thinking)
        if effort is not None:
            options.setdefault("enable_thinking", effort not in ("none", "minimal"))
        newer = options.pop("max_completion_tokens", None)
        if newer is not None:
            if "max_tokens" in options:
                raise APIError(
                    400,
                    "give max_tokens or max_completion_tokens, not both",
                    param="max_completion_tokens",
                    code="invalid_value",
                )
            options["max_tokens"] = newer
        return options


DEFAULT_COMPLETION_TOKENS = 16
"""``/v1/completions``' ``max_tokens`` when a request gives none (OpenAI's default)."""


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``."""

    prompt: str | list[int]
    logprobs: int | None = None
    echo: bool | None = None
    """Put the prompt's text before each choice's text."""
    suffix: str | None = None
    """The text after the completion: the route makes a fill-in-the-middle prompt of
    ``prompt`` and ``suffix`` with the model's FIM tokens (null or empty: no suffix)."""

    def options(self) -> dict[str, Any]:
        """As the base class, with OpenAI's default of 16 ``max_tokens`` and without
        ``echo`` and ``suffix`` (the route applies them)."""
        options = super().options()
        options.pop("echo", None)
        options.pop("suffix", None)
        options.setdefault("max_tokens", DEFAULT_COMPLETION_TOKENS)
        return options


class EmbeddingRequest(_Strict):
    """``POST /v1/embeddings``."""

    input: str | list[str] = Field(min_length=1)
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    user: str | None = None
    dimensions: int | None = Field(default=None, ge=1)
    """Keep the first ``dimensions`` components, renormalised to length 1."""


class TokenizeRequest(_Strict):
    """``POST /tokenize`` (llama-server's shape)."""

    content: str
    add_special: bool = False
    """BOS and the like (llama-server's default: none)."""
    parse_special: bool = True
    """Special-token text becomes special tokens (``False``: plain text)."""
    with_pieces: bool = False
    model: str | None = None
    """Which model's tokenizer, when the server has several (docs/models.md)."""


class DetokenizeRequest(_Strict):
    """``POST /detokenize``."""

    tokens: list[int]
    model: str | None = None


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


def parse_object(raw: bytes) -> dict[str, Any]:
    """A JSON object body, checked as :func:`parse_body` checks one (JSON, depth, text),
    without a model: for requests whose fields another layer checks (``/v1/messages``).

    Raises:
        APIError: 400, as :func:`parse_body`.
    """
    try:
        data = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from exc
    except RecursionError as exc:
        raise APIError(
            400, f"the body nests deeper than {MAX_JSON_DEPTH} levels", code="invalid_json"
        ) from exc
    if not isinstance(data, dict):
        raise APIError(400, "the body must be a JSON object", code="invalid_json")
    _check_tree(data)
    return data


_log = logging.getLogger("llamax.server")


def without_unknown(data: dict[str, Any], table: FieldTable, route: str) -> dict[str, Any]:
    """``data`` without the top-level fields ``table`` does not name, each logged as a
    warning: what ``--lenient`` does with a field in neither API's reference (strict, the
    default, refuses it). Hints are still checked and refused fields still refused, and
    nested objects stay strict."""
    known = {f.name for f in table}
    unknown = [name for name in data if name not in known]
    if not unknown:
        return data
    _log.warning("%s: ignored unknown field(s) %s (--lenient)", route,
                 ", ".join(repr(name) for name in unknown))  # fmt: skip
    return {name: value for name, value in data.items() if name in known}


def parse_body(model: type[RequestT], raw: bytes, *, lenient: bool = False) -> RequestT:
    """Parse and validate a JSON request body.

    Args:
        model: The request model.
        raw: The body's bytes.
        lenient: Drop (and log) top-level fields the model's route table does not name,
            instead of refusing them (:func:`without_unknown`).

    Returns:
        The validated request.

    Raises:
        APIError: 400, for malformed JSON, a body that is not an object, nesting deeper
            than :data:`MAX_JSON_DEPTH`, a string holding a lone surrogate (``"\\ud800"``
            is valid JSON but not Unicode text), an unknown field (named in ``param``) or
            a field of the wrong type.
    """
    data = parse_object(raw)
    table = _TABLES.get(model)
    if table is not None:
        if lenient:
            data = without_unknown(data, table, _PATHS[model])
        try:
            data = accept_fields(table, data)
        except InvalidParameterError as exc:
            message = str(exc)
            code = "unsupported_parameter" if " is not supported: " in message else "invalid_value"
            raise APIError(400, message, param=exc.param, code=code) from exc
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(exc) from exc


_TABLES: dict[type[BaseModel], FieldTable] = {
    ChatCompletionRequest: CHAT,
    CompletionRequest: COMPLETIONS,
    EmbeddingRequest: EMBEDDINGS,
}
"""Each OpenAI request model's field table (:mod:`llamax.dialects.openai`)."""
_PATHS = {
    ChatCompletionRequest: "/v1/chat/completions",
    CompletionRequest: "/v1/completions",
    EmbeddingRequest: "/v1/embeddings",
}

FIELD_TABLES: dict[str, FieldTable] = {**ROUTES, "messages": MESSAGES}
"""Every route's field table, by the name the docs blocks use (``<!-- fields: chat -->``)."""


def _check_tree(data: dict[str, Any]) -> None:
    """Refuse nesting deeper than :data:`MAX_JSON_DEPTH` and strings that are not Unicode
    text (lone surrogates); a walk with its own stack, so no depth can overflow it.

    Raises:
        APIError: 400 naming the place (``messages.0.content``) and the top field.
    """
    stack: list[tuple[object, tuple[str | int, ...]]] = [(data, ())]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            _check_text(value, path)
        elif isinstance(value, (dict, list)):
            if len(path) >= MAX_JSON_DEPTH:
                raise APIError(
                    400,
                    f"the body nests deeper than {MAX_JSON_DEPTH} levels (in {path[0]!r})",
                    param=str(path[0]),
                    code="invalid_json",
                )
            if isinstance(value, dict):
                for key, item in value.items():
                    _check_text(key, path)
                    stack.append((item, (*path, key)))
            else:
                stack.extend((item, (*path, i)) for i, item in enumerate(value))


def _check_text(text: str, path: tuple[str | int, ...]) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start]
        raise APIError(
            400,
            f"{_where(path) or 'a field name'} holds a lone surrogate ({bad!a} at "
            f"index {exc.start}), which is not valid Unicode text",
            param=str(path[0]) if path else None,
            code="invalid_unicode",
        ) from exc


def _where(path: tuple[str | int, ...]) -> str:
    return ".".join(str(part) for part in path)


def _validation_error(exc: ValidationError) -> APIError:
    errors = exc.errors()
    first = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    location = ".".join(str(part) for part in first["loc"])
    param = str(first["loc"][0]) if first["loc"] else None
    if first["type"] == "extra_forbidden":
        return APIError(400, f"unknown field {location!r}", param=param, code="unknown_field")
    if first["type"] == "missing":
        return APIError(400, f"missing field {param!r}", param=param, code="missing_field")
    return APIError(400, f"{location}: {first['msg']}", param=param, code="invalid_type")
