"""Anthropic-shaped messages on top of the public :class:`llamax.Context` API.

:func:`messages`, :func:`amessages` and :func:`count_tokens` take the context and a
Messages request (a mapping shaped as Anthropic's ``POST /v1/messages`` body) and return
Anthropic's shapes; ``llamax serve`` builds its ``/v1/messages`` route on them. The request
side (fields, mapping onto a :class:`~llamax.chat.ChatCall`) is the dialect's codec,
:mod:`llamax.dialects.anthropic`; the reply is read through :mod:`llamax.openai`.
"""

from ..dialects.anthropic import REQUEST_FIELDS
from .messages import amessages, count_tokens, messages

__all__ = ["REQUEST_FIELDS", "amessages", "count_tokens", "messages"]
