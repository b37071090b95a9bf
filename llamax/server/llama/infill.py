"""llama-server's ``POST /infill``: fill-in-the-middle code completion, as editor plugins
(llama.vim, llama.vscode) send it.

The prompt is built as llama-server's ``format_prompt_infill`` builds it (the
repository-level pattern of Qwen2.5-Coder, arXiv 2409.12186)::

    [FIM_REP]myproject\\n [FIM_SEP]name\\n extra text ... [FIM_SEP]filename\\n
    [FIM_PRE]prefix prompt [FIM_SUF]suffix [FIM_MID]

with the same budget: at most ``3/4 n_batch`` prefix tokens (the last ones), ``n_batch/4
- 2 - len(prompt)`` suffix tokens (the first ones), and the extra chunks' last tokens
in what is left of the sequence after ``n_batch + 2 n_predict`` (llamax's ``n_batch`` and
the request's ``n_predict``; llama-server takes its own ``-b`` and ``--n-predict``). The
files an editor sends before the cursor come first, so requests over one project share
their prefix, which llamax computes once and copies (``timings.cache_n``), and batches in
the same steps.

A model without FIM prefix, suffix and middle tokens is refused with llama-server's 501.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from fastapi import APIRouter, Depends
from starlette.requests import Request

import llamax
from llamax.dialects.fields import FieldError
from llamax.dialects.llama import INFILL, NO_SEED, TAKEN_AS_GIVEN, generation_settings
from llamax.dialects.llama_native import NativeRequest, check_fields

from ..dialects import LLAMA
from ..fairness import client_key
from ..schemas import parse_object
from ..serve import add_completion_routes
from ..state import ServerState
from .errors import LlamaError, as_llama_error
from .jobs import run_job
from .slots import SlotTables

__all__ = ["infill_routes", "infill_tokens"]

_SNIPPET = "\n\n--- snippet ---\n\n"
"""What separates extra chunks on a model without a file separator token (llama-server's)."""


def _check_body(body: dict[str, Any]) -> None:
    """llama-server's checks of an ``/infill`` body.

    Raises:
        LlamaError: 400 naming the field at fault.
    """
    if "prompt" in body and not isinstance(body["prompt"], str):
        raise LlamaError(400, '"prompt" must be a string')
    for name in ("input_prefix", "input_suffix"):
        if name not in body:
            raise LlamaError(400, f'"{name}" is required')
        if not _is_mixed(body[name]):
            raise LlamaError(400, f'"{name}" must be a string or a list of token ids and strings')
    extra = body.get("input_extra", [])
    if not isinstance(extra, list):
        raise LlamaError(400, '"input_extra" must be an array of {"filename": string, "text": '
                         "string}")  # fmt: skip
    for chunk in extra:
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str):
            raise LlamaError(400, 'extra_context chunk must contain a "text" field with a '
                             "string value")  # fmt: skip
        if "filename" in chunk and not isinstance(chunk["filename"], str):
            raise LlamaError(400, 'extra_context chunk\'s "filename" field must be a string')
    for name in ("stream", "cache_prompt", "return_tokens"):
        if name in body and not isinstance(body[name], bool):
            raise LlamaError(400, f'"{name}" must be a boolean')


def _is_mixed(value: object) -> bool:
    """A string, or a list of token ids and strings (llama-server's "mixed" prompt)."""
    if isinstance(value, str):
        return True
    return isinstance(value, list) and all(
        isinstance(v, str) or (isinstance(v, int) and not isinstance(v, bool)) for v in value
    )


