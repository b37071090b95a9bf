"""Typed calls: a chat or text request as one frozen, checked value.

A :class:`ChatCall` (or :class:`TextCall`) is what every way into chat turns a request
into, before anything is rendered or submitted: the Python conveniences
(``Context.chat_completion(messages, **options)``), the server's dialects (OpenAI,
Anthropic, Responses, llama-server) and anyone building one directly. Its fields are
already checked: the sampling as :class:`~llamax.SamplingParams`, the tools as a
:class:`~llamax.tools.ToolPlan`, the chat settings as values. ``Context.submit_chat(call)``
is the one entry that renders it (in the caller's thread or, with ``asubmit_chat``, in a
worker) and submits it.

:meth:`ChatCall.of` and :meth:`TextCall.of` build a call from OpenAI-named options (the
names and defaults of :class:`~llamax.chat.options.ChatOptions`), refusing an unknown name
with ``TypeError`` and a bad value with :class:`~llamax.InvalidParameterError`.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, get_args

from ..errors import InvalidMessageError, InvalidParameterError
from ..params import SamplingParams
from ..reasoning import ReasoningFormat, check_reasoning_format
from ..tools import ToolPlan, prepare_tools
from .options import (
    CHAT_OPTIONS,
    COMPLETION_OPTIONS,
    ChatOptions,
    CompletionOptions,
    Truncate,
    check_flag,
    check_option_names,
    keeps_prefix,
    sampling_params,
)

__all__ = ["ChatCall", "TextCall", "new_request_id"]


def new_request_id() -> str:
    """A fresh request id: ``req-`` and 24 hex digits."""
    return f"req-{uuid.uuid4().hex[:24]}"


def _model(name: object) -> str | None:
    """A request's own ``model`` when it is a non-empty str (OpenAI and llama-server echo
    it); anything else names no model."""
    return name if isinstance(name, str) and name else None


@dataclass(frozen=True, slots=True, kw_only=True)
class ChatCall:
    """One chat request, checked: what ``Context.submit_chat`` renders and submits.

    Build it with :meth:`of` from OpenAI-named options, or directly (every field is
    checked here as well).

    Raises:
        InvalidParameterError: a setting is out of range or of the wrong type.
        InvalidMessageError: ``messages`` is not a non-empty list of message objects.
    """

    messages: tuple[Mapping[str, Any], ...]
    """The conversation: OpenAI-shaped messages (validated in full when rendered)."""
    params: SamplingParams = field(default_factory=SamplingParams)
    """Sampling; the template's end-of-turn tokens are added as stops when rendered."""
    tools: ToolPlan = field(default_factory=ToolPlan)
    """Tool calling asked for (``mode="none"``: replies are plain text)."""
    reasoning_format: ReasoningFormat = "auto"
    """How the reply's thinking is reported (:mod:`llamax.reasoning`)."""
    enable_thinking: bool | None = None
    """Passed to templates that take it (Qwen3's switch); ``None``: the template's default."""
    truncate: Truncate = "none"
    """``"oldest_messages"``: drop the oldest whole turns when the conversation is too long."""
    parse_special_in_content: bool = False
    """Parse special-token text in message content (unsafe; see docs/chat.md)."""
    prefill: str = ""
    """The start of the reply (Anthropic's assistant prefill): put after the opened
    assistant turn as plain text, so the model continues it; the reply holds only what
    follows it."""
    model: str | None = None
    """The request's own ``model``, echoed in the response (``None``: the model's name)."""
    request_id: str = field(default_factory=new_request_id)

    def __post_init__(self) -> None:
        messages: object = self.messages
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
            raise InvalidMessageError(
                f"messages must be a list of message dicts, got {type(messages).__name__}",
                param="messages",
            )
        if not messages:
            raise InvalidMessageError("messages must not be empty", param="messages")
        object.__setattr__(self, "messages", tuple(messages))
        if not isinstance(self.params, SamplingParams):
            raise InvalidParameterError("params must be a SamplingParams")
        if not isinstance(self.tools, ToolPlan):
            raise InvalidParameterError(
                "tools must be a ToolPlan (llamax.tools.prepare_tools)", param="tools"
            )
        check_reasoning_format(self.reasoning_format)
        if self.enable_thinking is not None and not isinstance(self.enable_thinking, bool):
            raise InvalidParameterError(
                f"enable_thinking must be a bool, got {self.enable_thinking!r}",
                param="enable_thinking",
            )
        if self.truncate not in get_args(Truncate):
            raise InvalidParameterError(
                f"truncate must be 'none' or 'oldest_messages', got {self.truncate!r}",
                param="truncate",
            )
        if self.truncate != "none" and self.tools.is_active:
            raise InvalidParameterError(
                "truncate is not supported together with tools", param="truncate"
            )
        if not isinstance(self.parse_special_in_content, bool):
            raise InvalidParameterError(
                f"parse_special_in_content must be a bool, got {self.parse_special_in_content!r}",
                param="parse_special_in_content",
            )
        if not isinstance(self.prefill, str):
            raise InvalidParameterError(
                f"prefill must be a string, got {self.prefill!r}", param="prefill"
            )
        if self.model is not None and not isinstance(self.model, str):
            raise InvalidParameterError(
                f"model must be a string, got {self.model!r}", param="model"
            )

    @classmethod
    def of(
        cls,
        messages: Sequence[Mapping[str, Any]],
        *,
        prefill: str = "",
        request_id: str | None = None,
        _where: str = "ChatCall.of",
        **options: Any,
    ) -> ChatCall:
        """The call for ``messages`` with OpenAI-named chat options (``max_tokens``,
        ``temperature``, ``tools``, ``response_format``, ``truncate`` ...: see
        :class:`~llamax.chat.options.ChatOptions`). ``stream`` and ``stream_options`` are
        not options here (they say how the result is read, not what is asked). ``_where``:
        the name an unknown option's ``TypeError`` gives the call (the facade's
        conveniences give theirs).

        Raises:
            TypeError: an unknown option (the message names the closest valid one).
            InvalidParameterError: a bad value.
        """
        check_option_names(options, CHAT_OPTIONS - {"stream", "stream_options"}, _where)
        opts: ChatOptions = options  # type: ignore[assignment]
        params = sampling_params(opts, chat=True)
        if check_flag(opts.get("return_progress"), "return_progress"):
            params = dataclasses.replace(params, prefill_progress=True)
        if keeps_prefix(opts):
            params = dataclasses.replace(params, keep_prefix=True)
        tools = prepare_tools(
            opts.get("tools"), opts.get("tool_choice"), opts.get("parallel_tool_calls")
        )
        extra = {} if request_id is None else {"request_id": request_id}
        return cls(
            messages=messages,  # type: ignore[arg-type]
            params=params,
            tools=tools,
            reasoning_format=check_reasoning_format(opts.get("reasoning_format", "auto")),
            enable_thinking=opts.get("enable_thinking"),
            truncate=opts.get("truncate", "none"),
            parse_special_in_content=opts.get("parse_special_in_content", False),
            prefill=prefill,
            model=_model(opts.get("model")),
            **extra,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class TextCall:
    """One text completion request, checked: what ``Context.submit_text`` submits.

    Raises:
        InvalidParameterError: the prompt is neither a string nor a list of token ids.
    """

    prompt: str | tuple[int, ...]
    """The prompt, as text or token ids, completed as given (no template)."""
    params: SamplingParams = field(default_factory=SamplingParams)
    model: str | None = None
    """The request's own ``model``, echoed in the response (``None``: the model's name)."""
    request_id: str = field(default_factory=new_request_id)

    def __post_init__(self) -> None:
        if not isinstance(self.prompt, str):
            if isinstance(self.prompt, bytes) or not isinstance(self.prompt, Sequence):
                raise InvalidParameterError(
                    "prompt must be a string or a list of token ids", param="prompt"
                )
            object.__setattr__(self, "prompt", tuple(self.prompt))
        if not isinstance(self.params, SamplingParams):
            raise InvalidParameterError("params must be a SamplingParams")
        if self.model is not None and not isinstance(self.model, str):
            raise InvalidParameterError(
                f"model must be a string, got {self.model!r}", param="model"
            )

    @classmethod
    def of(
        cls,
        prompt: str | Sequence[int],
        *,
        request_id: str | None = None,
        _where: str = "TextCall.of",
        **options: Any,
    ) -> TextCall:
        """The call for ``prompt`` with OpenAI-named completion options
        (:class:`~llamax.chat.options.CompletionOptions`); ``_where`` as in
        :meth:`ChatCall.of`.

        Raises:
            TypeError: an unknown option.
            InvalidParameterError: a bad value.
        """
        allowed = COMPLETION_OPTIONS - {"stream", "stream_options"}
        check_option_names(options, allowed, _where)
        opts: CompletionOptions = options  # type: ignore[assignment]
        params = sampling_params(opts, chat=False)
        extra = {} if request_id is None else {"request_id": request_id}
        return cls(prompt=prompt, params=params, model=_model(opts.get("model")), **extra)  # type: ignore[arg-type]
