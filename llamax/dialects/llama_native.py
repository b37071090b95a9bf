"""llama-server's native ``/completion`` as a codec: the body parsed into llamax's
:class:`~llamax.SamplingParams` and prompts (:func:`parse_native`), and the results shaped
as llama-server shapes them (:func:`partial_result`, :func:`final_result`). Pure: no
context, no server; a refusal is a :class:`~llamax.dialects.fields.FieldError` naming the
field, which the server answers as llama-server's 400.

Every field llama-server takes is either mapped, accepted at the value that turns it off
(``mirostat: 0``, ``dry_multiplier: 0`` ...: a sampler llamax does not have), or refused
with a 400 that names it, so no request is silently sampled otherwise than it asked. A
field llama-server does not know is refused too (llama-server ignores it; llamax refuses
unknown fields everywhere). The fields are the rows of
:data:`~llamax.dialects.llama.COMPLETION`, which docs/server.md shows.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypedDict

from ..errors import ImageError, InvalidParameterError
from ..images import Image
from ..params import SamplingParams
from ..results import Choice, FinishReason, PrefillProgress, TokenEvent, TokenLogprob
from .fields import FieldError, FieldTable
from .llama import (
    COMPLETION,
    DEFAULT_SETTINGS,
    NO_SEED,
    SAMPLER_OFF,
    SAMPLERS,
    SAMPLING,
    field_refusal,
)

__all__ = [
    "FIELDS",
    "MEDIA_MARKER",
    "NativePrompt",
    "NativeRequest",
    "PromptProgress",
    "Timings",
    "check_fields",
    "default_settings",
    "final_result",
    "parse_native",
    "partial_result",
    "probs_json",
    "prompt_progress",
    "stop_of",
]

MEDIA_MARKER = "<__media__>"
"""Where an image of ``multimodal_data`` goes in a ``prompt_string`` (``/props`` reports it
as ``media_marker``): llama-server's default marker. llama-server may pick a random one at
each start; llamax keeps this one."""


def check_fields(
    table: FieldTable, body: Mapping[str, Any], *, unknown: Literal["refuse", "ignore"]
) -> None:
    """Check a body's fields against a native route's table
    (:func:`~llamax.dialects.llama.field_refusal`: an unknown field refused or ignored as
    ``unknown`` says, then the first refused field that is not harmless).

    Raises:
        FieldError: ``unknown_field`` or ``unsupported_field``, naming the field as
            ``param``.
    """
    refused = field_refusal(table, body, unknown=unknown)
    if refused is not None:
        raise FieldError(refused.message, param=refused.param, code=refused.code)


NativePrompt = str | tuple[int | str | Image, ...]
"""One ``/completion`` prompt: text, token ids mixed with text pieces, or text pieces and
images (a ``prompt_string`` with ``multimodal_data``)."""

_FLAGS = frozenset({"stream", "cache_prompt", "return_tokens", "timings_per_token", "ignore_eos",
                    "post_sampling_probs", "return_progress"})  # fmt: skip
FIELDS = frozenset(f.name for f in COMPLETION)
"""Every field ``/completion`` takes (its table, :data:`~llamax.dialects.llama.COMPLETION`)."""

_MAX_PROMPTS = 64
_TEMPERATURE = DEFAULT_SETTINGS["temperature"]
"""The temperature of a request that sets none."""


def _bad(message: str, param: str | None = None) -> FieldError:
    return FieldError(message, param=param)


@dataclass(frozen=True, slots=True)
class NativeRequest:
    """A parsed ``/completion`` body."""

    prompts: tuple[NativePrompt, ...]
    """Each prompt: text, token ids mixed with text pieces, or text and images."""
    params: SamplingParams | None
    """``None``: ``n_predict`` is 0 (the prompt is only tokenized, nothing generated)."""
    stream: bool = False
    return_tokens: bool = False
    timings_per_token: bool = False
    n_probs: int = 0
    response_fields: tuple[str, ...] = ()
    model: str | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    """``generation_settings``: :data:`~llamax.dialects.llama.DEFAULT_SETTINGS` with the
    fields given."""
    text_bias: tuple[tuple[str, float], ...] = ()
    """``logit_bias`` entries given as text: each of its tokens gets the bias (the route
    tokenizes them and adds them to ``params``)."""
    id_slot: int = -1
    """The slot to run on (its session's KV is reused); ``-1``: any sequence."""
    post_sampling_probs: bool = False
    """``completion_probabilities`` as probabilities (``prob``, ``top_probs``) of the
    distribution the sampler chain drew from, not the model's log-probabilities."""


def _flag(body: Mapping[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise _bad(f"{name} must be a boolean, got {type(value).__name__}", name)
    return value


def _number(body: Mapping[str, Any], name: str) -> float | int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _bad(f"{name} must be a finite number, got {value!r}", name)
    return value


def _prompt_object(value: dict[str, Any]) -> NativePrompt:
    """``{"prompt_string": text}``, with ``multimodal_data`` (base64 image files) for the
    :data:`MEDIA_MARKER` s in the text, in order: the text pieces with the images between
    them (each image read when the prompt is submitted)."""
    unknown = sorted(set(value) - {"prompt_string", "multimodal_data"})
    text = value.get("prompt_string")
    if unknown or not isinstance(text, str):
        raise _bad('prompt: an object prompt must be {"prompt_string": text}', "prompt")
    data = value.get("multimodal_data")
    if not data:
        return text
    if not isinstance(data, list) or not all(isinstance(d, str) for d in data):
        raise _bad("prompt: multimodal_data must be a list of base64 strings", "prompt")
    pieces = text.split(MEDIA_MARKER)
    if len(pieces) != len(data) + 1:
        raise _bad(f"prompt: prompt_string holds {len(pieces) - 1} media markers "
                   f"({MEDIA_MARKER}) for {len(data)} multimodal_data items", "prompt")  # fmt: skip
    parts: list[str | Image] = [pieces[0]]
    for i, (item, piece) in enumerate(zip(data, pieces[1:], strict=True)):
        try:
            parts += [Image.from_base64(item), piece]
        except ImageError as exc:
            raise _bad(f"prompt: multimodal_data[{i}]: {exc}", "prompt") from None
    return tuple(parts)


def _prompts(value: object) -> tuple[NativePrompt, ...]:
    """``prompt`` as a tuple of prompts (one unless it is a list of prompts)."""
    if isinstance(value, dict):
        return (_prompt_object(value),)
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, list) or not value:
        raise _bad("prompt must be a string, a list of token ids and strings, or a list of "
                   "prompts", "prompt")  # fmt: skip
    if all(_is_piece(p) for p in value) and any(isinstance(p, int) for p in value):
        return (tuple(value),)
    if len(value) > _MAX_PROMPTS:
        raise _bad(f"prompt holds {len(value)} prompts; at most {_MAX_PROMPTS}", "prompt")
    out: list[NativePrompt] = []
    for item in value:
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, dict):
            out.append(_prompt_object(item))
        elif isinstance(item, list) and item and all(_is_piece(p) for p in item):
            out.append(tuple(item))
        else:
            raise _bad(f"prompt: each prompt must be a string or a non-empty list of token "
                       f"ids and strings, got {item!r:.60}", "prompt")  # fmt: skip
    return tuple(out)


def _is_piece(value: object) -> bool:
    return isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))


