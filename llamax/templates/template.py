"""Render a model's own Jinja chat template, sandboxed and on a budget.

:class:`ChatTemplate` follows the Hugging Face ``apply_chat_template`` conventions, so the
templates shipped in GGUF files render as they do in ``transformers``: the variables
``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token`` and ``tools`` plus any
extra keyword arguments; the globals ``raise_exception`` and ``strftime_now``; a ``tojson``
filter that does not HTML-escape; ``trim_blocks``, ``lstrip_blocks`` and loop controls.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field
from datetime import datetime
from typing import Any, NoReturn

try:
    import jinja2
    from jinja2.exceptions import SecurityError
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError("llamax.templates needs jinja2: pip install jinja2") from exc

from ..errors import (
    InvalidParameterError,
    TemplateBudgetError,
    TemplateError,
    TemplateSecurityError,
)
from .sandbox import BudgetedSandbox, BudgetExceeded, RenderBudget, active_budget

__all__ = ["ChatTemplate", "TemplateBudgetError", "TemplateError", "TemplateSecurityError"]


def raise_exception(message: Any) -> NoReturn:
    """The ``raise_exception(msg)`` global: fail the render with the template's message."""
    raise TemplateError(f"chat template raised an error: {message}")


def strftime_now(fmt: str) -> str:
    """The ``strftime_now(fmt)`` global: the local time now, formatted with ``fmt``."""
    return datetime.now().strftime(fmt)


def tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """The ``tojson`` filter as ``transformers`` defines it: plain ``json.dumps``, no escaping."""
    return json.dumps(
        value,
        ensure_ascii=ensure_ascii,
        indent=indent,
        separators=separators,
        sort_keys=sort_keys,
    )


def _as_template_error(exc: Exception) -> TemplateError:
    """The llamax error for an exception raised while rendering."""
    if isinstance(exc, BudgetExceeded):
        return TemplateBudgetError(str(exc))
    if isinstance(exc, SecurityError):
        return TemplateSecurityError(f"chat template refused by the sandbox: {exc}")
    if isinstance(exc, RecursionError):
        return TemplateBudgetError("chat template recursed too deeply (RecursionError)")
    if isinstance(exc, MemoryError):
        return TemplateBudgetError("chat template ran out of memory (MemoryError)")
    return TemplateError(f"chat template failed to render: {type(exc).__name__}: {exc}")


