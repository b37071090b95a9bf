"""Images in HTTP request bodies, before a body reaches llamax: how many one request may
send, and remote image URLs (refused, or fetched when the operator allows it).

Where each API puts an image part, and the field that holds its source:

- OpenAI chat: ``messages[i].content[j]`` ``{"type": "image_url", "image_url": {"url"}}``;
- Anthropic Messages: ``messages[i].content[j]`` ``{"type": "image", "source": {...}}``,
  a ``base64`` source or a ``url`` one;
- Responses: ``input[i].content[j]`` ``{"type": "input_image", "image_url": "..."}``.

llamax itself takes images as base64 (``data:`` URLs, Anthropic's ``base64`` source).
A remote ``http(s)`` URL is a 400 naming its field unless :attr:`ImagePolicy.allow_urls`
(``--allow-image-urls``); then it is fetched (:mod:`llamax.server.image_fetch`: public
addresses only, within a size and a time limit, a bounded number at once), and only an
``image/*`` response is taken: the part is rewritten to carry the bytes as base64. This
runs where the body is parsed, in a worker thread, never on the event loop; reading and
checking the images themselves happens later, also in a worker, when the
request is rendered (:meth:`llamax.Context.chat_prompt_parts`).
"""

from __future__ import annotations

import base64
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass, field
from typing import Any, Literal

import llamax
from llamax.flags import byte_size, spec

from .errors import APIError
from .image_addresses import parse_networks
from .image_fetch import ImageFetcher, check_proxy

__all__ = [
    "DEFAULT_MAX_IMAGES",
    "DEFAULT_URL_BYTES",
    "DEFAULT_URL_FETCHES",
    "DEFAULT_URL_SECONDS",
    "ImageFetcher",
    "ImagePolicy",
    "count_images",
    "prepare_images",
]

DEFAULT_MAX_IMAGES = 16
"""Most images one request may send (``--max-images-per-request``)."""
DEFAULT_URL_BYTES = 10 << 20
"""Largest image fetched from a URL (llama-server's limit)."""
DEFAULT_URL_SECONDS = 10.0
"""Longest the fetches of one request's image URLs may take (llama-server's limit)."""
DEFAULT_URL_FETCHES = 4
"""Most requests whose image URLs are fetched at once (``--image-url-fetches``)."""

Api = Literal["openai", "anthropic", "responses"]


@dataclass(frozen=True, slots=True)
class ImagePolicy:
    """What the server lets a request do with images (``ServerConfig.images``); each field
    is also a flag of ``llamax serve`` (``--max-images-per-request`` ...).

    Raises:
        InvalidParameterError: a bad value (a ``ValueError``).
    """

    max_images: int = field(
        default=DEFAULT_MAX_IMAGES,
        metadata=spec(
            doc="most images one request may send; more get 400",
            flag=True,
            flag_name="--max-images-per-request",
            metavar="N",
        ),
    )
    allow_urls: bool = field(
        default=False,
        metadata=spec(
            doc="fetch remote `http(s)` image URLs in requests (from public addresses only, "
            "`image/*` only); off: such a URL is a 400 naming its field, only base64 images "
            "are read",
            default_doc="off",
            flag=True,
            flag_name="--allow-image-urls",
        ),
    )
    max_url_bytes: int = field(
        default=DEFAULT_URL_BYTES,
        metadata=spec(
            doc="with `allow_urls`, the largest image fetched, in bytes (flag: also `10M`)",
            default_doc="10 MiB",
            flag=True,
            flag_name="--image-url-max-bytes",
            flag_type=byte_size,
            metavar="BYTES",
        ),
    )
    url_seconds: float = field(
        default=DEFAULT_URL_SECONDS,
        metadata=spec(
            doc="with `allow_urls`, the longest the fetches of one request's image URLs may "
            "take, start to end (every read waits at most what is left)",
            flag=True,
            flag_name="--image-url-timeout",
            metavar="SECONDS",
        ),
    )
    max_url_fetches: int = field(
        default=DEFAULT_URL_FETCHES,
        metadata=spec(
            doc="with `allow_urls`, most requests fetching image URLs at once (1 to 32); more "
            "get 503, never queued",
            flag=True,
            flag_name="--image-url-fetches",
            metavar="N",
        ),
    )
    url_allow_networks: tuple[str, ...] = field(
        default=(),
        metadata=spec(
            doc="with `allow_urls`, networks (CIDR) also fetched from although private, "
            "loopback or link-local (intranet images; flag: repeatable)",
            default_doc="none: public addresses only",
            flag=True,
            flag_name="--image-url-allow-network",
            metavar="CIDR",
        ),
    )
    url_proxy: str | None = field(
        default=None,
        metadata=spec(
            doc="with `allow_urls`, an `http://host:port` proxy the fetches go through "
            "(`CONNECT`); proxy environment variables are ignored",
            default_doc="none",
            flag=True,
            flag_name="--image-url-proxy",
            metavar="URL",
        ),
    )

    def __post_init__(self) -> None:
        if self.max_images < 0:
            raise llamax.InvalidParameterError(
                f"max_images must be >= 0, got {self.max_images}", param="max_images"
            )
        if self.max_url_bytes < 1 or not self.url_seconds > 0:
            raise llamax.InvalidParameterError(
                "max_url_bytes and url_seconds must be positive", param="max_url_bytes"
            )
        if not 1 <= self.max_url_fetches <= 32:
            raise llamax.InvalidParameterError(
                f"max_url_fetches must be in [1, 32], got {self.max_url_fetches}",
                param="max_url_fetches",
            )
        networks = self.url_allow_networks
        object.__setattr__(self, "url_allow_networks", (networks,) if isinstance(networks, str)
                           else tuple(networks))  # fmt: skip
        parse_networks(self.url_allow_networks)  # raises ValueError for a bad one
        if self.url_proxy is not None:
            check_proxy(self.url_proxy)


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


def prepare_images(
    body: Any, api: Api, policy: ImagePolicy, fetcher: ImageFetcher | None = None
) -> None:
    """Count the image parts of a parsed body and fetch (or refuse) their remote URLs,
    rewriting fetched ones in place. Call it in a worker thread (it may fetch).

    Args:
        body: The chat ``messages`` list (OpenAI), or the whole body (Anthropic:
            ``messages``; Responses: ``input``).
        api: Which API's shapes ``body`` has.
        policy: The server's image settings.
        fetcher: The app's fetcher (it bounds the fetches at once); ``None``: one for this
            call alone.

    Raises:
        APIError: 400 for more than ``policy.max_images`` images, a remote URL when
            ``policy.allow_urls`` is off, or a URL that cannot be fetched, is too large or
            too slow, or is not an image; 503 when the fetcher is busy.
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
    remote = [(part, url) for part in parts if (url := part.url) is not None]
    if remote and not policy.allow_urls:
        where = remote[0][0].where
        raise APIError(
            400,
            f"{where}: remote image URLs are not fetched by this server (its operator can "
            "allow them with --allow-image-urls); send the image as base64 "
            "(a data:image/...;base64, URL)",
            param=where,
            code="image_url_not_allowed",
        )
    if not remote:
        return
    fetched = (fetcher or ImageFetcher(policy)).fetch_all([(u, p.where) for p, u in remote])
    for (part, _), (data, media_type) in zip(remote, fetched, strict=True):
        part.set_bytes(data, media_type)


def count_images(body: Any, api: Api) -> tuple[int, bool]:
    """How many image parts a parsed body holds, and whether one has a remote URL (as
    :func:`prepare_images` reads ``body``)."""
    parts = list(_image_parts(body, api))
    return len(parts), any(part.url is not None for part in parts)


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