def _logit_bias(value: object) -> tuple[dict[int, float], tuple[tuple[str, float], ...]]:
    """llama-server's ``[[token, bias], ...]`` (token an id or text, bias a number or
    ``false`` to ban) or ``{"token": bias}``: the biases by id, and those by text."""
    pairs: list[Any]
    if isinstance(value, dict):
        pairs = list(value.items())
    elif isinstance(value, list):
        pairs = value
    else:
        raise _bad("logit_bias must be a list of [token, bias] pairs or an object", "logit_bias")
    by_id: dict[int, float] = {}
    by_text: list[tuple[str, float]] = []
    for pair in pairs:
        if not (isinstance(pair, list | tuple) and len(pair) == 2):
            raise _bad(f"logit_bias: each entry must be [token, bias], got {pair!r:.60}",
                       "logit_bias")  # fmt: skip
        token, bias = pair
        if isinstance(token, str) and token.lstrip("-").isdigit():
            token = int(token)
        if not (_is_piece(token) and (bias is False or _is_real(bias))):
            raise _bad(f"logit_bias: bad entry {pair!r:.60}", "logit_bias")
        number = -math.inf if bias is False else float(bias)
        if isinstance(token, str):
            by_text.append((token, number))
        else:
            by_id[token] = number
    return by_id, tuple(by_text)


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _samplers(value: object, options: dict[str, Any]) -> None:
    """Turn off the samplers a ``samplers`` list leaves out (llamax's order is fixed:
    llama-server's default order, so a list in another order is refused)."""
    if not (isinstance(value, list) and all(isinstance(s, str) for s in value)):
        raise _bad("samplers must be a list of sampler names", "samplers")
    unknown = [s for s in value if s not in SAMPLERS]
    if unknown:
        raise _bad(f"samplers: llamax has no sampler {unknown[0]!r} (it has "
                   f"{', '.join(SAMPLERS)})", "samplers")  # fmt: skip
    order = [SAMPLERS.index(s) for s in value]
    if order != sorted(set(order)):
        raise _bad(f"samplers: llamax applies its samplers in one order ({', '.join(SAMPLERS)}), "
                   "each once; give them in that order", "samplers")  # fmt: skip
    for name, (option, neutral) in SAMPLER_OFF.items():
        if name not in value:
            options[option] = neutral
    if "temperature" not in value and options.get("temperature", _TEMPERATURE) > 0:
        options["temperature"] = 1.0


