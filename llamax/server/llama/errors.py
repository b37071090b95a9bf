"""The errors llama-server's native routes answer with, in its body: ``{"error": {"code":
<status>, "message", "type"}}`` (:func:`~llamax.server.errors.llama_body`)."""

from __future__ import annotations

from starlette.responses import JSONResponse

from ..dialects import LLAMA
from ..errors import APIError, from_exception

__all__ = ["LlamaError", "as_llama_error", "llama_error_response"]


class LlamaError(APIError):
    """An error a native route answers with in llama-server's shape (its type comes from
    the status, as :func:`~llamax.server.errors.llama_body` maps it: ``not_supported_error``
    for 501, ``unavailable_error`` for 503 ...)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(status, message)


def llama_error_response(error: APIError) -> JSONResponse:
    """The HTTP response for ``error`` on a native route (:data:`~..dialects.LLAMA`'s)."""
    return LLAMA.error_response(error)


def as_llama_error(exc: BaseException, prompt_field: str = "prompt") -> APIError:
    """Any exception as the error a native route answers with (llamax's typed errors keep
    their 4xx status, see :func:`~llamax.server.errors.from_exception`)."""
    error = from_exception(exc, prompt_field=prompt_field)
    if error is not exc and error.__cause__ is None:
        error.__cause__ = exc
    return error
