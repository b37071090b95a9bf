"""``ContextStats``: one consistent snapshot of the engine's counters."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ContextStats"]


@dataclass(frozen=True, slots=True)
class ContextStats:
    """The engine's counters at one moment (see :meth:`llamax.Context.stats`).

    The loop publishes a snapshot after every step and every KV operation, so every field
    comes from the same moment and reading it from any thread never races the loop.
    """

    state: str
    """``running``, ``closing``, ``closed`` or ``failed``."""
    num_waiting: int
    """Sequences queued."""
    num_running: int
    """Sequences being computed."""
    num_retained: int
    """Finished sequences kept in KV for their prefix (evicted LRU, unhinted first)."""
    num_sessions: int
    """Open sessions (and chats), each pinning a sequence id."""
    num_unsettled: int
    """Requests submitted and not yet resolved (queued ones included)."""
    kv_cells_used: int
    """Distinct KV cells in use (shared prefixes count once)."""
    kv_cells_total: int
    """KV cells the context holds now: ``n_ctx``, or with ``kv_layout="auto"`` in streams,
    every stream's (each rounded up to 256 cells by llama.cpp, at most ``2 * n_ctx``)."""
    kv_cells_per_seq: int
    """The most cells (tokens) one sequence may hold (``n_ctx_seq``)."""
    kv_layout: str
    """The layout now: ``"unified"`` (one buffer all sequences share) or ``"streams"``
    (one per sequence). With ``kv_layout="auto"`` it moves between the two."""
    kv_bytes_total: int
    """Approximate memory of the whole KV cache (every cell, K and V, every layer)."""
    num_free_seq_ids: int
    """Sequence ids held by nothing."""
    num_steps: int
    """Decodes run."""
    num_prefill_tokens: int
    """Prompt tokens computed (prefix-cache hits are not computed)."""
    num_decode_tokens: int
    """Generated tokens computed."""
    num_cached_tokens: int
    """Prompt tokens served from the prefix cache instead of computed."""
    num_preemptions: int
    """Sequences preempted under KV pressure (recomputed later)."""
    num_evictions: int
    """Retained prefixes evicted to make room."""
    num_drafted_tokens: int = 0
    """Draft tokens verified by speculative decoding."""
    num_accepted_tokens: int = 0
    """Draft tokens accepted (each saved a step for its sequence)."""
    kv_cells_per_stream: int = 0
    """With ``kv_layout="auto"``: the cells one sequence holds in its own stream
    (``n_ctx // n_seq_max``); a longer one moves the cache to the unified layout. With a
    fixed layout, the cells one sequence may hold in it."""
    num_relayouts: int = 0
    """Moves between the two layouts (``kv_layout="auto"``)."""
    num_retained_hinted: int = 0
    """Of ``num_retained``, those whose last request asked for its prefix to be kept
    longer (``SamplingParams.keep_prefix``): evicted after the others."""
    prefix_ram_bytes: int = 0
    """Bytes of evicted prefixes' KV state held in host RAM (docs/prefix_ram.md)."""
    prefix_ram_budget_bytes: int = 0
    """The most bytes the RAM tier may hold (0: the tier is off)."""
    prefix_ram_entries: int = 0
    """Evicted prefixes held in host RAM."""
    prefix_ram_hinted_entries: int = 0
    """Of ``prefix_ram_entries``, those a hint asked to keep longer (dropped last)."""
    num_prefix_ram_stores: int = 0
    """Evicted prefixes stored in host RAM."""
    num_prefix_ram_hits: int = 0
    """Prompts whose longest prefix was in host RAM (a restore was tried)."""
    num_prefix_ram_restores: int = 0
    """Restores from host RAM that succeeded."""
    num_prefix_ram_refused: int = 0
    """Restores refused (the state did not load or did not match): recomputed instead."""
    num_prefix_ram_tokens: int = 0
    """Prompt tokens restored from host RAM (also counted in ``num_cached_tokens``)."""
    prefix_ram_restore_seconds: float = 0.0
    """Time spent restoring states from host RAM."""
    prefix_disk_bytes: int = 0
    """Bytes of files the disk tier below the RAM tier holds (docs/prefix_ram.md)."""
    prefix_disk_budget_bytes: int = 0
    """The disk tier's budget (0: no disk tier)."""
    prefix_disk_entries: int = 0
    """Evicted prefixes kept on disk."""
    prefix_disk_hinted_entries: int = 0
    """Of ``prefix_disk_entries``, those a hint asked to keep longer (deleted last)."""
    num_prefix_disk_stores: int = 0
    """Prefixes written to disk (dropped from RAM, or evicted with no RAM tier)."""
    num_prefix_disk_hits: int = 0
    """Prompts whose longest stored prefix was on disk (restores tried)."""
    num_prefix_disk_restores: int = 0
    """Prefixes restored from disk."""
    num_prefix_disk_refused: int = 0
    """Files that did not read back as written, or states refused: deleted, recomputed."""
    num_prefix_disk_tokens: int = 0
    """Prompt tokens restored from disk instead of computed."""
    prefix_disk_restore_seconds: float = 0.0
    """Time spent reading and restoring prefixes from disk."""
    num_checkpoints: int = 0
    """Checkpoints taken of a memory that cannot be cut (recurrent or hybrid models,
    docs/kv-cache.md): the prefix cache cuts and copies such sequences only at these."""
    num_checkpoint_restores: int = 0
    """Cuts and prefix copies that set a checkpoint back."""
    checkpoint_bytes: int = 0
    """Bytes the retained and running sequences' checkpoints hold."""
    n_threads: int = 0
    """CPU threads a step uses now (0: the backend has no say in it, e.g. a GPU-only one
    or a fake). Fewer than ``n_threads`` asked for while :attr:`is_contended`."""
    is_contended: bool = False
    """Whether steps ran many times slower than this machine's quiet ones (another process
    holds a core), so the engine computes with fewer threads (docs/performance.md)."""
    num_thread_changes: int = 0
    """Times the engine changed the thread count (down, back up, and probes)."""
