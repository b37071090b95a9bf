"""Anthropic-shaped messages on top of the public :class:`llamax.Context` API.

:func:`messages`, :func:`amessages` and :func:`count_tokens` take the context and a
Messages request (a mapping shaped as Anthropic's ``POST /v1/messages`` body) and return
Anthropic's shapes; ``llamax serve`` builds its ``/v1/messages`` route on them. Built on
:mod:`llamax.openai`.
"""

from .messages import REQUEST_FIELDS, amessages, count_tokens, messages

__all__ = ["REQUEST_FIELDS", "amessages", "count_tokens", "messages"]
