"""``deployment(...)``: the Ray Serve application, from Python or from ``serve run``."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal

from ray import serve
from ray.serve import Application

from llamax import ContextOptions
from llamax.server import ServerConfig

from .deployment import LlamaxIngress, LlamaxReplica

__all__ = ["app", "deployment"]

ROUTER_CLASS = "llamax.ray.router.PrefixAffinityRouter"


def deployment(
    model_path: str | None = None,
    *,
    num_replicas: int = 2,
    num_cpus_per_replica: float = 1,
    num_gpus_per_replica: float = 0,
    context_options: ContextOptions | None = None,
    server_options: ServerConfig | Mapping[str, Any] | None = None,
    routing: Literal["prefix", "default"] = "prefix",
    imbalance_threshold: int = 4,
    max_ongoing_requests: int = 64,
    max_attempts: int = 2,
    name: str = "llamax",
) -> Application:
    """Build the llamax Serve application: an ingress plus ``num_replicas`` replicas.

    Each replica owns one ``llamax.Context`` (its own model copy and KV cache) and serves
    the routes of ``llamax serve``. Run the result with ``serve.run(app)``.

    Args:
        model_path: The GGUF each replica loads (a path valid on every node); ``None``:
            ``$LLAMAX_MODEL`` or the default model, resolved on each replica's node.
        num_replicas: Replicas (contexts) to run.
        num_cpus_per_replica: Ray CPUs reserved per replica; also the default
            ``n_threads`` of its context.
        num_gpus_per_replica: Ray GPUs per replica (0 on CPU-only clusters).
        context_options: ``llamax.Context`` keyword options for every replica.
        server_options: The replicas' server settings: a
            :class:`~llamax.server.ServerConfig`, or a mapping of its fields
            (``{"api_key": "...", "images": {"max_images": 4, "allow_urls": true}}`` from
            JSON or YAML; ``images`` may also be an :class:`~llamax.server.ImagePolicy`).
        routing: ``"prefix"`` (:class:`~llamax.ray.router.PrefixAffinityRouter`) or
            ``"default"`` (Ray's power-of-two-choices router).
        imbalance_threshold: Queue difference (requests) at which prefix routing gives way
            to the least-loaded replica.
        max_ongoing_requests: Requests one replica takes at once; more wait in Serve.
        max_attempts: Replicas the ingress tries per request when one fails before
            answering.
        name: Prefix of the two deployments' names.

    Returns:
        A bound ``ray.serve.Application``.

    Raises:
        ValueError: a count is out of range, ``routing`` is unknown, or a server setting
            is bad (checked here, before any replica starts).
        TypeError: an unknown server setting.
    """
    if routing not in ("prefix", "default"):
        raise ValueError(f"routing must be 'prefix' or 'default', got {routing!r}")
    for label, value in (("num_replicas", num_replicas), ("num_cpus_per_replica",
                         num_cpus_per_replica), ("max_ongoing_requests", max_ongoing_requests),
                         ("max_attempts", max_attempts)):  # fmt: skip
        if value <= 0:
            raise ValueError(f"{label} must be > 0, got {value}")
    options: dict[str, Any] = dict(context_options or {})
    options.setdefault("n_threads", max(1, int(num_cpus_per_replica)))
    router: dict[str, Any] = {
        "request_router_class": ROUTER_CLASS,
        "request_router_kwargs": {"imbalance_threshold": imbalance_threshold},
        "request_routing_stats_period_s": 0.5,
    }
    replica = serve.deployment(
        name=f"{name}-replica",
        num_replicas=num_replicas,
        ray_actor_options={"num_cpus": num_cpus_per_replica, "num_gpus": num_gpus_per_replica},
        max_ongoing_requests=max_ongoing_requests,
        health_check_period_s=2,
        request_router_config=router if routing == "prefix" else {},
    )(LlamaxReplica)
    ingress = serve.deployment(
        name=f"{name}-ingress",
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=max(1000, max_ongoing_requests * num_replicas),
    )(LlamaxIngress)
    bound: Application = ingress.bind(
        replica.bind(model_path, options, _server_config(server_options)),
        max_attempts=max_attempts,
    )
    return bound


def _server_config(given: ServerConfig | Mapping[str, Any] | None) -> ServerConfig:
    """``given`` as a :class:`~llamax.server.ServerConfig` (checked here, before any
    replica starts)."""
    return given if isinstance(given, ServerConfig) else ServerConfig.from_options(given or {})


_INT_ARGS = ("num_replicas", "imbalance_threshold", "max_ongoing_requests", "max_attempts")
_FLOAT_ARGS = ("num_cpus_per_replica", "num_gpus_per_replica")


def app(args: Mapping[str, Any]) -> Application:
    """The application builder for ``serve run llamax.ray:app key=value ...`` and YAML configs.

    Takes the keyword arguments of :func:`deployment`; values given as strings on the
    ``serve run`` command line are converted (``context_options`` as JSON).

    Args:
        args: The builder arguments (``args:`` of a Serve config, or ``key=value`` pairs).

    Returns:
        The application of :func:`deployment`.

    Raises:
        TypeError: an unknown argument.
    """
    kwargs = dict(args)
    for key in _INT_ARGS:
        if key in kwargs:
            kwargs[key] = int(kwargs[key])
    for key in _FLOAT_ARGS:
        if key in kwargs:
            kwargs[key] = float(kwargs[key])
    for key in ("context_options", "server_options"):
        if isinstance(kwargs.get(key), str):
            kwargs[key] = json.loads(kwargs[key])
    return deployment(**kwargs)