def default_settings(n_predict: int | None = None, seed: int | None = None) -> dict[str, Any]:
    """:data:`~llamax.dialects.llama.DEFAULT_SETTINGS` under the server's default reply
    length and seed (llama-server's ``-n`` and ``--seed``; ``None``: llamax's)."""
    settings = dict(DEFAULT_SETTINGS)
    if n_predict is not None:
        settings["n_predict"] = settings["max_tokens"] = n_predict
    if seed is not None:
        settings["seed"] = seed
    return settings


def parse_native(
    body: Mapping[str, Any], *, default_n_predict: int | None = None,
    default_seed: int | None = None,
) -> NativeRequest:  # fmt: skip
    """Check a ``/completion`` body and map it onto llamax's parameters.

    Args:
        body: The request body.
        default_n_predict: ``n_predict`` for a body that gives none or ``-1`` (the
            server's ``-n``); ``None``: until the end of generation or of the context.
        default_seed: ``seed`` for a body that gives none (the server's ``--seed``; a body
            that gives ``-1`` still gets a random one).

    Raises:
        FieldError: naming the field for an unknown field, a wrong type, a value llamax
            refuses (``SamplingParams``' own message) or a field llamax does not support
            at that value.
    """
    check_fields(COMPLETION, body, unknown="refuse")
    if "prompt" not in body:
        raise FieldError('"prompt" must be provided', param="prompt", code="missing_field")
    prompts = _prompts(body["prompt"])
    flags = {name: _flag(body, name, default=name == "cache_prompt") for name in _FLAGS}
    options: dict[str, Any] = {}
    for row in SAMPLING:
        value = _number(body, row.name)
        if value is not None and row.option is not None:
            options[row.option] = value
    if "samplers" in body:
        _samplers(body["samplers"], options)
    n_predict = _number(body, "n_predict")
    if n_predict is not None and (n_predict != int(n_predict) or n_predict < -1):
        raise _bad(f"n_predict must be an int >= -1, got {n_predict!r}", "n_predict")
    if n_predict is None or n_predict < 0:
        n_predict = default_n_predict
    options["max_tokens"] = None if n_predict is None else int(n_predict)
    seed = _number(body, "seed")
    if seed is None:
        seed = default_seed
    if seed is not None and seed not in (-1, NO_SEED):
        options["seed"] = seed
    n_probs = _number(body, "n_probs") or 0
    if n_probs:
        options["logprobs"] = n_probs
        options["logprobs_after_sampling"] = flags["post_sampling_probs"]
    n_cmpl = _number(body, "n_cmpl")
    if n_cmpl is not None:
        options["n"] = n_cmpl
    if flags["return_progress"] and flags["stream"]:  # llama-server reports it in streams
        options["prefill_progress"] = True
    _other_options(body, options, flags["ignore_eos"])
    id_slot = body.get("id_slot")
    id_slot = -1 if id_slot is None else id_slot  # null: llama-server's default
    _check_slot(id_slot)
    response_fields = body.get("response_fields", [])
    if not (isinstance(response_fields, list) and all(isinstance(f, str) for f in response_fields)):
        raise _bad("response_fields must be a list of strings", "response_fields")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("model must be a string", "model")
    settings = default_settings(default_n_predict, default_seed)
    settings |= {k: v for k, v in body.items() if k in DEFAULT_SETTINGS}
    settings["max_tokens"] = settings["n_predict"]
    text_bias = options.pop("text_bias", ())
    params = None if options["max_tokens"] == 0 else _sampling_params(options)
    return NativeRequest(prompts, params, flags["stream"], flags["return_tokens"],
                         flags["timings_per_token"], int(n_probs), tuple(response_fields),
                         model, settings, text_bias, id_slot,
                         flags["post_sampling_probs"])  # fmt: skip


