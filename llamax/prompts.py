"""Checks a request goes through in ``add_request``, before it reaches the engine."""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt

from .adapters import NO_ADAPTERS, AdapterSet
from .backend.base import Backend
from .engine.images import PromptImage
from .engine.sequence import Request
from .errors import (
    ContextClosedError,
    ContextLengthError,
    EmptyPromptError,
    GrammarError,
    InvalidParameterError,
    InvalidRequestError,
    RequestFailedError,
)
from .grammar import check_repetitions, schema_to_gbnf
from .grammar_budget import gbnf_problem
from .handle import RequestHandle
from .images import Image, ImagePrompts, is_parts
from .params import SamplingParams

Prompt: TypeAlias = (
    "str | Sequence[int] | npt.NDArray[np.integer[Any]] | Sequence[str | Image] "
    "| Sequence[int | Image]"
)
"""What ``add_request`` accepts: text, token ids (ints or numpy integers), a 1-D integer
array of them, or parts of text and :class:`~llamax.Image`, or token ids and images (what
``Context.chat_prompt_parts`` renders), on a context with ``mmproj``."""

__all__ = [
    "Prompt",
    "build_request",
    "check_token_ids",
    "prompt_token_ids",
    "prompt_tokens",
    "request_grammar",
]


def prompt_tokens(backend: Backend, prompt: Prompt, n_ctx: int) -> list[int]:
    """Tokenize (or check) ``prompt``; it must leave room in ``n_ctx`` for one new token.

    Raises:
        InvalidRequestError: the prompt is neither text nor a list of in-vocabulary ids,
            or its text holds a lone surrogate.
        EmptyPromptError: it has no tokens.
        ContextLengthError: it has ``n_ctx`` tokens or more.
        RequestFailedError: the backend's tokenizer raised (its error is chained).
    """
    if isinstance(prompt, str):
        try:
            tokens = backend.tokenize(prompt)
        except InvalidRequestError:  # the text itself is bad (a lone surrogate)
            raise
        except ContextClosedError:
            raise  # the context closed while this request was being built
        except Exception as exc:
            raise RequestFailedError(f"the tokenizer failed: {exc!r}") from exc
    elif isinstance(prompt, (np.ndarray, list, tuple)):
        tokens = prompt_token_ids(backend, prompt)
    else:
        raise InvalidRequestError(
            f"prompt must be a str, a list of token ids or a 1-D integer array, "
            f"got {type(prompt).__name__}",
            param="prompt",
        )
    if not tokens:
        raise EmptyPromptError("the prompt is empty (it tokenized to zero tokens)")
    if len(tokens) >= n_ctx:
        raise ContextLengthError(
            f"the prompt has {len(tokens)} tokens but a sequence may hold {n_ctx}; "
            "it must leave room for at least one generated token",
            num_prompt_tokens=len(tokens),
            n_ctx=n_ctx,
        )
    return tokens


def prompt_token_ids(backend: Backend, ids: object) -> list[int]:
    """``ids`` (a list, tuple or 1-D integer array) as plain ints within the vocabulary.

    Raises:
        InvalidRequestError: not a sequence of ints in ``[0, n_vocab)``.
    """
    if isinstance(ids, np.ndarray):
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise InvalidRequestError(
                f"a token id array must be 1-D and of an integer dtype, got {ids.dtype} "
                f"of shape {ids.shape}",
                param="prompt",
            )
        return _checked_ids(backend, ids.tolist())
    if not isinstance(ids, (list, tuple)):
        raise InvalidRequestError(
            f"token ids must be a list of ints, got {type(ids).__name__}", param="prompt"
        )
    return _checked_ids(backend, ids)


def _checked_ids(backend: Backend, ids: Sequence[object]) -> list[int]:
    """Plain ints from ``ids`` (numpy integers accepted), each within the vocabulary."""
    n_vocab = backend.facts.n_vocab
    tokens = []
    for t in ids:
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
            raise InvalidRequestError(f"prompt token ids must be ints, got {t!r}", param="prompt")
        if not 0 <= t < n_vocab:
            raise InvalidRequestError(
                f"prompt token ids must be in [0, {n_vocab}), got {t!r}", param="prompt"
            )
        tokens.append(int(t))
    return tokens


