"""Per-request text that clients put at the top of the prompt and that carries nothing for
the model: left out of the rendered prompt, so it cannot break the prefix cache.

Claude Code (since 2.1.36) sends, as a system text block (its first), an attribution line
``x-anthropic-billing-header: cc_version=...; cc_entrypoint=cli; cch=<5 hex>;`` whose
``cch`` changes on every request. Rendered, it makes every turn's prompt differ from the
previous one at its first tokens, so nothing is reused and every turn prefills its whole
prompt again. Anthropic's API reads it as a header; a model has no use for it. Only that
exact shape is dropped: a ``text`` block of the ``system`` list whose text starts with
``x-anthropic-billing-header:`` (wherever it sits in the list); a system string and the
messages are left as they are.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["BILLING_HEADER_PREFIX", "is_billing_header", "without_billing_header"]

BILLING_HEADER_PREFIX = "x-anthropic-billing-header:"
"""How Claude Code's per-request attribution block starts."""


def is_billing_header(block: Any) -> bool:
    """Whether ``block`` is Claude Code's attribution block: a system ``text`` block whose
    text starts with :data:`BILLING_HEADER_PREFIX`."""
    return (
        isinstance(block, Mapping)
        and block.get("type") == "text"
        and isinstance(block.get("text"), str)
        and block["text"].startswith(BILLING_HEADER_PREFIX)
    )


def without_billing_header(system: Any) -> Any:
    """A request's ``system`` without Claude Code's attribution blocks: a list loses them
    (a list of nothing else becomes ``None``: no system prompt); anything else is
    returned as it is, to be checked by the caller."""
    if not isinstance(system, list):
        return system
    kept = [block for block in system if not is_billing_header(block)]
    if len(kept) == len(system):
        return system
    return kept or None