_FIELD_OF = {f.option: f.name for f in COMPLETION if f.option is not None}
"""llamax's option names and the ``/completion`` fields they come from."""


def _sampling_params(options: dict[str, Any]) -> SamplingParams:
    """``SamplingParams(**options)``; a refusal is a 400 naming the field as the client
    gave it (``n_probs must be ...``, not ``logprobs must be ...``)."""
    try:
        return SamplingParams(**options)
    except InvalidParameterError as exc:
        message, option = str(exc), exc.param
        if option is None or option not in _FIELD_OF:
            raise _bad(message) from exc
        name = _FIELD_OF[option]
        if message.startswith(option + " "):
            message = name + message[len(option) :]
        raise _bad(message, name) from exc


def _other_options(body: Mapping[str, Any], options: dict[str, Any], ignore_eos: bool) -> None:
    if ignore_eos:
        options["ignore_eos"] = True
    stop = body.get("stop")
    if stop is not None:
        if not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
            raise _bad("stop must be a list of strings", "stop")
        options["stop"] = [s for s in stop if s]
    if "logit_bias" in body:
        options["logit_bias"], options["text_bias"] = _logit_bias(body["logit_bias"])
    for name in ("grammar", "json_schema"):
        value = body.get(name)
        if value not in (None, ""):
            options[name] = value
    lora = body.get("lora")
    if lora is not None:
        if not (isinstance(lora, list) and all(
            isinstance(a, dict) and set(a) == {"id", "scale"} for a in lora
        )):  # fmt: skip
            raise _bad("Error: 'lora' must be an array of objects with 'id' and 'scale' fields",
                       "lora")  # fmt: skip
        options["lora"] = {a["id"]: a["scale"] for a in lora}


def _check_slot(id_slot: object) -> None:
    if isinstance(id_slot, bool) or not isinstance(id_slot, int) or id_slot < -1:
        raise _bad(f"id_slot must be an int >= -1, got {id_slot!r}", "id_slot")


# ---------------------------------------------------------------------- results


def stop_of(choice: Choice, full_text: str, stops: Sequence[str]) -> tuple[str, str]:
    """llama-server's ``stop_type`` and ``stopping_word`` of a finished choice: ``word``
    when a stop string cut the text (``full_text``, the detokenized tokens, goes on with it),
    ``eos`` for an end-of-generation token, ``limit`` for ``n_predict`` or the context."""
    if choice.finish_reason is FinishReason.LENGTH:
        return "limit", ""
    if choice.finish_reason is FinishReason.STOP:
        rest = full_text[len(choice.text) :]
        word = next((s for s in sorted(stops, key=len, reverse=True) if rest.startswith(s)), "")
        return ("word", word) if word else ("eos", "")
    return "none", ""


@dataclass(slots=True)
class Timings:
    """One sequence's clock and counts, for llama-server's ``timings`` object."""

    submitted: float
    first_token: float | None = None
    num_prompt: int = 0
    num_cached: int = 0
    """Prompt tokens served from the cache (``cache_n``)."""
    num_predicted: int = 0

    def to_json(self, now: float) -> dict[str, Any]:
        """``timings``: ``cache_n``, ``prompt_n`` (computed), ``predicted_n`` and their
        milliseconds and rates."""
        first = self.first_token if self.first_token is not None else now
        prompt_ms = (first - self.submitted) * 1e3
        predicted_ms = (now - first) * 1e3
        num_prompt = max(self.num_prompt - self.num_cached, 0)
        num_predicted = self.num_predicted
        return {
            "cache_n": self.num_cached,
            "prompt_n": num_prompt,
            "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / num_prompt if num_prompt else 0.0,
            "prompt_per_second": 1e3 * num_prompt / prompt_ms if prompt_ms > 0 else 0.0,
            "predicted_n": self.num_predicted,
            "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / num_predicted if num_predicted else 0.0,
            "predicted_per_second": 1e3 * num_predicted / predicted_ms if predicted_ms > 0 else 0.0,
        }  # fmt: skip


