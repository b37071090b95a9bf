"""Images in HTTP request bodies, before a body reaches llamax: how many one request may
send, and remote image URLs (refused, or fetched when the operator allows it).

Where each API puts an image part, and the field that holds its source:

- OpenAI chat: ``messages[i].content[j]`` ``{"type": "image_url", "image_url": {"url"}}``;
- Anthropic Messages: ``messages[i].content[j]`` ``{"type": "image", "source": {...}}``,
  a ``base64`` source or a ``url`` one;
- Responses: ``input[i].content[j]`` ``{"type": "input_image", "image_url": "..."}``.

llamax itself takes images as base64 (``data:`` URLs, Anthropic's ``base64`` source).
A remote ``http(s)`` URL is a 400 naming its field unless :attr:`ImagePolicy.allow_urls`
(``--allow-image-urls``); then it is fetched here, within a size and a time limit, and
only an ``image/*`` response is taken: the part is rewritten to carry the bytes as
base64. This runs where the body is parsed, in a worker thread, never on the event loop;
reading and checking the images themselves happens later, also in a worker, when the
request is rendered (:meth:`llamax.Context.chat_prompt_parts`).
"""

from __future__ import annotations

import base64
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass
from typing import Any, Literal

import llamax

from .errors import APIError

__all__ = [
    "DEFAULT_MAX_IMAGES",
    "DEFAULT_URL_BYTES",
    "DEFAULT_URL_SECONDS",
    "ImagePolicy",
    "prepare_images",
]

DEFAULT_MAX_IMAGES = 16
"""Most images one request may send (``--max-images-per-request``)."""
DEFAULT_URL_BYTES = 10 << 20
"""Largest image fetched from a URL (llama-server's limit)."""
DEFAULT_URL_SECONDS = 10.0
"""Longest a fetch of an image URL may take (llama-server's limit)."""

Api = Literal["openai", "anthropic", "responses"]


@dataclass(frozen=True, slots=True)
class ImagePolicy:
    """What the server lets a request do with images."""

    max_images: int = DEFAULT_MAX_IMAGES
    """Most image parts one request may hold (more: 400)."""
    allow_urls: bool = False
    """Fetch remote ``http(s)`` image URLs (off: 400 naming the field)."""
    max_url_bytes: int = DEFAULT_URL_BYTES
    """Largest body a fetched URL may have."""
    url_seconds: float = DEFAULT_URL_SECONDS
    """Longest a fetch may take, start to end."""

    def __post_init__(self) -> None:
        if self.max_images < 0:
            raise ValueError(f"max_images must be >= 0, got {self.max_images}")
        if self.max_url_bytes < 1 or not self.url_seconds > 0:
            raise ValueError("max_url_bytes and url_seconds must be positive")


@dataclass(slots=True)
class _Part:
    """One image part of a body, and how to read and rewrite its source."""

    where: str
    """The field holding its source (``messages[0].content[1].image_url.url``)."""
    holder: MutableMapping[str, Any]
    key: str
    api: Api

    @property
    def url(self) -> str | None:
        """Its remote URL, if it has one."""
        value = self.holder.get(self.key)
        if self.api == "anthropic":
            is_url = isinstance(value, MutableMapping) and value.get("type") == "url"
            value = value.get("url") if is_url else None  # type: ignore[union-attr]
        if isinstance(value, str) and value.startswith(("http://", "https://")):
            return value
        return None

    def set_bytes(self, data: bytes, media_type: str) -> None:
        """Carry ``data`` as base64 instead of the URL."""
        encoded = base64.b64encode(data).decode("ascii")
        if self.api == "anthropic":
            self.holder[self.key] = {"type": "base64", "media_type": media_type, "data": encoded}
        else:
            self.holder[self.key] = f"data:{media_type};base64,{encoded}"


def prepare_images(body: Any, api: Api, policy: ImagePolicy) -> None:
    """Count the image parts of a parsed body and fetch (or refuse) their remote URLs,
    rewriting fetched ones in place. Call it in a worker thread (it may fetch).

    Args:
        body: The chat ``messages`` list (OpenAI), or the whole body (Anthropic:
            ``messages``; Responses: ``input``).
        api: Which API's shapes ``body`` has.
        policy: The server's image settings.

    Raises:
        APIError: 400 for more than ``policy.max_images`` images, a remote URL when
            ``policy.allow_urls`` is off, or a URL that cannot be fetched, is too large or
            too slow, or is not an image.
    """
    parts = list(_image_parts(body, api))
    if len(parts) > policy.max_images:
        raise APIError(
            400,
            f"the request holds {len(parts)} images; at most {policy.max_images} are allowed "
            "per request (--max-images-per-request)",
            param="input" if api == "responses" else "messages",
            code="too_many_images",
        )
    for part in parts:
        url = part.url
        if url is None:
            continue
        if not policy.allow_urls:
            raise APIError(
                400,
                f"{part.where}: remote image URLs are not fetched by this server (its operator "
                "can allow them with --allow-image-urls); send the image as base64 "
                "(a data:image/...;base64, URL)",
                param=part.where,
                code="image_url_not_allowed",
            )
        part.set_bytes(*fetch_image(url, part.where, policy))


