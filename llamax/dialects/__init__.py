"""The API dialects as pure codecs: what each wire format's requests hold and what llamax
does with every field, with no :class:`~llamax.Context` and no web framework.

- :mod:`llamax.dialects.fields`: the one policy mechanism of every dialect, a
  :data:`~llamax.dialects.fields.FieldTable` per route (each field honoured, a hint or
  refused), applied by :func:`~llamax.dialects.fields.accept_fields` and documented by
  :func:`~llamax.dialects.fields.markdown_table`.
- :mod:`llamax.dialects.openai`: OpenAI's routes (chat, completions, embeddings, responses);
  :mod:`llamax.dialects.openai_parse` parses a chat or text completion body to its call,
  its JSON types checked by :mod:`llamax.dialects.json_types`.
- :mod:`llamax.dialects.anthropic`: Anthropic's Messages.
- :mod:`llamax.dialects.responses`: the Responses API's request (``parse_create``).
- :mod:`llamax.dialects.llama`: llama-server's native ``/completion`` and ``/infill``, with
  the mapping of its sampling names onto :class:`~llamax.SamplingParams`.
- Encoders, one per API (an :class:`~llamax.dialects.openai_encode.Encoder` each, driven
  over a handle by :meth:`llamax.openai.OpenAIRequest.events`):
  :mod:`llamax.dialects.openai_encode`, :mod:`llamax.dialects.anthropic_encode`,
  :mod:`llamax.dialects.responses_encode`, and llama-server's results in
  :mod:`llamax.dialects.llama_native`.
- :mod:`llamax.dialects.wire`: each API's wire format (server-sent event framing, what
  ends a stream, its error shapes, and what an event says for the meters).

Adding a request field is one row in its dialect's table. The layering rule
(``tests/test_layering.py``): this package imports neither the facade (``llamax.context``,
``llamax.session``) nor the server, nor Starlette or pydantic.
"""

from __future__ import annotations

from .anthropic import MESSAGES
from .fields import FieldTable
from .llama import NATIVE_TABLES
from .openai import ROUTES

__all__ = ["TABLES"]

TABLES: dict[str, FieldTable] = {**ROUTES, "messages": MESSAGES, **NATIVE_TABLES}
"""Every route's field table, by the name the docs blocks use (``<!-- fields: chat -->``,
``<!-- fields: infill -->``): what ``python scripts/option_tables.py`` writes."""