def infill_tokens(
    ctx: llamax.Context,
    prefix: str | Sequence[int | str],
    suffix: str | Sequence[int | str],
    extra: Sequence[dict[str, str]],
    prompt: str,
    *,
    n_predict: int,
) -> list[int]:
    """The FIM prompt's tokens, as llama-server's ``format_prompt_infill`` lays them out
    (see the module's docstring).

    Raises:
        LlamaError: 501 when the model lacks a FIM prefix, suffix or middle token.
        InvalidRequestError: a token id outside the vocabulary.
    """
    fim = ctx.fim_tokens
    if not fim.can_infill:
        missing = "".join(f"{name} token is missing. " for name, t in
                          (("prefix", fim.prefix), ("suffix", fim.suffix),
                           ("middle", fim.middle)) if t is None)  # fmt: skip
        raise LlamaError(501, f"Infill is not supported by this model: {missing}")
    assert fim.prefix is not None and fim.suffix is not None and fim.middle is not None

    def plain(text: str) -> list[int]:
        return ctx.tokenize(text, add_special=False, parse_special=False)

    def mixed(value: str | Sequence[int | str]) -> list[int]:
        parts = [value] if isinstance(value, str) else value
        ids: list[int] = []
        for part in parts:
            ids += plain(part) if isinstance(part, str) else [part]
        bad = [t for t in ids if not 0 <= t < ctx.n_vocab]
        if bad:
            raise llamax.InvalidRequestError(f"token ids outside the vocabulary: {bad[:8]}")
        return ids

    extra_ids: list[int] = []
    if fim.repo is not None:
        extra_ids += [fim.repo, *plain("myproject\n")]
    for chunk in extra:
        if fim.separator is not None:
            extra_ids += [fim.separator, *plain(chunk.get("filename", "tmp") + "\n")]
        else:
            extra_ids += plain(_SNIPPET)
        extra_ids += plain(chunk["text"])
    if fim.separator is not None:
        extra_ids += [fim.separator, *plain("filename\n")]
    prompt_ids = ctx.tokenize(prompt, add_special=False, parse_special=True)
    prefix_ids, suffix_ids = mixed(prefix), mixed(suffix)
    n_batch, n_ctx = ctx.config.n_batch, ctx.n_ctx_seq
    take_prefix = min(len(prefix_ids), 3 * (n_batch // 4))
    take_suffix = min(len(suffix_ids), max(0, n_batch // 4 - (2 + len(prompt_ids))))
    take_extra = min(max(0, n_ctx - n_batch - 2 * n_predict), len(extra_ids))
    head = ctx.tokenize("", add_special=True)  # BOS, when the vocabulary adds one
    return [
        *extra_ids[len(extra_ids) - take_extra :],
        *head,
        fim.prefix,
        *prefix_ids[len(prefix_ids) - take_prefix :],
        *prompt_ids,
        fim.suffix,
        *suffix_ids[:take_suffix],
        fim.middle,
    ]


def _settings(body: Mapping[str, Any], params: llamax.SamplingParams) -> dict[str, Any]:
    """llama-server's ``generation_settings`` / a slot's ``params``, from what llamax runs."""
    return generation_settings(params) | {
        "stream": bool(body.get("stream", False)),
        "n_probs": 0,
        "cache_prompt": bool(body.get("cache_prompt", True)),
    }


_FIELDS = frozenset(f.name for f in INFILL)
"""The ``/infill`` fields llamax reads or refuses (:data:`~llamax.dialects.llama.INFILL`;
others, which editor plugins send for llama-server's own limits, are ignored)."""


@dataclass(frozen=True, slots=True)
class InfillRequest:
    """A checked ``/infill`` body."""

    body: dict[str, Any]
    request: NativeRequest


def infill_routes(state: ServerState, tables: SlotTables) -> APIRouter:
    """``POST /infill``: answered as ``/completion`` answers (whole or streamed), on the
    slot ``id_slot`` names or on any sequence."""

    def require_key(request: Request) -> None:  # 401 in OpenAI's shape, as every route
        state.check_api_key(request)

    router = APIRouter(dependencies=[Depends(require_key)])

    add_completion_routes(router, state, {"/infill": Infill(state, tables)})

    return router


class Infill:
    """llama-server's ``POST /infill`` (a :class:`~..route.CompletionRoute`): answered as
    ``/completion`` answers (whole or streamed), on the slot ``id_slot`` names or on any
    sequence."""

    endpoint = "infill"
    dialect = LLAMA
    fields = _FIELDS
    prompt_field = "prompt"
    check_key = False  # the router's dependency checks it (OpenAI's shape, as every route)
    ping_seconds = None

    def __init__(self, state: ServerState, tables: SlotTables) -> None:
        self.state, self.tables = state, tables

    def parse(self, raw: bytes) -> InfillRequest:
        """The body, checked."""
        return _parse(raw, state=self.state)

    def model(self, infill: InfillRequest) -> object:
        """The ``model`` the body names."""
        return infill.request.model

    def stream(self, infill: InfillRequest) -> bool:
        """Whether the reply streams."""
        return infill.request.stream

    def include_usage(self, infill: InfillRequest) -> bool:
        """llama-server's last event carries the counts."""
        return False

    async def start(self, infill: InfillRequest, ctx: llamax.Context, request: Request) -> Any:
        """The fill-in-the-middle prompt (tokenized in a worker), run as a completion."""
        body, native = infill.body, infill.request
        assert native.params is not None
        n_predict = native.params.max_tokens
        tokens = partial(
            infill_tokens, ctx, body["input_prefix"], body["input_suffix"],
            body.get("input_extra", []), body.get("prompt", ""),
            n_predict=-1 if n_predict is None else n_predict,
        )  # fmt: skip
        model = native.model or self.state.model_name(ctx)
        return await run_job(ctx, self.tables, native, native.params, tokens, model=model,
                             fair_key=client_key(request))  # fmt: skip


def _parse(raw: bytes, *, state: ServerState) -> InfillRequest:
    body = parse_object(raw)
    _check_body(body)
    params = sampling_params(
        body,
        default_n_predict=state.config.default_max_tokens,
        default_seed=state.config.default_seed,
    )
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise LlamaError(400, '"model" must be a string')
    native = NativeRequest(
        (), params, stream=bool(body.get("stream")),
        return_tokens=bool(body.get("return_tokens")), model=model,
        settings=_settings(body, params), id_slot=_slot_id(body.get("id_slot")),
    )  # fmt: skip
    return InfillRequest(body, native)


def _slot_id(value: object) -> int:
    """``id_slot`` as llama-server reads it (``null``: ``-1``, any slot; digits in a string
    are a number); whether that slot exists is checked against the model's slots.

    Raises:
        LlamaError: 400 ``Invalid slot ID`` for anything but an integer.
    """
    if value is None:
        return -1
    if isinstance(value, str) and value.lstrip("-").isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise LlamaError(400, "Invalid slot ID")
    return value


def sampling_params(
    body: Mapping[str, Any], *, default_n_predict: int | None = None,
    default_seed: int | None = None,
) -> llamax.SamplingParams:  # fmt: skip
    """llama-server's sampling fields as :class:`~llamax.SamplingParams`: ``n_predict``
    (``-1``: until the end of generation or the context), the fields of
    :data:`~llamax.dialects.llama.TAKEN_AS_GIVEN` (the sampling numbers, ``ignore_eos``,
    ``grammar``, ``json_schema``), ``seed`` (``-1``: random), ``stop``. ``default_n_predict`` and
    ``default_seed`` (the server's ``-n`` and ``--seed``) stand for a field left out.

    Raises:
        APIError: 400 for a field ``/infill`` refuses (a refused row of
            :data:`~llamax.dialects.llama.INFILL`), naming it.
        LlamaError: 400 for a value :class:`~llamax.SamplingParams` refuses.
    """
    try:
        check_fields(INFILL, body, unknown="ignore")
    except FieldError as exc:
        raise as_llama_error(exc) from exc
    options: dict[str, Any] = {
        f.option: body[f.name]
        for f in TAKEN_AS_GIVEN
        if f.option is not None and body.get(f.name) is not None
    }
    n_predict = body.get("n_predict", body.get("max_tokens", -1))
    if not isinstance(n_predict, int) or isinstance(n_predict, bool):
        raise LlamaError(400, f"n_predict must be an int, got {n_predict!r}")
    if n_predict < 0 and default_n_predict is not None:
        n_predict = default_n_predict
    options["max_tokens"] = None if n_predict < 0 else n_predict
    seed = body.get("seed", -1 if default_seed is None else default_seed)
    if seed not in (-1, NO_SEED, None):
        options["seed"] = seed
    stop = body.get("stop")
    if stop is not None:
        options["stop"] = [stop] if isinstance(stop, str) else stop
    try:
        return llamax.SamplingParams(**options)
    except (llamax.InvalidParameterError, TypeError, ValueError) as exc:
        raise LlamaError(400, str(exc)) from exc
