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
    messages: list[Message],
    num_tokens: Callable[[list[Message]], int],
    budget: int,
    *,
    reserve: int = 0,
    limit_name: str = "n_ctx",
) -> list[Message]:
    """Drop the fewest oldest whole turns so that ``num_tokens(kept) <= budget``.

    A turn starts at a user message and runs to the next one. The leading system messages
    and the newest turn are always kept. The cut is found by binary search over the turn
    boundaries, so ``num_tokens`` is called about ``log2(turns) + 2`` times, not once per
    turn: a conversation of thousands of turns costs a dozen renders. The search assumes
    that dropping turns never lengthens the prompt (true of chat templates); whatever the
    template, the kept messages returned were measured to fit.

    ``reserve`` is what the caller keeps for the reply (``max_tokens``) beyond ``budget``:
    the error says both, so that a user knows whether to raise ``n_ctx`` or lower
    ``max_tokens``; ``limit_name`` names the setting that bounds ``budget + reserve``.

    Raises:
        ContextLengthError: even the system messages plus the newest turn exceed ``budget``.
    """
    head = leading_system_count(messages)
    cuts = [head] + [i for i in range(head + 1, len(messages)) if messages[i]["role"] == "user"]

    def kept(k: int) -> list[Message]:
        return messages[:head] + messages[cuts[k] :]

    sizes: dict[int, int] = {}

    def size(k: int) -> int:
        if k not in sizes:
            sizes[k] = num_tokens(kept(k))
        return sizes[k]

    last = len(cuts) - 1
    if size(last) > budget:
        raise _too_long(size(last), head, budget, reserve, limit_name)
    low, high = 0, last  # the answer lies in [low, high]; cut ``high`` fits
    while low < high:
        middle = (low + high) // 2
        if size(middle) <= budget:
            high = middle
        else:
            low = middle + 1
    return kept(high)


def _too_long(
    num_tokens: int, num_system: int, budget: int, reserve: int, limit_name: str
) -> ContextLengthError:
    """The error for a prompt whose newest turn (and leading system messages) alone
    exceeds ``budget``: the sequence's ``budget + reserve`` tokens less the ``reserve``
    kept for the reply. It says the sizes as they are and what to change."""
    system = f" and {num_system} system message{'s' if num_system > 1 else ''}"
    what = "its newest turn" + (system if num_system else "")
    limit = budget + reserve
    fixes = [f"raise {limit_name} to at least {num_tokens + reserve}"]
    if reserve and num_tokens < limit:
        fixes.append(f"lower max_tokens to {limit - num_tokens} or less")
    kept = f", {reserve} of them kept for the reply (max_tokens)" if reserve else ""
    return ContextLengthError(
        f"the prompt ({what}) needs {num_tokens} tokens, but a sequence holds {limit} "
        f"({limit_name}){kept}: {', or '.join(fixes)}, or shorten the prompt",
        num_prompt_tokens=num_tokens,
        n_ctx=limit,
    )