def _compile(source: str) -> jinja2.Template:
    environment = BudgetedSandbox()
    environment.add_filter("tojson", tojson)
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = strftime_now
    try:
        return environment.compile_template(source)
    except jinja2.TemplateError as exc:
        raise TemplateError(f"chat template does not compile: {exc}") from exc


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    """A compiled chat template. Immutable and safe to render from many threads at once.

    Args:
        source: The Jinja source, e.g. the GGUF's ``tokenizer.chat_template``.
        bos_token: Text of the model's BOS token, as the template sees ``bos_token``.
        eos_token: Text of the model's EOS token, as the template sees ``eos_token``.
        max_render_seconds: Wall-clock budget of one :meth:`render`.
        max_output_chars: Largest output, and largest string or list built on the way.

    Raises:
        TemplateError: The source does not compile.
        InvalidParameterError: A budget is not positive.
    """

    source: str
    _: KW_ONLY
    bos_token: str = ""
    eos_token: str = ""
    max_render_seconds: float = 1.0
    max_output_chars: int = 4_000_000
    _compiled: jinja2.Template = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.source, str):
            raise InvalidParameterError(
                f"source must be a str, got {type(self.source).__name__}", param="source"
            )
        if not self.max_render_seconds > 0:
            raise InvalidParameterError(
                f"max_render_seconds must be > 0, got {self.max_render_seconds!r}",
                param="max_render_seconds",
            )
        if not (isinstance(self.max_output_chars, int) and self.max_output_chars > 0):
            raise InvalidParameterError(
                f"max_output_chars must be a positive int, got {self.max_output_chars!r}",
                param="max_output_chars",
            )
        object.__setattr__(self, "_compiled", _compile(self.source))

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render ``messages`` into the prompt text.

        Args:
            messages: OpenAI-style messages (see :func:`llamax.templates.validate_messages`).
            add_generation_prompt: End with the header that opens the assistant's turn.
            tools: Tool (function) schemas, for templates that support tool calling.
            **kwargs: Extra template variables (e.g. ``enable_thinking``, ``documents``);
                ``bos_token`` / ``eos_token`` here override the template's own.

        Returns:
            The prompt text. Special tokens appear as text; tokenize it with special tokens
            parsed and without adding BOS again if the template already wrote it.

        A template without a system role (gemma 2's raises on one; others drop it unread)
        gets a leading system message merged into the next message, ``system + "\n" +
        content``, as llama.cpp's server does (a lone system message is left out): so a
        system prompt, or the tool text llamax writes into one, reaches such a model. If
        the merged messages fail to render, they render as written (and fail as the
        template says).

        Raises:
            TemplateSecurityError: The template broke a sandbox rule.
            TemplateBudgetError: Rendering went over the time or size budget.
            TemplateError: The template called ``raise_exception`` or failed otherwise.
        """
        if messages and messages[0].get("role") == "system" and not supports_system_role(self):
            merged = merge_system_message(messages)
            try:
                return self._render(
                    merged, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs
                )
            except TemplateBudgetError:
                raise
            except TemplateError:  # the template wants its system turn after all: as written
                pass
        return self._render(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                            **kwargs)  # fmt: skip

    def _render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool,
        tools: Sequence[Mapping[str, Any]] | None,
        **kwargs: Any,
    ) -> str:
        """:meth:`render` as the template writes it (no system-role workaround)."""
        variables = {"bos_token": self.bos_token, "eos_token": self.eos_token, **kwargs}
        variables.update(
            messages=messages, add_generation_prompt=add_generation_prompt, tools=tools
        )
        budget = RenderBudget.start(self.max_render_seconds, self.max_output_chars)
        try:
            with active_budget(budget):
                return self._render_chunks(variables, budget)
        except TemplateError:
            raise
        except Exception as exc:  # the template is foreign code; any failure is its own
            raise _as_template_error(exc) from exc

    def _render_chunks(self, variables: dict[str, Any], budget: RenderBudget) -> str:
        """Render chunk by chunk, so the budget is checked while output accumulates."""
        chunks: list[str] = []
        num_chars = 0
        for chunk in self._compiled.generate(variables):
            num_chars += len(chunk)
            budget.check_size(num_chars, "output")
            budget.check_time()
            chunks.append(chunk)
        return "".join(chunks)


_PROBE_SYSTEM = "llamax_probe_system_text"


def supports_system_role(template: ChatTemplate) -> bool:
    """Whether ``template`` renders a leading system message's text (llama.cpp's
    ``supports_system_role``): it renders one without raising and the text appears.
    Cached per template; a probe over its render budget answers True this once (render
    as written) and is tried again next time."""
    try:
        return _probe_system_role(template)
    except TemplateBudgetError:
        return True


@functools.lru_cache(maxsize=16)
def _probe_system_role(template: ChatTemplate) -> bool:
    messages = [
        {"role": "system", "content": _PROBE_SYSTEM},
        {"role": "user", "content": "llamax_probe_user_text"},
    ]
    try:
        rendered = template._render(messages, add_generation_prompt=True, tools=None)
    except TemplateBudgetError:
        raise
    except TemplateError:
        return False
    return _PROBE_SYSTEM in rendered


def merge_system_message(messages: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """``messages`` with the leading system message merged into the next one (its text, a
    newline, then the next message's text: llama.cpp's ``system_message_not_supported``),
    or left out when nothing follows it. Text parts of either are joined as text; the next
    message's other parts (images) stay after the merged text."""
    system, rest = messages[0], list(messages[1:])
    if not rest:
        return rest
    text = _text_of(system.get("content"))
    head = dict(rest[0])
    content = head.get("content")
    if isinstance(content, list):
        head["content"] = [{"type": "text", "text": text + "\n"}, *content]
    else:
        head["content"] = text + "\n" + (_text_of(content) if content is not None else "")
    return [head, *rest[1:]]


def _text_of(content: Any) -> str:
    """A message's text: the string, or its text parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(part.get("text", "")) for part in content
            if isinstance(part, Mapping) and part.get("type") == "text"
        )  # fmt: skip
    return ""
