"""``PrefixAffinityRouter``: Ray Serve's custom request-router API, keyed by prompt prefix.

Ray 2.60 lets a deployment name its router class (``request_router_config``); every handle
to that deployment then routes through it. Ours ranks replicas on a consistent-hash ring by
the request's :func:`~llamax.ray.keys.routing_key`, so one system prompt keeps landing on the
replica whose prefix cache already holds it. Two fallbacks keep load in check:

- soft: when the owner's queue is ``imbalance_threshold`` requests longer than the
  shortest queue, the request goes to the least-loaded replica instead;
- hard: Ray skips a replica whose queue is full (``max_ongoing_requests``) and takes the
  next rank, i.e. the next replica on the ring.
"""

from __future__ import annotations

import logging
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from .keys import HashRing

__all__ = ["PrefixAffinityRouter"]

_log = logging.getLogger("ray.serve")


class PrefixAffinityRouter(RequestRouter):
    """Route each request to the replica that owns its routing key on a hash ring.

    Keyword arguments (``request_router_kwargs``):
        imbalance_threshold (int, default 4): queue difference (requests) above which the
            least-loaded replica wins over the key's owner.
        num_virtual_nodes (int, default 64): points per replica on the ring.
    """

    def initialize_state(self, **kwargs: Any) -> None:
        """Read the router's options (called by Ray once, with ``request_router_kwargs``).

        Raises:
            ValueError: an option is negative, or unknown.
        """
        unknown = set(kwargs) - {"imbalance_threshold", "num_virtual_nodes"}
        if unknown:
            raise ValueError(f"unknown PrefixAffinityRouter options: {sorted(unknown)}")
        self.imbalance_threshold = int(kwargs.get("imbalance_threshold", 4))
        if self.imbalance_threshold < 0:
            raise ValueError(f"imbalance_threshold must be >= 0, got {self.imbalance_threshold}")
        self.ring = HashRing(num_virtual_nodes=int(kwargs.get("num_virtual_nodes", 64)))

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Keep the ring's membership equal to the running replicas."""
        super().update_replicas(replicas)
        self._ring().set_members(r.replica_id.unique_id for r in replicas)

    def _ring(self) -> HashRing:
        if not hasattr(self, "ring"):  # Ray may call update_replicas before initialize_state
            self.initialize_state()
        return self.ring

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        """Rank the candidates for one request: the key's owner first, then the ring.

        Args:
            candidate_replicas: The replicas Ray may use now.
            pending_request: The request (its first argument is a ``ForwardedRequest``).

        Returns:
            Ranks of replicas, tried in order (Ray moves on when a rank's queues are full).
        """
        if not candidate_replicas:
            return []
        key = _key_of(pending_request)
        if key is None:
            return [candidate_replicas]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        ranked = [by_id[m] for m in self._ring().ranked(key) if m in by_id]
        ranked += [r for r in candidate_replicas if r not in ranked]
        loads = [self._load(r) for r in ranked]
        least = min(range(len(ranked)), key=loads.__getitem__)
        if loads[0] - loads[least] > self.imbalance_threshold:
            _log.info(
                "prefix owner %s has %d queued, %s has %d: routing to the latter",
                ranked[0].replica_id.unique_id, loads[0],
                ranked[least].replica_id.unique_id, loads[least],
            )  # fmt: skip
            ranked.insert(0, ranked.pop(least))
        return [[replica] for replica in ranked]

    def _load(self, replica: RunningReplica) -> int:
        """The replica's queue: the larger of Ray's live count of requests routed to it
        (``_replica_queue_len_cache``, refreshed as requests are routed; absent in other
        Ray versions) and its context's unsettled requests from its last routing stats."""
        cache = getattr(self, "_replica_queue_len_cache", None)
        routed = cache.get(replica.replica_id) if cache is not None else None
        unsettled = replica.routing_stats.get("num_unsettled", 0)
        return max(routed or 0, unsettled if isinstance(unsettled, int) else 0)


def _key_of(pending_request: PendingRequest | None) -> str | None:
    if pending_request is None or not pending_request.args:
        return None
    key = getattr(pending_request.args[0], "routing_key", None)
    return key if isinstance(key, str) else None
