"""``llamax serve``: load a model and serve it with uvicorn until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import uvicorn

import llamax
from llamax.flags import add_option_flags, option_values

from .app import create_app
from .fairness import DEFAULT_MAX_SEQUENCES
from .images import (
    DEFAULT_MAX_IMAGES,
    DEFAULT_URL_BYTES,
    DEFAULT_URL_FETCHES,
    DEFAULT_URL_SECONDS,
    ImagePolicy,
)
from .models import DEFAULT_MAX_LOADED, ModelPool
from .shutdown import GracefulServer

__all__ = ["build_parser", "chat_page_url", "main"]

log = logging.getLogger("llamax.server")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``llamax serve``."""
    p = argparse.ArgumentParser(
        prog="llamax serve",
        description="Serve a GGUF model over an OpenAI-compatible HTTP API, with a chat page at /.",
    )
    p.add_argument("model", nargs="?", help="GGUF file (default: $LLAMAX_MODEL, else SmolLM2)")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default: 8000)")
    add_option_flags(p, llamax.ContextConfig)
    p.add_argument(
        "--api-key",
        default=os.environ.get("LLAMAX_API_KEY") or None,
        help="require 'Authorization: Bearer KEY' (default: $LLAMAX_API_KEY)",
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=256,
        help="most requests in flight, tokenize and embeddings included; more get 503 "
        "(default: 256)",
    )
    p.add_argument(
        "--max-sequences-per-request",
        type=int,
        default=DEFAULT_MAX_SEQUENCES,
        metavar="N",
        help="most sequences one request may queue (its prompts x n or n_cmpl); more get "
        f"400 (default: {DEFAULT_MAX_SEQUENCES})",
    )
    p.add_argument(
        "--parse-special-in-content",
        action="store_true",
        help="let special-token text in chat message content act as special tokens, as "
        "llama-server does (unsafe: a user can forge turns and roles; default: plain text)",
    )
    p.add_argument(
        "--lenient",
        action="store_true",
        help="drop and log request fields in neither the OpenAI nor the Anthropic reference "
        "instead of answering 400 (default: strict, so a typo is not silently ignored)",
    )
    p.add_argument(
        "--keep-billing-header",
        action="store_true",
        help="render Claude Code's per-request 'x-anthropic-billing-header:' system block on "
        "/v1/messages (default: left out, as it changes every request and defeats the "
        "prefix cache)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=8 << 20,
        help="largest request body; larger get 413 (default: 8 MiB)",
    )
    p.add_argument(
        "--max-stored-responses",
        type=int,
        default=1024,
        help="most responses /v1/responses keeps for previous_response_id (default: 1024)",
    )
    p.add_argument(
        "--cors-origin",
        action="append",
        default=None,
        metavar="ORIGIN",
        help="allow this origin by CORS on every route (repeatable; '*' for any; default: "
        "llama-server's own routes answer any origin, the others none)",
    )
    p.add_argument(
        "--no-native-cors",
        dest="native_cors",
        action="store_false",
        help="without --cors-origin, CORS is off on llama-server's own routes too",
    )
    p.add_argument(
        "--allowed-hosts",
        metavar="HOSTS",
        default=None,
        help="comma-separated Host names answered beside localhost names, IP literals, this "
        "machine's name and --host ('*.example.com' for a domain; '*': any); other Hosts get "
        "403, which stops DNS rebinding (default: none more)",
    )
    p.add_argument(
        "--slot-save-path",
        metavar="DIR",
        default=None,
        help="folder for llama-server's POST /slots/ID?action=save|restore (created if "
        "missing; default: those actions are refused with 501)",
    )
    p.add_argument(
        "--slot-idle-seconds",
        type=float,
        metavar="S",
        default=300.0,
        help="close a slot (id_slot) whose session has run nothing for S seconds "
        "(default 300; an idle slot yields its sequence to other requests before then)",
    )
    p.add_argument(
        "-n",
        "--n-predict",
        type=int,
        default=None,
        metavar="N",
        help="reply length of a request that sets none, on every API (llama-server's -n; "
        "a request may ask for more; default, or -1: each API's own)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seed of a request that sets none (llama-server's --seed; default, or -1: random)",
    )
    p.add_argument(
        "--alias",
        default=None,
        metavar="NAME",
        help="serve the model under this name in /v1/models, /props and responses "
        "(llama-server's --alias; default: the GGUF's name)",
    )
    _add_image_flags(p)
    p.add_argument(
        "--shutdown-timeout",
        type=int,
        default=30,
        help="seconds to let requests finish after SIGTERM (default: 30)",
    )
    _add_model_flags(p)
    p.add_argument(
        "--lora",
        action="append",
        type=_name_path,
        default=[],
        metavar="NAME=PATH",
        help="load a LoRA adapter GGUF under NAME (repeatable); a request picks it with "
        '"lora": [{"name": NAME, "scale": 1.0}]',
    )
    p.add_argument(
        "--http",
        default="h11",
        choices=["h11", "httptools"],
        help="uvicorn's HTTP implementation: h11 sends header names as llamax spells them "
        "(llama-server's Access-Control-Allow-Origin ..., which some of its clients look up "
        "case-sensitively); httptools parses faster but sends every header name in lower "
        "case (default: h11)",
    )
    p.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    return p


