"""The conversation of chat_shift.py and shift_agreement.py, the turn dropping llamax's
Chat and ``truncate="oldest_messages"`` do, and a chat that drops turns without shifting.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import llamax

__all__ = ["SYSTEM", "Message", "ReprefillChat", "drop_oldest_turns", "user_messages"]

Message = dict[str, Any]

SYSTEM = (
    "You are Atlas, the research assistant of a small public library. Visitors ask you "
    "about many different subjects, one after another, in a single long conversation. "
    "Answer each question in two or three plain sentences, without lists or headings. "
    "Stay factual and friendly, say so when you are unsure, and never invent book titles, "
    "dates or names. If a question refers to something said earlier, use the conversation "
    "to answer it; otherwise treat it as a new topic."
)
_TOPICS = (
    "the history of the printing press in fifteenth-century Europe",
    "how lighthouses warned ships before electricity existed",
    "the water cycle and why clouds form over warm oceans",
    "the rules of chess and how a pawn can be promoted",
    "bread baking and the role of yeast in the dough",
    "the migration of monarch butterflies across North America",
    "how a bicycle stays upright while it is moving",
    "volcanoes and the difference between lava and magma",
    "the invention of the telephone and its first users",
    "honeybees and how a colony decides where to build a new hive",
    "the solar system and why Pluto is no longer called a planet",
    "composting kitchen waste in a small city garden",
    "the Silk Road and the goods traded along it",
    "how vaccines train the immune system",
)
_ASPECTS = (
    "I am mostly curious about the people involved and what they were trying to achieve",
    "could you explain the basic mechanism in simple terms for a twelve-year-old",
    "what are the most common misconceptions that people still believe about it",
    "how did our understanding of it change over the last hundred years",
    "which everyday objects or habits are connected to it without us noticing",
    "what would be a good first experiment or activity to learn more about it at home",
    "why do experts still disagree about some parts of it today",
)
_ENDINGS = (
    "Please keep the answer short.",
    "A brief answer is enough for now.",
    "Answer in a few sentences, please.",
    "Keep it simple and concrete.",
    "I only need the main idea.",
)


def user_messages(count: int) -> list[str]:
    """``count`` deterministic, varied user messages of about 30-60 tokens."""
    out = []
    for k in range(count):
        aspect = _ASPECTS[(k * 3) % len(_ASPECTS)]
        out.append(
            f"Tell me about topic {k + 1}: {_TOPICS[k % len(_TOPICS)]}. "
            f"{aspect[0].upper()}{aspect[1:]}? {_ENDINGS[(k * 2) % len(_ENDINGS)]}"
        )
    return out


def drop_oldest_turns(
    messages: list[Message], num_tokens: Callable[[list[Message]], int], budget: int
) -> list[Message]:
    """Drop the oldest whole turns (from a user message to the next) until the rest fits;
    the system message and the newest turn always stay (as llamax's Chat and truncate do)."""
    cuts = [1] + [i for i in range(2, len(messages)) if messages[i]["role"] == "user"]
    for cut in cuts:
        kept = messages[:1] + messages[cut:]
        if num_tokens(kept) <= budget:
            return kept
    raise RuntimeError("the system message and the newest turn do not fit")


class ReprefillChat:
    """Chat's turn logic on a public ``Session``, without the history shift.

    After a drop, the session keeps the longest common prefix of its cells and the
    shortened conversation (the system turn) and prefills everything after it again, as
    ``Chat`` does where the memory cannot shift.
    """

    def __init__(self, ctx: llamax.Context, system: str, params: llamax.SamplingParams) -> None:
        self.ctx, self.session = ctx, ctx.session()
        eot = tuple(t for t in ctx.end_of_turn_token_ids if t not in params.stop_token_ids)
        self.params = dataclasses.replace(params, stop_token_ids=(*params.stop_token_ids, *eot))
        self.messages: list[Message] = [{"role": "system", "content": system}]
        self.last_turn: llamax.TurnStats | None = None

    def send(self, content: str) -> llamax.Completion:
        wanted = [*self.messages, {"role": "user", "content": content}]
        budget = self.ctx.n_ctx - (self.params.max_tokens or 1)
        kept = drop_oldest_turns(wanted, lambda m: len(self.ctx.chat_prompt(m)), budget)
        prompt = self.ctx.chat_prompt(kept)
        completion = self.session.add_request(prompt, self.params).result()
        self.messages = [*kept, {"role": "assistant", "content": completion.text}]
        reused = completion.usage.cached_tokens
        dropped = len(wanted) - len(kept)
        self.last_turn = llamax.TurnStats(len(prompt), reused, len(prompt) - reused, dropped, 0)
        return completion

    def close(self) -> None:
        self.session.close()
