"""A chat or text call's preparation, below the facade: a :class:`~llamax.chat.ChatCall`
in, a :class:`Prepared` request out (prompt tokens, :class:`~llamax.SamplingParams` and
what the stream's parser needs). Nothing is submitted here, and no context is called: the work
runs on a :class:`ChatModel` (the template binding a context hands down, or a context
itself), and the caller submits ``prepared.prompt`` with ``prepared.params``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from ..errors import ContextLengthError, InvalidParameterError
from ..facts import ModelFacts
from ..images import Image
from ..params import SamplingParams
from ..reasoning import ReasoningFormat, opens_thinking
from ..templates.messages import validate_messages
from ..templates.truncation import drop_oldest_turns
from ..tools import PromptRenderer, ToolPlan, tool_call_grammar, tool_prompt_tokens
from .call import ChatCall, TextCall, new_request_id
from .options import Truncate

__all__ = [
    "ChatModel",
    "Prepared",
    "chat_prompt_tokens",
    "prepare_chat",
    "prepare_text",
]


class ChatModel(PromptRenderer, Protocol):
    """What chat preparation needs of a model: its template and tokenizer, the tokens a
    turn ends at and the sizes a request must fit (a :class:`llamax.Context` is one, and so
    is the :class:`~llamax.templates.binding.BoundTemplate` it hands down)."""

    @property
    def end_of_turn_token_ids(self) -> tuple[int, ...]:
        """Special tokens the template ends a turn with: chat stops there."""

    @property
    def facts(self) -> ModelFacts:
        """The model's facts: its name, and the sizes a request must fit (``n_ctx_seq``:
        the most tokens one sequence, prompt plus reply, may hold)."""

    def tokenize(
        self, text: str, *, add_special: bool = True, parse_special: bool = True
    ) -> list[int]:
        """Tokenize ``text``."""

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """Join the pieces of ``token_ids`` into text."""

    def prompt_positions(self, prompt: Sequence[int | Image]) -> int:
        """The positions a prompt of token ids and images takes in a sequence."""


@dataclass(frozen=True, slots=True)
class Prepared:
    """A checked request, ready to submit: ``add_request(prompt, params, request_id=...)``."""

    prompt: str | Sequence[int] | Sequence[int | Image]
    """The prompt tokens (chat; with a :class:`~llamax.Image` where each image sits), or
    the text completion's prompt as given."""
    params: SamplingParams
    """Sampling, with the template's end-of-turn tokens as stops (chat)."""
    kind: Literal["chat", "text"]
    model: str | None = None
    """The request's own ``model`` (echoed in the response); None: the model's name."""
    tools: ToolPlan = field(default_factory=ToolPlan)
    """Tool calling asked for (``mode="none"``: replies are plain text)."""
    reasoning_format: ReasoningFormat = "none"
    """How the reply's thinking is reported (:mod:`llamax.reasoning`; chat only)."""
    thinking_opened: bool = False
    """Whether the rendered prompt left a ``<think>`` open (the reply starts thinking)."""
    request_id: str = field(default_factory=new_request_id)
    num_positions: int | None = None
    """The positions the prompt takes (its images' included); None: one per item."""

    @property
    def num_prompt_tokens(self) -> int:
        """Positions of the prompt, an image's included (0 for a text prompt given as a
        string)."""
        if self.num_positions is not None:
            return self.num_positions
        return 0 if isinstance(self.prompt, str) else len(self.prompt)


def prepare_chat(model: ChatModel, call: ChatCall) -> Prepared:
    """Render and fit a chat call's messages (with tools, tool calls or tool results
    through :mod:`llamax.tools`), put its prefill after the opened assistant turn, and say
    how its reply is parsed.

    Raises:
        InvalidParameterError, InvalidMessageError, TemplateError: bad values or messages.
        ContextLengthError: the conversation does not fit (and ``truncate`` is not set).
    """
    params, plan = call.params, call.tools
    template_vars = _template_vars(call.enable_thinking)
    if plan.is_active or _mentions_tools(call.messages):
        if call.truncate != "none":
            raise InvalidParameterError(
                "truncate is not supported together with tools", param="truncate"
            )
        params, tokens = _tool_chat(model, call.messages, params, plan, template_vars)
    else:
        tokens = _plain_chat(
            model,
            call.messages,
            params,
            call.truncate,
            call.parse_special_in_content,
            template_vars,
        )
    tail = [t for t in tokens[-8:] if not isinstance(t, Image)]
    opened = call.reasoning_format != "none" and opens_thinking(model.detokenize(tail))
    num_images = sum(isinstance(t, Image) for t in tokens)
    num = model.prompt_positions(tokens) if num_images else None
    if call.prefill:
        prefill = model.tokenize(call.prefill, add_special=False, parse_special=False)
        tokens = [*tokens, *prefill]
        num = None if num is None else num + len(prefill)
    return Prepared(
        tokens,
        params.with_stop_token_ids(model.end_of_turn_token_ids),
        "chat",
        call.model,
        plan,
        call.reasoning_format,
        opened,
        request_id=call.request_id,
        num_positions=num,
    )


