"""OpenAI's error shape, and which HTTP status each failure gets.

Every error the server returns is ``{"error": {"message", "type", "param", "code"}}``, the
shape the ``openai`` client turns into its typed exceptions (``BadRequestError`` for 400,
``AuthenticationError`` for 401, ``InternalServerError`` for 500 ...).
"""

from __future__ import annotations

from collections.abc import Mapping

from starlette.requests import Request
from starlette.responses import JSONResponse

import llamax
from llamax import ImageError, InvalidMessageError, InvalidRequestError, TemplateError
from llamax.dialects.fields import FieldError
from llamax.dialects.wire import anthropic_error, llama_error, openai_error

__all__ = [
    "APIError",
    "anthropic_body",
    "anthropic_error_response",
    "error_response",
    "from_exception",
    "handle_api_error",
    "llama_body",
    "param_in",
]


class APIError(Exception):
    """An error the server answers with, in OpenAI's shape.

    Args:
        status: The HTTP status.
        message: What went wrong, for a human.
        param: The request field at fault, if one is.
        code: A machine-readable code (``"context_length_exceeded"`` ...).
        headers: Extra response headers (``Retry-After`` ...).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})
        self.details: dict[str, object] = {}
        """Extra fields llama-server's error shape carries (``n_prompt_tokens``, ``n_ctx``)."""

    def body(self) -> dict[str, dict[str, str | None]]:
        """The JSON body: ``{"error": {"message", "type", "param", "code"}}``."""
        return openai_error(self)


anthropic_body = anthropic_error
"""``error`` in Anthropic's shape (:func:`llamax.dialects.wire.anthropic_error`)."""
llama_body = llama_error
"""``error`` in llama-server's shape (:func:`llamax.dialects.wire.llama_error`)."""


def anthropic_error_response(error: APIError) -> JSONResponse:
    """The HTTP response for ``error`` on an Anthropic route."""
    return JSONResponse(anthropic_body(error), status_code=error.status, headers=error.headers)


def error_response(error: APIError) -> JSONResponse:
    """The HTTP response for ``error``."""
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


async def handle_api_error(request: Request, exc: Exception) -> JSONResponse:
    """Starlette exception handler for :class:`APIError`."""
    assert isinstance(exc, APIError)
    return error_response(exc)


def param_in(exc: InvalidRequestError, fields: frozenset[str]) -> str | None:
    """``exc.param`` when it is one of the request's ``fields`` or a path into one
    (``response_format.json_schema``, ``tools[0].function.name``), else ``None``: a name
    the library uses that this route's request does not (``texts`` on ``/v1/embeddings``)
    names nothing the client sent."""
    param = exc.param
    if param is None:
        return None
    head = param.split(".", 1)[0].split("[", 1)[0]
    return param if head in fields else None


_SCHEMA_FIELDS = ("response_format", "text", "output_config")
"""Where each API's requests give a JSON schema (OpenAI's chat and text, the Responses
API, Anthropic's Messages): what ``json_schema`` was built from."""


def _grammar_field(exc: InvalidRequestError, fields: frozenset[str]) -> str | None:
    """The field a :class:`~llamax.GrammarError` is about, in the route's spelling: its
    ``param`` (``grammar``, ``json_schema``, ``tools``) when the route has that field, else,
    for a schema, the field this API gives schemas in."""
    given = param_in(exc, fields)
    if given is None and exc.param == "json_schema":
        return next((name for name in _SCHEMA_FIELDS if name in fields), None)
    return given


def from_exception(
    exc: BaseException, fields: frozenset[str] = frozenset(), prompt_field: str = "messages"
) -> APIError:
    """Map an exception from llamax (or anything else) onto an :class:`APIError`.

    Args:
        exc: What was raised while serving the request.
        fields: The request's field names: the error's ``param`` is answered when it is
            one of them (or a path into one), see :func:`param_in`.
        prompt_field: The field holding the prompt (``messages`` or ``prompt``).

    Returns:
        400 for a request llamax refused (context overflow with its token counts, bad
        messages, grammars, parameters), 404 for an id that names nothing stored, 503
        when the context is closed or out of sequences or cells for now, 500 otherwise.
    """
    if isinstance(exc, APIError):
        return exc
    message = str(exc)
    if isinstance(exc, FieldError):  # a body's field: unknown, missing, mistyped, refused
        return APIError(400, message, param=exc.param, code=exc.code)
    if isinstance(exc, llamax.ContextLengthError):
        error = APIError(400, message, param=prompt_field, code="context_length_exceeded")
        error.details = {"n_prompt_tokens": exc.num_prompt_tokens, "n_ctx": exc.n_ctx}
        return error
    if isinstance(exc, InvalidMessageError):  # the conversation: messages, or input
        return APIError(400, message, param=prompt_field, code="invalid_message")
    if isinstance(exc, ImageError):  # not an image, damaged, too large, no projector
        return APIError(400, message, param=prompt_field, code="invalid_image")
    if isinstance(exc, llamax.EmptyPromptError):
        return APIError(400, message, param=prompt_field, code="empty_prompt")
    if isinstance(exc, llamax.GrammarError):
        return APIError(400, message, param=_grammar_field(exc, fields), code="invalid_grammar")
    if isinstance(exc, TemplateError):
        return APIError(400, f"chat template: {message}", param="messages", code="template_error")
    if isinstance(exc, llamax.NotFoundError):
        return APIError(404, message, param=param_in(exc, fields), code="not_found")
    if isinstance(exc, llamax.InvalidRequestError):
        return APIError(400, message, param=param_in(exc, fields), code="invalid_value")
    if isinstance(exc, llamax.ContextClosedError):
        return APIError(503, f"the model is not available: {message}", code="model_unavailable")
    if isinstance(exc, llamax.CacheClearError):
        return APIError(500, message, code="cache_clear_failed")
    if isinstance(exc, (llamax.KVCapacityError, llamax.SessionError)):  # busy: try again
        return APIError(503, f"the server is at capacity: {message}", code="capacity_exceeded")
    if isinstance(exc, (llamax.EngineError, llamax.RequestFailedError)):
        return APIError(500, f"inference failed: {message}", code="engine_error")
    return APIError(500, f"internal error: {type(exc).__name__}", code="internal_error")