def _add_image_flags(p: argparse.ArgumentParser) -> None:
    """The flags of images in requests (docs/images.md)."""
    p.add_argument(
        "--max-images-per-request",
        type=int,
        default=DEFAULT_MAX_IMAGES,
        metavar="N",
        help=f"most images one request may send; more get 400 (default: {DEFAULT_MAX_IMAGES})",
    )
    p.add_argument(
        "--allow-image-urls",
        action="store_true",
        help="fetch remote http(s) image URLs in requests (default: refused with 400; only "
        "base64 images are read)",
    )
    p.add_argument(
        "--image-url-max-bytes",
        type=int,
        default=DEFAULT_URL_BYTES,
        metavar="BYTES",
        help="with --allow-image-urls, the largest image fetched (default: 10 MiB)",
    )
    p.add_argument(
        "--image-url-timeout",
        type=float,
        default=DEFAULT_URL_SECONDS,
        metavar="SECONDS",
        help=f"with --allow-image-urls, the longest the fetches of one request may take "
        f"(default: {DEFAULT_URL_SECONDS:g})",
    )
    p.add_argument(
        "--image-url-fetches",
        type=int,
        default=DEFAULT_URL_FETCHES,
        metavar="N",
        help="with --allow-image-urls, most requests fetching image URLs at once; more get "
        f"503 (default: {DEFAULT_URL_FETCHES})",
    )
    p.add_argument(
        "--image-url-allow-network",
        action="append",
        default=[],
        metavar="CIDR",
        help="with --allow-image-urls, also fetch from this private, loopback or link-local "
        "network (repeatable; default: public addresses only)",
    )
    p.add_argument(
        "--image-url-proxy",
        metavar="URL",
        help="with --allow-image-urls, fetch through this http://host:port proxy (CONNECT); "
        "default: none (proxy environment variables are ignored)",
    )


def _allowed_hosts(ns: argparse.Namespace) -> list[str]:
    """``--allowed-hosts``' names, and ``--host`` (a name it binds is one of the server's)."""
    given = [name.strip() for name in (ns.allowed_hosts or "").split(",") if name.strip()]
    return [*given, ns.host]


