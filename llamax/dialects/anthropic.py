# ruff: noqa: E501  (the tables hold one-line docs)
"""Anthropic's request fields: the ``POST /v1/messages`` :data:`~llamax.dialects.fields.FieldTable`
(the mechanism is :mod:`llamax.dialects.fields`) and the check of its ``cache_control``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..chat.options import check_text, one_of
from ..errors import InvalidParameterError
from .fields import RequestField, Support, check_object, table

__all__ = ["MESSAGES", "check_cache_control"]

H, HINT, R = Support.HONOURED, Support.HINT, Support.REFUSED


def check_cache_control(name: str, value: Any) -> bool:
    """Whether ``value``, a ``cache_control`` (of the request, a block or a tool), asks for
    the prompt to be kept: ``{"type": "ephemeral"}`` (with a ``ttl``) does, null does not.

    Raises:
        InvalidParameterError: any other value.
    """
    if value is None:
        return False
    if not isinstance(value, Mapping) or value.get("type") != "ephemeral":
        raise InvalidParameterError(
            f'{name} must be {{"type": "ephemeral"}} (with a ttl)', param=name
        )
    return True


def _metadata(name: str, value: Any) -> None:
    check_object(name, value)
    for key, item in (value or {}).items():
        if key != "user_id":
            raise InvalidParameterError(f"{name} has unknown field {key!r}", param=name)
        check_text(f"{name}.user_id", item)


MESSAGES = table(
    "model",
    RequestField(
        "messages",
        H,
        "`text`, `tool_use`, `tool_result`, `thinking` and text `document` blocks (docs/anthropic.md)",
    ),
    RequestField("max_tokens", H, "most tokens to generate (required)"),
    RequestField("system", H, "a string or text blocks"),
    RequestField("temperature", H, "in [0, 1]"),
    "top_p",
    RequestField("top_k", H, "top-k sampling"),
    RequestField("stop_sequences", H, "stop strings (`stop_reason: stop_sequence`)"),
    RequestField(
        "tools", H, "custom tools (`input_schema`); server tools such as `web_search` are refused"
    ),
    RequestField("tool_choice", H, "`auto`, `any`, `tool`, `none`; `disable_parallel_tool_use`"),
    RequestField(
        "thinking",
        H,
        "`enabled` and `adaptive` turn the template's thinking switch on, `disabled` off; `budget_tokens` is not enforced",
    ),
    RequestField(
        "output_config",
        H,
        "`format` (`json_schema`) constrains the text by a grammar; `effort` has no effect",
    ),
    RequestField(
        "metadata", HINT, "no effect: not stored (an object; `user_id` a string)", _metadata
    ),
    "stream",
    RequestField(
        "cache_control",
        H,
        "a hint, as on a system block, a message's content block or a tool: the prompt's prefix is kept longer than unhinted ones in KV and the RAM and disk tiers (`SamplingParams.keep_prefix`); every shared prefix is reused with or without it",
    ),
    RequestField(
        "service_tier",
        HINT,
        "no effect: one local server has one tier",
        one_of("auto", "standard_only"),
    ),
    RequestField(
        "inference_geo", HINT, "no effect: the model runs where the server runs", check_text
    ),
    RequestField("speed", HINT, "no effect: there is one speed", one_of("standard", "fast")),
    RequestField(
        "diagnostics", HINT, "no effect: no cache-miss diagnostics are returned", check_object
    ),
    RequestField("user_profile_id", HINT, "no effect: requests are not attributed", check_text),
    RequestField("container", R, "code-execution containers are not supported"),
    RequestField("context_management", R, "server-side context editing is not supported"),
    RequestField(
        "mcp_servers", R, "MCP servers are not run by llamax (run the tools on the client)"
    ),
)
"""The ``POST /v1/messages`` fields."""
