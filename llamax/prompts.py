"""Checks a request goes through in ``add_request``, before it reaches the engine."""

from __future__ import annotations

import json
from collections.abc import Sequence

from .backend.base import Backend
from .errors import (
    ContextLengthError,
    EmptyPromptError,
    GrammarError,
    InvalidParameterError,
    InvalidRequestError,
)
from .grammar import check_repetitions, schema_to_gbnf
from .params import SamplingParams

__all__ = ["check_token_ids", "prompt_tokens", "request_grammar"]


def prompt_tokens(backend: Backend, prompt: str | Sequence[int], n_ctx: int) -> list[int]:
    """Tokenize (or check) ``prompt``; it must leave room in ``n_ctx`` for one new token.

    Raises:
        InvalidRequestError: the prompt is neither text nor a list of in-vocabulary ids.
        EmptyPromptError: it has no tokens.
        ContextLengthError: it has ``n_ctx`` tokens or more.
    """
    if isinstance(prompt, str):
        tokens = backend.tokenize(prompt)
    elif isinstance(prompt, (list, tuple)):
        tokens = list(prompt)
        n_vocab = backend.n_vocab
        for t in tokens:
            if not isinstance(t, int) or not 0 <= t < n_vocab:
                raise InvalidRequestError(
                    f"prompt token ids must be ints in [0, {n_vocab}), got {t!r}"
                )
    else:
        raise InvalidRequestError(
            f"prompt must be a str or a list of token ids, got {type(prompt).__name__}"
        )
    if not tokens:
        raise EmptyPromptError("the prompt is empty (it tokenized to zero tokens)")
    if len(tokens) >= n_ctx:
        raise ContextLengthError(
            f"the prompt has {len(tokens)} tokens but the context holds {n_ctx}; "
            "it must leave room for at least one generated token",
            num_prompt_tokens=len(tokens),
            n_ctx=n_ctx,
        )
    return tokens


def request_grammar(backend: Backend, params: SamplingParams) -> str | None:
    """The GBNF grammar of ``params`` (converted from ``json_schema`` if given), checked.

    Raises:
        GrammarError: the schema cannot be converted or llama.cpp refuses the grammar.
    """
    grammar = params.grammar
    if params.json_schema is not None:
        grammar = schema_to_gbnf(json.dumps(params.json_schema))  # keeps property order
    if grammar is not None:
        problem = check_repetitions(grammar) or backend.check_grammar(grammar)
        if problem is not None:
            raise GrammarError(f"invalid grammar: {problem}")
    return grammar


def check_token_ids(backend: Backend, params: SamplingParams) -> None:
    """Token ids in ``logit_bias`` and ``stop_token_ids`` must be in the vocabulary.

    Raises:
        InvalidParameterError: naming the field and the ids out of range.
    """
    n_vocab = backend.n_vocab
    for name, ids in (
        ("logit_bias", params.logit_bias.keys()),
        ("stop_token_ids", params.stop_token_ids),
    ):
        bad = [t for t in ids if t >= n_vocab]
        if bad:
            raise InvalidParameterError(
                f"{name} holds token ids outside the vocabulary [0, {n_vocab}): {bad}"
            )