def _name_path(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    return name, path


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    """The flags of several models behind one server (docs/models.md)."""
    p.add_argument(
        "--model",
        dest="models",
        action="append",
        type=_name_path,
        metavar="NAME=PATH",
        help="serve this GGUF under NAME (repeatable; requests pick one by their 'model')",
    )
    p.add_argument(
        "--models-dir", metavar="DIR", help="serve every *.gguf in DIR, named by file stem"
    )
    p.add_argument(
        "--models-max",
        type=int,
        metavar="K",
        help="most models loaded at once; to load another, the least recently used idle "
        "one is unloaded, or the least recently used busy one drained (default: no bound; "
        f"with --models-dir: {DEFAULT_MAX_LOADED}, fewer if the largest model does not fit "
        "that often in half the available memory)",
    )
    p.add_argument(
        "--models-wait",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="longest a request waits for its model to load (and for room to load it); "
        "then 503 + Retry-After (default: 60)",
    )
    p.add_argument(
        "--idle-unload",
        type=float,
        metavar="SECONDS",
        help="unload a model no request has used for this long (default: never)",
    )


def _model_pool(ns: argparse.Namespace, options: dict[str, Any]) -> ModelPool | None:
    """The pool the flags ask for, or ``None`` for the single-model form.

    Raises:
        ValueError: a path as well as ``--model``/``--models-dir``, a name given twice, no
            model in the directory, or a bad bound.
    """
    if not ns.models and ns.models_dir is None:
        if ns.models_max is not None or ns.idle_unload is not None:
            raise ValueError("--models-max and --idle-unload need --model or --models-dir")
        return None
    if not ns.models_wait > 0:
        raise ValueError(f"--models-wait must be > 0, got {ns.models_wait}")
    if ns.model is not None:
        raise ValueError("give a MODEL path, or --model/--models-dir, not both")
    paths: dict[str, str | os.PathLike[str]] = {}
    if ns.models_dir is not None:
        paths |= {p.stem: p for p in sorted(Path(ns.models_dir).glob("*.gguf"))}
        if not paths:
            raise ValueError(f"no .gguf file in {ns.models_dir!r}")
    for name, path in ns.models or []:
        if name in paths:
            raise ValueError(f"model name {name!r} is given twice")
        paths[name] = path
    max_loaded = ns.models_max
    if max_loaded is None and ns.models_dir is not None:
        max_loaded = ModelPool.default_max_loaded(paths.values())
        log.info("at most %d models loaded at once (--models-max to change)", max_loaded)
    return ModelPool(paths, max_loaded=max_loaded, idle_unload_seconds=ns.idle_unload,
                     max_wait_seconds=ns.models_wait, **options)  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``llamax serve`` with ``argv`` (default: ``sys.argv[1:]``; a leading ``serve`` is
    skipped, so the ``llamax`` command can pass its arguments through).

    The server listens at once; ``/health`` says ``loading`` until the model is ready.
    With ``--model NAME=PATH`` or ``--models-dir`` it serves several models, each loaded
    when a request first names it (docs/models.md). On
    SIGINT or SIGTERM it stops accepting connections, lets requests in flight finish for
    ``--shutdown-timeout`` seconds, cuts the rest (an open stream gets its API's error
    event, then its end; :mod:`.shutdown`), then closes the context. A second Ctrl-C cuts
    them at once.

    Returns:
        The exit status: 0 after a shutdown, 130 after a forced one (a second Ctrl-C), 1 if
        the model did not load, 2 for bad arguments.
    """
    args = list(argv) if argv is not None else None
    if args and args[0] == "serve":
        args = args[1:]
    try:
        ns = build_parser().parse_args(args)
    except SystemExit as exc:  # --help, or bad arguments (argparse printed why)
        return exc.code if isinstance(exc.code, int) else 2
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    log.setLevel(ns.log_level.upper())
    try:
        options = option_values(ns, llamax.ContextConfig)
        if ns.lora:
            names = [name for name, _ in ns.lora]
            if len(set(names)) != len(names):
                raise ValueError(f"--lora names must differ, got {names}")
            options["lora"] = dict(ns.lora)
        app_options = {
            "api_key": ns.api_key,
            "max_queue": ns.max_queue,
            "max_sequences": ns.max_sequences_per_request,
            "max_body_bytes": ns.max_body_bytes,
            "cors_origins": ns.cors_origin,
            "native_cors": ns.native_cors,
            "parse_special_in_content": ns.parse_special_in_content,
            "max_stored_responses": ns.max_stored_responses,
            "slot_save_path": ns.slot_save_path,
            "slot_idle_seconds": ns.slot_idle_seconds,
            "lenient": ns.lenient,
            "keep_billing_header": ns.keep_billing_header,
            "default_max_tokens": None if ns.n_predict in (None, -1) else ns.n_predict,
            "default_seed": None if ns.seed in (None, -1) else ns.seed,
            "model_alias": ns.alias,
            "allowed_hosts": _allowed_hosts(ns),
            "images": ImagePolicy(
                max_images=ns.max_images_per_request,
                allow_urls=ns.allow_image_urls,
                max_url_bytes=ns.image_url_max_bytes,
                url_seconds=ns.image_url_timeout,
                max_url_fetches=ns.image_url_fetches,
                url_allow_networks=tuple(ns.image_url_allow_network),
                url_proxy=ns.image_url_proxy,
            ),
        }
        if ns.slot_save_path is not None:
            os.makedirs(ns.slot_save_path, exist_ok=True)
        models = _model_pool(ns, options)
        if models is not None:
            try:
                app = create_app(models, **app_options)
            except BaseException:
                models.close()
                raise
            log.info("chat page: %s", chat_page_url(ns.host, ns.port))
            return _serve_pool(app, models, ns)
        with ThreadPoolExecutor(1, thread_name_prefix="llamax-load") as pool:
            loading = pool.submit(llamax.Context, ns.model, **options)
            app = create_app(loading, **app_options)
            log.info("chat page: %s", chat_page_url(ns.host, ns.port))
            return _serve(app, loading, ns)
    except (OSError, ValueError) as exc:
        log.error("%s", exc)
        return 2


def chat_page_url(host: str, port: int) -> str:
    """The chat page's address for a server bound to ``host:port``: a wildcard address
    (``0.0.0.0``, ``::``, all interfaces) is reached at ``localhost`` from this machine."""
    if host in ("", "0.0.0.0", "::"):
        host = "localhost"
    elif ":" in host and not host.startswith("["):
        host = f"[{host}]"  # an IPv6 literal
    return f"http://{host}:{port}/"


_FORCED_EXIT = 130
"""The exit status after a second Ctrl-C, as a shell reports a process ended by SIGINT."""


def _serve(app: Any, loading: Future[llamax.Context], ns: argparse.Namespace) -> int:
    config = uvicorn.Config(
        app,
        host=ns.host,
        port=ns.port,
        log_level=ns.log_level,
        timeout_graceful_shutdown=ns.shutdown_timeout,
        http=ns.http,
    )
    server = GracefulServer(config)

    def stop_if_failed(future: Future[llamax.Context]) -> None:
        if future.exception() is not None:
            log.error("the model did not load: %s", future.exception())
            server.should_exit = True

    loading.add_done_callback(stop_if_failed)
    with _signals_after_shutdown_ignored():
        try:
            server.run()
        finally:
            if loading.exception() is None:
                log.info("closing the model")
                loading.result().close(timeout=ns.shutdown_timeout)
    if loading.exception() is not None:
        return 1
    return _FORCED_EXIT if server.force_exit else 0


def _serve_pool(app: Any, models: ModelPool, ns: argparse.Namespace) -> int:
    """Serve a pool (its models load on demand) until a signal; then close every model."""
    config = uvicorn.Config(
        app,
        host=ns.host,
        port=ns.port,
        log_level=ns.log_level,
        timeout_graceful_shutdown=ns.shutdown_timeout,
        http=ns.http,
    )
    log.info("serving models: %s", ", ".join(models.names))
    server = GracefulServer(config)
    with _signals_after_shutdown_ignored():
        try:
            server.run()
        finally:
            log.info("closing the models")
            models.close(timeout=ns.shutdown_timeout)
    return _FORCED_EXIT if server.force_exit else 0


@contextlib.contextmanager
def _signals_after_shutdown_ignored() -> Iterator[None]:
    """uvicorn re-raises the SIGINT/SIGTERM it handled once it has stopped, which would kill
    the process before the model is closed; while serving, ignore that second delivery."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