def _ids_checked(backend: Backend, parts: Sequence[object]) -> list[object]:
    """A prompt of parts with its token ids (if any) checked and made plain ints."""
    if not any(isinstance(p, (int, np.integer)) and not isinstance(p, bool) for p in parts):
        return list(parts)
    ids = [p for p in parts if not isinstance(p, (Image, str))]
    checked = iter(_checked_ids(backend, ids))
    return [p if isinstance(p, (Image, str)) else next(checked) for p in parts]


def request_grammar(backend: Backend, params: SamplingParams) -> str | None:
    """The GBNF grammar of ``params`` (converted from ``json_schema`` if given), checked.

    Raises:
        GrammarError: the schema cannot be converted or llama.cpp refuses the grammar; its
            ``param`` is ``"json_schema"`` or ``"grammar"``, whichever the grammar came from.
    """
    source = "json_schema" if params.json_schema is not None else "grammar"
    try:
        return _checked_grammar(backend, params)
    except GrammarError as exc:
        exc.param = exc.param or source  # the field at fault, for the HTTP layers
        raise


def _checked_grammar(backend: Backend, params: SamplingParams) -> str | None:
    grammar = params.grammar
    if params.json_schema is not None:
        try:
            text = json.dumps(params.json_schema)  # keeps property order
        except (RecursionError, ValueError) as exc:  # too deep; an integer of 4,300+ digits
            raise GrammarError(f"the JSON schema cannot be read: {exc}") from exc
        grammar = schema_to_gbnf(text)
    if grammar is not None:
        problem = (
            gbnf_problem(grammar) or check_repetitions(grammar) or backend.check_grammar(grammar)
        )
        if problem is not None:
            raise GrammarError(f"invalid grammar: {problem}")
    return grammar


def check_token_ids(backend: Backend, params: SamplingParams) -> None:
    """Token ids in ``logit_bias`` and ``stop_token_ids`` must be in the vocabulary.

    Raises:
        InvalidParameterError: naming the field and the ids out of range.
    """
    n_vocab = backend.facts.n_vocab
    for name, ids in (
        ("logit_bias", params.logit_bias.keys()),
        ("stop_token_ids", params.stop_token_ids),
    ):
        bad = [t for t in ids if t >= n_vocab]
        if bad:
            raise InvalidParameterError(
                f"{name} holds token ids outside the vocabulary [0, {n_vocab}): {bad}", param=name
            )


def build_request(
    backend: Backend,
    prompt: Prompt,
    params: SamplingParams | None,
    handle: RequestHandle,
    *,
    n_ctx: int,
    priority: int,
    arrival: int,
    session_id: int | None = None,
    adapters: AdapterSet = NO_ADAPTERS,
    images: ImagePrompts | None = None,
    fair_key: str | None = None,
) -> Request:
    """Check everything about a request that can be known before it runs, and build it.
    A prompt of parts is read, tokenized and its images encoded here, by ``images``.

    Raises:
        InvalidRequestError: wrong types, bad token ids, or n != 1 in a session.
        EmptyPromptError, ContextLengthError, GrammarError: see :func:`prompt_tokens` and
            :func:`request_grammar`.
        ImageError: an image in a context without a projector, or one that cannot be read.
    """
    params = params if params is not None else SamplingParams()
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError(
            f"params must be a SamplingParams, got {type(params).__name__}", param="params"
        )
    if session_id is not None and params.n != 1:
        raise InvalidParameterError(f"n must be 1 for a session request, got {params.n}", param="n")
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise InvalidRequestError(f"priority must be an int, got {priority!r}", param="priority")
    if fair_key is not None and not (isinstance(fair_key, str) and fair_key):
        raise InvalidRequestError(
            f"fair_key must be a non-empty str, got {fair_key!r}", param="fair_key"
        )
    parts = is_parts(prompt)
    if not parts:
        tokens = prompt_tokens(backend, prompt, n_ctx)
    check_token_ids(backend, params)
    grammar = request_grammar(backend, params)
    placed: tuple[PromptImage, ...] = ()
    if parts:  # last: encoding is the costly check
        assert isinstance(prompt, (list, tuple))
        tokens, placed = (images or ImagePrompts(None)).prompt(_ids_checked(backend, prompt), n_ctx)
    return Request(
        handle.request_id,
        tokens,
        params,
        handle,
        token_to_piece=backend.token_to_piece,
        seed=params.seed if params.seed is not None else secrets.randbits(32),
        priority=priority,
        arrival=arrival,
        num_choices=params.n,
        session_id=session_id,
        grammar=grammar,
        adapters=adapters,
        images=placed,
        fair_key=fair_key,
    )
