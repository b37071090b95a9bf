"""Which messages to keep when a conversation outgrows the context."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..errors import ContextLengthError

__all__ = ["drop_oldest_turns", "leading_system_count"]

Message = dict[str, Any]


def leading_system_count(messages: Sequence[Message]) -> int:
    """How many system/developer messages open the conversation (they are always kept)."""
    count = 0
    while count < len(messages) and messages[count]["role"] in ("system", "developer"):
        count += 1
    return count


def drop_oldest_turns(
    messages: list[Message], num_tokens: Callable[[list[Message]], int], budget: int
) -> list[Message]:
    """Drop the oldest whole turns until ``num_tokens(kept) <= budget``.

    A turn starts at a user message and runs to the next one. The leading system messages
    and the newest turn are always kept.

    Raises:
        ContextLengthError: even the system messages plus the newest turn exceed ``budget``.
    """
    head = leading_system_count(messages)
    cuts = [head] + [i for i in range(head + 1, len(messages)) if messages[i]["role"] == "user"]
    for cut in cuts:
        kept = messages[:head] + messages[cut:]
        size = num_tokens(kept)
        if size <= budget:
            return kept
    raise ContextLengthError(
        f"the system messages and the newest turn need {size} tokens, more than the "
        f"{budget} available for the prompt",
        num_prompt_tokens=size,
        n_ctx=budget,
    )
