"""One request's share of the engine: a bound on the sequences one HTTP request may queue
(its prompts times its choices), and the fairness key its prompts share.

The engine takes turns between fairness keys (``add_request(fair_key=...)``, docs/server.md
"Fair turns"). Every request the server submits carries the key of its client,
:func:`client_key`: the peer's address, as uvicorn reports it (``X-Forwarded-For`` is taken
only from ``--forwarded-allow-ips``). One client's requests, however many at once, hold one
share together (first come, first served among themselves) and two clients take turns, so a
bystander's first token never waits behind another client's hundreds of requests. The key
never comes from a body or a header the client chooses: an API key is not one either (all
clients may share one). Where the peer is unknown, the several prompts of one
``/completion`` get a key of their own call (:func:`call_key`), as one request's choices
share one already.
"""

from __future__ import annotations

import uuid

from starlette.requests import HTTPConnection

from .errors import APIError

__all__ = ["DEFAULT_MAX_SEQUENCES", "call_key", "check_num_sequences", "client_key"]

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


def client_key(connection: HTTPConnection) -> str | None:
    """The fairness key of the client behind ``connection``: its peer address (behind a
    proxy, the forwarded one only where uvicorn trusts the proxy), or None when the server
    does not know it (the engine then gives the request a share of its own)."""
    client = connection.client
    return None if client is None or not client.host else f"client:{client.host}"