def _image_parts(body: Any, api: Api) -> Iterator[_Part]:
    """The image parts of a body, in order, each with the field that holds its source."""
    if api == "openai":
        field, items, kind, key = "messages", body, "image_url", "url"
    elif api == "anthropic":
        field, items, kind, key = "messages", _get(body, "messages"), "image", "source"
    else:
        field, items, kind, key = "input", _get(body, "input"), "input_image", "image_url"
    for i, item in enumerate(items if isinstance(items, list) else []):
        content = item.get("content") if isinstance(item, MutableMapping) else None
        for j, part in enumerate(content if isinstance(content, list) else []):
            if not isinstance(part, MutableMapping) or part.get("type") != kind:
                continue
            where = f"{field}[{i}].content[{j}]"
            if api == "openai":
                spec = part.get("image_url")
                if isinstance(spec, MutableMapping):
                    yield _Part(f"{where}.image_url.url", spec, key, api)
                else:  # malformed: llamax says why, this only counts it
                    yield _Part(where, {}, key, api)
            else:
                yield _Part(f"{where}.{key}", part, key, api)


def _get(body: Any, name: str) -> Any:
    return body.get(name) if isinstance(body, MutableMapping) else None


def fetch_image(url: str, where: str, policy: ImagePolicy) -> tuple[bytes, str]:
    """Fetch an image URL within the policy's size and time limits: its bytes and media
    type. Blocking: call it in a worker thread. The time limit is checked between reads,
    and each read waits at most that long, so a fetch ends within twice the limit.

    Raises:
        APIError: 400 when the fetch fails, times out, is too large or is not an image.
    """
    deadline = time.monotonic() + policy.url_seconds

    def failed(problem: str) -> APIError:
        return APIError(400, f"{where}: the image at {url} {problem}", param=where,
                        code="image_url_failed")  # fmt: skip

    request = urllib.request.Request(url, headers={"User-Agent": f"llamax/{llamax.__version__}"})
    try:
        with _opener().open(request, timeout=policy.url_seconds) as response:
            media_type = response.headers.get_content_type()
            if not media_type.startswith("image/"):
                raise failed(f"is {media_type}, not an image")
            declared = response.headers.get("Content-Length")
            if declared is not None and declared.isdigit() and int(declared) > policy.max_url_bytes:
                raise failed(f"is larger than {policy.max_url_bytes} bytes")
            data = bytearray()
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise failed(f"took longer than {policy.url_seconds:g} s to fetch")
                chunk = response.read(65536)
                if not chunk:
                    return bytes(data), media_type
                data += chunk
                if len(data) > policy.max_url_bytes:
                    raise failed(f"is larger than {policy.max_url_bytes} bytes")
    except APIError:
        raise
    except urllib.error.HTTPError as exc:
        raise failed(f"could not be fetched (HTTP {exc.code})") from None
    except TimeoutError:
        raise failed(f"took longer than {policy.url_seconds:g} s to fetch") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise failed(f"could not be fetched ({reason})") from None


class _HttpRedirectsOnly(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only to another ``http(s)`` URL (urllib's own also goes to
    ``ftp:``)."""

    def redirect_request(
        self, req: Any, fp: Any, code: int, msg: str, headers: Any, newurl: str
    ) -> urllib.request.Request | None:
        if not newurl.startswith(("http://", "https://")):
            return None  # the redirect's own status is then the error
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _opener() -> urllib.request.OpenerDirector:
    """urllib's opener for ``http(s)`` alone: no ``file:``, ``ftp:`` or ``data:`` handler."""
    opener = urllib.request.OpenerDirector()
    for handler in (
        urllib.request.ProxyHandler(),
        urllib.request.HTTPHandler(),
        urllib.request.HTTPSHandler(),
        _HttpRedirectsOnly(),
        urllib.request.HTTPDefaultErrorHandler(),
        urllib.request.HTTPErrorProcessor(),
    ):
        opener.add_handler(handler)
    return opener
