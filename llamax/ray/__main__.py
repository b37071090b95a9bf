"""``python -m llamax.ray``: start (or join) a Ray cluster and serve llamax replicas on it."""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import threading
from typing import Any

import ray
from ray import serve

import llamax
from llamax.flags import add_option_flags, option_values
from llamax.server import ServerConfig

from .builder import deployment


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m llamax.ray``: its own flags, the options of
    ``llamax.ContextConfig`` and the settings of ``llamax.server.ServerConfig``."""
    parser = argparse.ArgumentParser(prog="python -m llamax.ray", description=__doc__)
    parser.add_argument("model", nargs="?", default=None, help="GGUF path valid on every node")
    parser.add_argument(
        "--address", default=None, help="Ray cluster to join ('auto': a running one)"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--cpus-per-replica", type=float, default=1)
    parser.add_argument("--gpus-per-replica", type=float, default=0)
    parser.add_argument("--routing", choices=["prefix", "default"], default="prefix")
    parser.add_argument(
        "--context-options",
        type=json.loads,
        default={},
        help="llamax.Context options (JSON); the flags below override them",
    )
    parser.add_argument(
        "--server-options",
        type=json.loads,
        default={},
        help='llamax.server.ServerConfig fields (JSON), e.g. \'{"api_key": "...", "images": '
        '{"max_images": 4, "allow_urls": true}}\'; the flags below override them',
    )
    add_option_flags(parser, llamax.ContextConfig)
    add_option_flags(parser.add_argument_group("server settings"), ServerConfig)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, deploy, and serve until interrupted.

    Args:
        argv: Arguments (default: ``sys.argv[1:]``).

    Returns:
        The exit status (argparse exits with 2 for bad arguments or server settings).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    context_options: Any = {**args.context_options, **option_values(args, llamax.ContextConfig)}
    try:  # checked before Ray starts
        server_config = ServerConfig.from_flags(args, args.server_options)
    except (TypeError, ValueError) as exc:
        parser.error(f"server settings: {exc}")  # exits with status 2
    ray.init(address=args.address, include_dashboard=False)
    serve.start(http_options={"host": args.host, "port": args.port})
    app = deployment(
        args.model,
        num_replicas=args.replicas,
        num_cpus_per_replica=args.cpus_per_replica,
        num_gpus_per_replica=args.gpus_per_replica,
        context_options=context_options,
        server_options=server_config,
        routing=args.routing,
    )
    serve.run(app, name="llamax", route_prefix="/")
    print(f"llamax on Ray Serve: http://{args.host}:{args.port}/v1 (Ctrl-C to stop)", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with contextlib.suppress(KeyboardInterrupt):
        stop.wait()
    serve.shutdown()  # type: ignore[no-untyped-call]
    ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
