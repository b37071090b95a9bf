"""What llama-server's slot routes (``/infill``, ``/slots``, ``/models/load``) share: their
errors, their sampling fields as :class:`~llamax.SamplingParams`, and the ``/completion``
response shape of one sequence on a slot (whole and streamed). ``/completion`` itself is
parsed and shaped in :mod:`.llama_native`; the two still overlap in their result shaping
(see docs/server.md).

Errors come in llama-server's body, ``{"error": {"code": <status>, "message", "type"}}``
(:func:`~.errors.llama_body`, the one the ``/completion`` routes use too).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from starlette.responses import JSONResponse

import llamax

from .dialects import LLAMA
from .errors import APIError, from_exception
from .state import ServerState

__all__ = [
    "LlamaError",
    "NativeTimings",
    "final_json",
    "leased",
    "llama_error_response",
    "partial_json",
    "sampling_params",
]


class LlamaError(APIError):
    """An error a native route answers with in llama-server's shape (its type comes from
    the status, as :func:`~.errors.llama_body` maps it: ``not_supported_error`` for 501,
    ``unavailable_error`` for 503 ...)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(status, message)


def llama_error_response(error: APIError) -> JSONResponse:
    """The HTTP response for ``error`` on a native route (:data:`~.dialects.LLAMA`'s)."""
    return LLAMA.error_response(error)


def as_llama_error(exc: BaseException, prompt_field: str = "prompt") -> APIError:
    """Any exception as the error a native route answers with (llamax's typed errors keep
    their 4xx status, see :func:`~.errors.from_exception`)."""
    error = from_exception(exc, prompt_field=prompt_field)
    if error is not exc and error.__cause__ is None:
        error.__cause__ = exc
    return error


@asynccontextmanager
async def leased(state: ServerState, model: object) -> AsyncIterator[llamax.Context]:
    """The context ``model`` names (``None``: the default), held (an admission slot taken,
    the model pinned) until the block ends.

    Raises:
        APIError: 503 when the server is busy or the model unavailable, 404 for an unknown
            model, as :meth:`~.state.ServerState.lease`.
    """
    state.admit()
    try:
        lease = state.lease(model)
    except BaseException:
        state.release()
        raise
    try:
        yield await lease.context()
    finally:
        lease.release()


_RENAMED = {
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "typical_p": "typical_p",
    "repeat_penalty": "repeat_penalty",
    "repeat_last_n": "penalty_last_n",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "ignore_eos": "ignore_eos",
    "grammar": "grammar",
    "json_schema": "json_schema",
}
"""llama-server's sampling field -> :class:`~llamax.SamplingParams`' field."""

_REFUSED_UNLESS = {
    "mirostat": 0,
    "dynatemp_range": 0.0,
    "xtc_probability": 0.0,
    "dry_multiplier": 0.0,
    "top_n_sigma": -1.0,
    "n_probs": 0,
    "n_cmpl": 1,
    "samplers": None,
    "lora": None,
    "logit_bias": None,
    "n_keep": 0,
}
"""Fields llama-server takes that these routes do not: refused (400) unless absent or at
llama-server's default, never silently ignored."""


def sampling_params(
    body: Mapping[str, Any], *, default_n_predict: int | None = None,
    default_seed: int | None = None,
) -> llamax.SamplingParams:  # fmt: skip
    """llama-server's sampling fields as :class:`~llamax.SamplingParams`: ``n_predict``
    (``-1``: until the end of generation or the context), ``temperature``, ``top_k``,
    ``top_p``, ``min_p``, ``typical_p``, ``repeat_penalty``, ``repeat_last_n``,
    ``presence_penalty``, ``frequency_penalty``, ``seed`` (``-1``: random), ``stop``,
    ``ignore_eos``, ``grammar``, ``json_schema``. ``default_n_predict`` and
    ``default_seed`` (the server's ``-n`` and ``--seed``) stand for a field left out.

    Raises:
        LlamaError: 400 for a field these routes refuse (:data:`_REFUSED_UNLESS`) or a
            value :class:`~llamax.SamplingParams` refuses.
    """
    for name, default in _REFUSED_UNLESS.items():
        if name in body and body[name] not in (default, None):
            raise LlamaError(400, f"{name} is not supported by llamax on this route "
                             f"(send {default!r} or leave it out)")  # fmt: skip
    options: dict[str, Any] = {
        ours: body[theirs] for theirs, ours in _RENAMED.items() if body.get(theirs) is not None
    }
    n_predict = body.get("n_predict", body.get("max_tokens", -1))
    if not isinstance(n_predict, int) or isinstance(n_predict, bool):
        raise LlamaError(400, f"n_predict must be an int, got {n_predict!r}")
    if n_predict < 0 and default_n_predict is not None:
        n_predict = default_n_predict
    options["max_tokens"] = None if n_predict < 0 else n_predict
    seed = body.get("seed", -1 if default_seed is None else default_seed)
    if seed not in (-1, 0xFFFFFFFF, None):
        options["seed"] = seed
    stop = body.get("stop")
    if stop is not None:
        options["stop"] = [stop] if isinstance(stop, str) else stop
    try:
        return llamax.SamplingParams(**options)
    except (llamax.InvalidParameterError, TypeError, ValueError) as exc:
        raise LlamaError(400, str(exc)) from exc