def prepare_text(call: TextCall) -> Prepared:
    """A text call as a :class:`Prepared` request (its prompt completed as given)."""
    prompt = call.prompt if isinstance(call.prompt, str) else list(call.prompt)
    return Prepared(prompt, call.params, "text", call.model, request_id=call.request_id)


def chat_prompt_tokens(model: ChatModel, call: ChatCall) -> list[int | Image]:
    """The prompt tokens :func:`prepare_chat` renders for ``call`` (tools and
    ``enable_thinking`` included; an image where each image sits), unfitted and without
    its prefill: for token counting (``model.prompt_positions`` counts an image's
    positions).

    Raises:
        InvalidRequestError: a message is invalid.
    """
    template_vars = _template_vars(call.enable_thinking)
    if call.tools.is_active or _mentions_tools(call.messages):
        return tool_prompt_tokens(model, call.messages, call.tools, **template_vars)
    return model.chat_prompt_parts(call.messages, **template_vars)


def _mentions_tools(messages: Sequence[Mapping[str, Any]]) -> bool:
    """Whether the conversation carries tool calls or tool results to render."""
    return any(
        isinstance(m, Mapping) and (m.get("role") == "tool" or m.get("tool_calls"))
        for m in messages
    )


def _template_vars(enable_thinking: bool | None) -> dict[str, Any]:
    return {} if enable_thinking is None else {"enable_thinking": enable_thinking}


def _plain_chat(
    model: ChatModel,
    messages: Sequence[Mapping[str, Any]],
    params: SamplingParams,
    truncate: Truncate,
    parse_special_in_content: bool,
    template_vars: dict[str, Any],
) -> list[int | Image]:
    """Validate, render and fit a conversation: its prompt tokens (and images).

    With ``truncate="oldest_messages"`` the cut is found by a binary search over turn
    boundaries (a few renders, whatever the length); each rendering is tokenized once.
    """
    msgs = validate_messages(messages)
    reserve = params.max_tokens or 1
    budget = model.facts.n_ctx_seq - reserve
    rendered: dict[int, tuple[list[int | Image], int]] = {}  # by the number of messages kept

    def render(kept: list[dict[str, Any]]) -> tuple[list[int | Image], int]:
        if len(kept) not in rendered:
            tokens = model.chat_prompt_parts(
                kept, parse_special_in_content=parse_special_in_content, **template_vars
            )
            rendered[len(kept)] = tokens, model.prompt_positions(tokens)
        return rendered[len(kept)]

    tokens, size = render(msgs)
    if size > budget:
        if truncate == "none":
            raise ContextLengthError(
                f"the conversation needs {size} prompt tokens + {reserve} for the reply, "
                f"more than a sequence may hold ({_limit(model)}); "
                "pass truncate='oldest_messages' to drop old turns",
                num_prompt_tokens=size,
                n_ctx=model.facts.n_ctx_seq,
            )
        kept = drop_oldest_turns(msgs, lambda m: render(m)[1], budget, reserve=reserve)
        tokens, size = render(kept)
    return tokens


def _tool_chat(
    model: ChatModel,
    messages: Sequence[Mapping[str, Any]],
    params: SamplingParams,
    plan: ToolPlan,
    template_vars: dict[str, Any],
) -> tuple[SamplingParams, list[int | Image]]:
    """Render a conversation with tools (or with earlier tool calls and results) and
    constrain the reply with the tool-call grammar: its params and prompt tokens.

    Raises:
        InvalidParameterError: tools together with ``grammar`` or ``response_format``.
        ContextLengthError: the conversation does not fit.
    """
    grammar = tool_call_grammar(plan)
    if grammar is not None and (params.grammar is not None or params.json_schema is not None):
        raise InvalidParameterError(
            "tools cannot be combined with grammar or response_format: the tool-call grammar "
            "already constrains the reply",
            param="tools",
        )
    if grammar is not None:
        params = dataclasses.replace(params, grammar=grammar)
    tokens = tool_prompt_tokens(model, messages, plan, **template_vars)
    reserve = params.max_tokens or 1
    size = model.prompt_positions(tokens)
    if size + reserve > model.facts.n_ctx_seq:
        raise ContextLengthError(
            f"the conversation with its tools needs {size} prompt tokens + {reserve} "
            f"for the reply, more than a sequence may hold ({_limit(model)})",
            num_prompt_tokens=size,
            n_ctx=model.facts.n_ctx_seq,
        )
    return params, tokens


def _limit(model: ChatModel) -> str:
    """``n_ctx=4096``, or ``n_ctx_seq=512`` when a sequence may hold less than ``n_ctx``."""
    if model.facts.n_ctx_seq == model.facts.n_ctx:
        return f"n_ctx={model.facts.n_ctx}"
    return f"n_ctx_seq={model.facts.n_ctx_seq}"
