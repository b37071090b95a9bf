"""Tool (function) calling for chat: OpenAI's ``tools`` on any chat model.

Pure Python, below the facade: it renders through a :class:`PromptRenderer` (a context,
or the template binding a context hands down), never a context's internals. The pieces, in
the order a chat completion uses them:

1. :func:`prepare_tools` checks ``tools`` / ``tool_choice`` / ``parallel_tool_calls``
   into a :class:`ToolPlan`;
2. :func:`tool_prompt_tokens` renders the conversation (the model's own template when it
   supports tools, else the fallback that lists the tools in the system turn);
3. :func:`tool_call_grammar` builds the GBNF grammar that keeps every call valid;
4. :func:`parse_tool_calls` (whole replies) or :class:`ToolCallStreamParser` (streams)
   turn the generated text into OpenAI ``tool_calls``.

See docs/tools.md.
"""

from .call_grammar import CALL_CLOSE, CALL_OPEN, MAX_PARALLEL_CALLS, tool_call_grammar
from .parse import (
    ParsedReply,
    ToolCall,
    ToolCallDelta,
    ToolCallStreamParser,
    ToolDelta,
    new_call_id,
    parse_tool_calls,
)
from .prompt import (
    PromptRenderer,
    fallback_messages,
    native_messages,
    render_tool_prompt,
    template_supports_tools,
    tool_prompt_tokens,
    tool_system_text,
)
from .spec import ToolChoiceMode, ToolFunction, ToolPlan, prepare_tools

__all__ = [
    "CALL_CLOSE",
    "CALL_OPEN",
    "MAX_PARALLEL_CALLS",
    "ParsedReply",
    "PromptRenderer",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallStreamParser",
    "ToolChoiceMode",
    "ToolDelta",
    "ToolFunction",
    "ToolPlan",
    "fallback_messages",
    "native_messages",
    "new_call_id",
    "parse_tool_calls",
    "prepare_tools",
    "render_tool_prompt",
    "template_supports_tools",
    "tool_call_grammar",
    "tool_prompt_tokens",
    "tool_system_text",
]