@dataclass(slots=True)
class NativeTimings:
    """One request's clock, for llama-server's ``timings`` object."""

    start: float
    first_token: float | None = None
    end: float | None = None
    num_decoded: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self, usage: llamax.Usage) -> dict[str, Any]:
        """``timings``: ``cache_n`` (prompt tokens served from the cache), ``prompt_n``
        (computed), ``predicted_n`` and their milliseconds and rates."""
        first = self.first_token if self.first_token is not None else self.end or self.start
        end = self.end or first
        prompt_ms = (first - self.start) * 1000
        predicted_ms = (end - first) * 1000
        prompt_n = usage.prompt_tokens - usage.cached_tokens
        predicted_n = usage.completion_tokens
        return {
            "cache_n": usage.cached_tokens,
            "prompt_n": prompt_n,
            "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
            "prompt_per_second": prompt_n * 1000 / prompt_ms if prompt_ms > 0 else 0.0,
            "predicted_n": predicted_n,
            "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / predicted_n if predicted_n else 0.0,
            "predicted_per_second": (
                predicted_n * 1000 / predicted_ms if predicted_ms > 0 else 0.0
            ),
        }


def partial_json(
    text: str, token_ids: tuple[int, ...], *, id_slot: int, num_decoded: int, num_prompt: int,
    return_tokens: bool,
) -> dict[str, Any]:  # fmt: skip
    """One streamed chunk, as llama-server's ``server_task_result_cmpl_partial``."""
    return {
        "index": 0,
        "content": text,
        "tokens": list(token_ids) if return_tokens else [],
        "stop": False,
        "id_slot": id_slot,
        "tokens_predicted": num_decoded,
        "tokens_evaluated": num_prompt,
    }


def final_json(
    result: llamax.Completion,
    *,
    content: str,
    model: str,
    prompt: str,
    id_slot: int,
    settings: dict[str, Any],
    stop_words: tuple[str, ...],
    full_text: str,
    timings: NativeTimings,
    return_tokens: bool,
) -> dict[str, Any]:
    """The last (or only) answer, as llama-server's ``server_task_result_cmpl_final``.

    ``stop_type`` is ``limit`` for ``n_predict`` reached, ``word`` when a stop string ended
    it (``stopping_word``: which; ``full_text`` is the text before the stop string was
    cut), ``eos`` otherwise.
    """
    choice = result.choices[0]
    stop_type, word = "eos", ""
    if choice.finish_reason is llamax.FinishReason.LENGTH:
        stop_type = "limit"
    elif choice.finish_reason is llamax.FinishReason.STOP:
        tail = full_text[len(choice.text) :]
        word = next((w for w in stop_words if tail.startswith(w)), "")
        stop_type = "word" if word else "eos"
    usage = result.usage
    return {
        "index": 0,
        "content": content,
        "tokens": list(choice.token_ids) if return_tokens else [],
        "id_slot": id_slot,
        "stop": True,
        "model": model,
        "tokens_predicted": usage.completion_tokens,
        "tokens_evaluated": usage.prompt_tokens,
        "generation_settings": settings,
        "prompt": prompt,
        "has_new_line": "\n" in choice.text,
        "truncated": False,
        "stop_type": stop_type,
        "stopping_word": word,
        "tokens_cached": usage.prompt_tokens + usage.completion_tokens,
        "timings": timings.to_json(usage),
    }