def probs_json(
    logprobs: Sequence[TokenLogprob], post_sampling: bool = False
) -> list[dict[str, Any]]:
    """``completion_probabilities``: llama-server's ``id``/``token``/``bytes``/``logprob`` and
    ``top_logprobs`` per generated token; with ``post_sampling`` (the probabilities of the
    distribution the sampler chain drew from) ``prob`` and ``top_probs``, as llama-server
    names them there."""
    if post_sampling:
        return [
            {"id": lp.token_id, "token": lp.token, "bytes": list(lp.bytes),
             "prob": math.exp(lp.logprob),
             "top_probs": [{"id": t.token_id, "token": t.token, "bytes": list(t.bytes),
                            "prob": math.exp(t.logprob)} for t in lp.top_logprobs]}
            for lp in logprobs
        ]  # fmt: skip
    return [
        {"id": lp.token_id, "token": lp.token, "bytes": list(lp.bytes), "logprob": lp.logprob,
         "top_logprobs": [{"id": t.token_id, "token": t.token, "bytes": list(t.bytes),
                           "logprob": t.logprob} for t in lp.top_logprobs]}
        for lp in logprobs
    ]  # fmt: skip


def partial_result(
    request: NativeRequest, event: TokenEvent, *, index: int, id_slot: int,
    timings: Timings, now: float,
) -> dict[str, Any]:  # fmt: skip
    """One streamed event of a sequence (``stop: false``): its text and tokens (always, as
    llama-server sends them), ``timings`` with ``timings_per_token``, its tokens'
    ``completion_probabilities`` with ``n_probs``, and for a progress event (``return_progress``:
    no text, no tokens) ``prompt_progress``."""
    chunk: dict[str, Any] = {
        "index": index, "content": event.text, "tokens": list(event.token_ids), "stop": False,
        "id_slot": id_slot, "tokens_predicted": timings.num_predicted,
        "tokens_evaluated": timings.num_prompt,
    }  # fmt: skip
    if request.timings_per_token:
        chunk["timings"] = timings.to_json(now)
    if event.progress is not None:
        chunk["prompt_progress"] = prompt_progress(event.progress, timings.submitted)
    if request.n_probs and event.logprobs:
        chunk["completion_probabilities"] = probs_json(event.logprobs, request.post_sampling_probs)
    return chunk


def final_result(
    request: NativeRequest, *, index: int, id_slot: int, text: str, token_ids: Sequence[int],
    prompt: str, stop: tuple[str, str], model: str, n_ctx: int, timings: Timings, now: float,
    logprobs: Sequence[TokenLogprob] | None,
) -> dict[str, Any]:  # fmt: skip
    """The last result of a sequence (``stop: true``); in a stream its ``content`` and
    ``tokens`` are empty (the events carried them). ``tokens_cached`` is what llama-server
    reports there: the tokens its slot holds afterwards (prompt and reply)."""
    stream = request.stream
    result: dict[str, Any] = {
        "index": index,
        "content": "" if stream else text,
        "tokens": list(token_ids) if request.return_tokens and not stream else [],
        "id_slot": id_slot,
        "stop": True,
        "model": model,
        "tokens_predicted": timings.num_predicted,
        "tokens_evaluated": timings.num_prompt,
        "generation_settings": {"n_ctx": n_ctx, "model": model, **request.settings},
        "prompt": prompt,
        "has_new_line": "\n" in text,
        "truncated": False,
        "stop_type": stop[0],
        "stopping_word": stop[1],
        "tokens_cached": timings.num_prompt + timings.num_predicted,
        "timings": timings.to_json(now),
    }
    if request.n_probs and logprobs and not stream:
        result["completion_probabilities"] = probs_json(logprobs, request.post_sampling_probs)
    return _pick(result, request.response_fields) if request.response_fields else result


class PromptProgress(TypedDict):
    """llama-server's ``prompt_progress``: the prompt's tokens (``total``), those the cache
    held (``cache``), those computed so far, cached ones included (``processed``), and the
    milliseconds since the request was submitted (``time_ms``)."""

    total: int
    cache: int
    processed: int
    time_ms: int


def prompt_progress(progress: PrefillProgress, submitted: float) -> PromptProgress:
    """llama-server's ``prompt_progress`` of a :class:`~llamax.PrefillProgress` (``time_ms``
    since ``submitted``, a ``time.perf_counter`` reading); its OpenAI routes send it too."""
    return {
        "total": progress.num_prompt_tokens,
        "cache": progress.num_cached_tokens,
        "processed": progress.num_computed_tokens,
        "time_ms": int((time.perf_counter() - submitted) * 1000),
    }


def _pick(result: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """llama-server's ``response_fields``: the named fields only; ``a/b`` brings ``b`` of
    the object ``a`` up to the top (under the name ``a/b``), a missing one is left out."""
    out: dict[str, Any] = {}
    for name in names:
        value: Any = result
        for part in name.split("/"):
            if not isinstance(value, dict) or part not in value:
                break
            value = value[part]
        else:
            out[name] = value
    return out
