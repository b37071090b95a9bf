"""``llamax[ray]``: llamax replicas on Ray Serve behind a prefix-aware router.

>>> import ray, llamax.ray                                      # doctest: +SKIP
>>> from ray import serve                                       # doctest: +SKIP
>>> serve.run(llamax.ray.deployment(num_replicas=2))            # doctest: +SKIP

From a shell: ``serve run llamax.ray:app num_replicas=2`` or ``serve run
examples/ray_serve.yaml``, or ``python -m llamax.ray``. Needs the extra:
``pip install '.[ray]'`` in a llamax clone. See docs/scale-out.md.
"""

try:
    from .builder import app, deployment
    from .deployment import LlamaxIngress, LlamaxReplica, replica_summary
    from .keys import HashRing, routing_key
    from .router import PrefixAffinityRouter
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    raise ImportError(
        f"llamax.ray needs its extra: pip install '.[ray]' in a llamax clone ({exc})"
    ) from exc

__all__ = [
    "HashRing",
    "LlamaxIngress",
    "LlamaxReplica",
    "PrefixAffinityRouter",
    "app",
    "deployment",
    "replica_summary",
    "routing_key",
]
