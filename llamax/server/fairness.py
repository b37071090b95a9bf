"""One request's share of the engine: a bound on the sequences one HTTP request may queue
(its prompts times its choices), and the fairness key its prompts share.

The engine takes turns between fairness keys (``add_request(fair_key=...)``, docs/server.md
"Fair turns"): a request alone is one key, so an ``n > 1`` request already holds one share;
the several prompts of one ``/completion`` are several engine requests, so they get one key
of their own call and hold one share together, and a bystander's first token never waits
behind them.
"""

from __future__ import annotations

import uuid

from .errors import APIError

__all__ = ["DEFAULT_MAX_SEQUENCES", "call_key", "check_num_sequences"]

DEFAULT_MAX_SEQUENCES = 64
"""The most sequences (prompts x choices) one request may queue, by default
(``--max-sequences-per-request``)."""


def check_num_sequences(num_prompts: int, n: int, most: int, *, param: str) -> None:
    """A 400 naming the limit when ``num_prompts`` prompts of ``n`` choices each make more
    than ``most`` sequences.

    Raises:
        APIError: 400, code ``too_many_sequences``, ``param`` the field at fault.
    """
    num = num_prompts * n
    if num > most:
        shape = f"{num_prompts} prompts x {n} choices" if num_prompts > 1 else f"{n} choices"
        raise APIError(
            400,
            f"the request asks for {num} sequences ({shape}); at most {most} are allowed "
            "per request (--max-sequences-per-request)",
            param=param,
            code="too_many_sequences",
        )


def call_key() -> str:
    """A fairness key of one HTTP request's own: its engine requests hold one share."""
    return f"call-{uuid.uuid4().hex}"
