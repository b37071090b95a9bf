"""``llamax serve``: load a model and serve it with uvicorn until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
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
from .config import ServerConfig
from .models import DEFAULT_MAX_LOADED, ModelPool
from .shutdown import GracefulServer

__all__ = ["build_parser", "chat_page_url", "main", "server_config"]

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
    settings = p.add_argument_group(
        "server settings", "the fields of llamax.server.ServerConfig (docs/server.md)"
    )
    add_option_flags(settings, ServerConfig)
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


def server_config(ns: argparse.Namespace) -> ServerConfig:
    """The server settings ``llamax serve``'s flags give (:meth:`ServerConfig.from_flags`:
    the key from ``$LLAMAX_API_KEY`` when ``--api-key`` is not given), with ``--host``
    among the allowed hosts (a name it binds is one of the server's).

    Raises:
        InvalidParameterError: a bad setting (a ``ValueError``).
    """
    config = ServerConfig.from_flags(ns)
    return dataclasses.replace(config, allowed_hosts=(*config.allowed_hosts, ns.host))


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
        config = server_config(ns)  # checked before the model loads
        if config.slot_save_path is not None:
            os.makedirs(config.slot_save_path, exist_ok=True)
        models = _model_pool(ns, options)
        if models is not None:
            try:
                app = create_app(models, config)
            except BaseException:
                models.close()
                raise
            log.info("chat page: %s", chat_page_url(ns.host, ns.port))
            return _serve_pool(app, models, ns)
        with ThreadPoolExecutor(1, thread_name_prefix="llamax-load") as pool:
            loading = pool.submit(llamax.Context, ns.model, **options)
            app = create_app(loading, config)
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
