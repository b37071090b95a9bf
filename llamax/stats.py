"""``ContextStats``: one consistent snapshot of the engine's counters, in groups.

Each group is a frozen dataclass one engine component builds from its own counters (the
scheduler its :class:`SequenceStats`, the KV layout its :class:`KVStats`, each prefix tier its
:class:`PrefixTierStats` ...); :class:`ContextStats` holds them side by side, with no field
copied by hand. A field that is exported to Prometheus says so in its metadata
(:func:`stat`: the metric's name, help text and kind), and the server's collectors are
generated from that (:func:`stat_fields`), so a new counter is one field. The same metadata
names each field's flat alias (``stats.kv_cells_used`` for ``stats.kv.cells_used``, the
names from before the groups): read-only properties generated on :class:`ContextStats`.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from typing import Any, Literal

__all__ = [
    "CheckpointStats",
    "ContextStats",
    "KVStats",
    "MetricSpec",
    "PrefixCacheStats",
    "PrefixTierStats",
    "SequenceStats",
    "SpeculationStats",
    "StatField",
    "StatSpec",
    "ThreadStats",
    "counter",
    "gauge",
    "regenerate",
    "stat",
    "stat_fields",
    "stats_table",
]

KEY = "llamax.stat"
"""The metadata key of a field's :class:`StatSpec`."""


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """The Prometheus metric a stats field is exported as."""

    name: str
    """The metric's name (``llamax_kv_cells_used``; a counter's samples add ``_total``)."""
    help: str
    """Its help text."""
    kind: Literal["gauge", "counter"]
    """``gauge`` (a level now) or ``counter`` (a total since the context started)."""


def gauge(name: str, help: str) -> MetricSpec:
    """A gauge's :class:`MetricSpec`."""
    return MetricSpec(name, help, "gauge")


def counter(name: str, help: str) -> MetricSpec:
    """A counter's :class:`MetricSpec`."""
    return MetricSpec(name, help, "counter")


@dataclass(frozen=True, slots=True)
class StatSpec:
    """What a stats field declares beside its value: its flat alias and its metric."""

    flat: str | None = None
    """The field's name on :class:`ContextStats` itself, where ``{group}`` stands for the
    group's name there (``"{group}_bytes"``: ``prefix_ram_bytes``); None: no alias."""
    metric: MetricSpec | Mapping[str, MetricSpec] | None = None
    """Its Prometheus metric, or one per group name for a group :class:`ContextStats` holds
    more than once (the prefix tiers); None: not exported."""


def stat(
    flat: str | None = None,
    metric: MetricSpec | None = None,
    *,
    default: object = 0,
    **by_group: MetricSpec,
) -> Any:
    """A group's dataclass field (default ``default``) whose metadata holds a
    :class:`StatSpec`: ``cells_used: int = stat("kv_cells_used", gauge("llamax_kv_cells_used",
    "KV cells in use"))``; a group held more than once names a metric per group name
    (``prefix_ram=gauge(...), prefix_disk=gauge(...)``)."""
    return field(default=default, metadata={KEY: StatSpec(flat, metric or by_group or None)})


@dataclass(frozen=True, slots=True)
class SequenceStats:
    """The scheduler's sequences and the tokens it computed for them."""

    num_waiting: int = stat(
        "num_waiting", gauge("llamax_queue_waiting_sequences", "Sequences queued")
    )
    """Sequences queued."""
    num_running: int = stat(
        "num_running", gauge("llamax_running_sequences", "Sequences being computed")
    )
    """Sequences being computed."""
    num_preemptions: int = stat(
        "num_preemptions", counter("llamax_engine_preemptions", "Sequences preempted")
    )
    """Sequences preempted under KV pressure (recomputed later)."""
    num_prefill_tokens: int = stat(
        "num_prefill_tokens", counter("llamax_engine_prefill_tokens", "Prompt tokens computed")
    )
    """Prompt tokens computed (prefix-cache hits are not computed)."""
    num_decode_tokens: int = stat(
        "num_decode_tokens", counter("llamax_engine_decode_tokens", "Generated tokens computed")
    )
    """Generated tokens computed."""
    num_cached_tokens: int = stat("num_cached_tokens")
    """Prompt tokens served from the prefix cache instead of computed."""


@dataclass(frozen=True, slots=True)
class KVStats:
    """The KV cache: its cells, its layout and its sequence ids."""

    cells_used: int = stat("kv_cells_used", gauge("llamax_kv_cells_used", "KV cells in use"))
    """Distinct KV cells in use (shared prefixes count once)."""
    cells_total: int = stat(
        "kv_cells_total", gauge("llamax_kv_cells_total", "KV cells in the context")
    )
    """KV cells the context holds now: ``n_ctx``, or with ``kv_layout="auto"`` in streams,
    every stream's (each rounded up to 256 cells by llama.cpp, at most ``2 * n_ctx``)."""
    cells_per_seq: int = stat("kv_cells_per_seq")
    """The most cells (tokens) one sequence may hold (``n_ctx_seq``)."""
    cells_per_stream: int = stat("kv_cells_per_stream")
    """With ``kv_layout="auto"``: the cells one sequence holds in its own stream
    (``n_ctx // n_seq_max``); a longer one moves the cache to the unified layout. With a
    fixed layout, the cells one sequence may hold in it."""
    layout: str = stat("kv_layout", default="unified")
    """The layout now: ``"unified"`` (one buffer all sequences share) or ``"streams"``
    (one per sequence). With ``kv_layout="auto"`` it moves between the two."""
    bytes_total: int = stat("kv_bytes_total")
    """Approximate memory of the whole KV cache (every cell, K and V, every layer)."""
    num_free_seq_ids: int = stat("num_free_seq_ids")
    """Sequence ids held by nothing."""
    num_relayouts: int = stat(
        "num_relayouts", counter("llamax_kv_relayouts", "Moves between KV layouts")
    )
    """Moves between the two layouts (``kv_layout="auto"``)."""


@dataclass(frozen=True, slots=True)
class PrefixCacheStats:
    """The prefix cache in KV: finished sequences kept for their prefix."""

    num_retained: int = stat(
        "num_retained",
        gauge("llamax_retained_sequences", "Finished sequences kept for their prefix"),
    )
    """Finished sequences kept in KV for their prefix (evicted LRU, unhinted first)."""
    num_hinted: int = stat(
        "num_retained_hinted",
        gauge("llamax_retained_hinted_sequences", "Of those, kept longer by a hint"),
    )
    """Of :attr:`num_retained`, those whose last request asked for its prefix to be kept
    longer (``SamplingParams.keep_prefix``): evicted after the others."""
    num_evictions: int = stat("num_evictions")
    """Retained prefixes evicted to make room."""


@dataclass(frozen=True, slots=True)
class PrefixTierStats:
    """One tier of evicted prefixes' states below KV (``prefix_ram``: host RAM;
    ``prefix_disk``: files, see docs/prefix_ram.md): its size and counters."""

    num_bytes: int = stat(
        "{group}_bytes",
        prefix_ram=gauge("llamax_prefix_ram_bytes", "Bytes of evicted prefixes kept in host RAM"),
        prefix_disk=gauge("llamax_prefix_disk_bytes", "Bytes of evicted prefixes kept on disk"),
    )
    """Bytes of state held."""
    budget_bytes: int = stat(
        "{group}_budget_bytes",
        prefix_ram=gauge("llamax_prefix_ram_budget_bytes", "The host-RAM prefix tier's budget"),
        prefix_disk=gauge("llamax_prefix_disk_budget_bytes", "The disk prefix tier's budget"),
    )
    """The most bytes held (0: the tier is off)."""
    num_entries: int = stat(
        "{group}_entries",
        prefix_ram=gauge("llamax_prefix_ram_entries", "Evicted prefixes kept in host RAM"),
        prefix_disk=gauge("llamax_prefix_disk_entries", "Evicted prefixes kept on disk"),
    )
    """Entries (evicted prefixes) held."""
    num_hinted: int = stat(
        "{group}_hinted_entries",
        prefix_ram=gauge("llamax_prefix_ram_hinted_entries", "Of those, kept longer by a hint"),
        prefix_disk=gauge("llamax_prefix_disk_hinted_entries", "Of those, kept longer by a hint"),
    )
    """Of :attr:`num_entries`, those a hint asked to keep longer
    (``SamplingParams.keep_prefix``): dropped last."""
    num_stored: int = stat(
        "num_{group}_stores",
        prefix_disk=counter("llamax_prefix_disk_stores", "Prefixes written to disk"),
    )
    """States stored (on disk: dropped from RAM, or evicted with no RAM tier)."""
    num_dropped: int = 0
    """Entries dropped to stay within the budget."""
    num_store_failures: int = 0
    """Stores that failed (the entry is lost)."""
    num_hits: int = stat(
        "num_{group}_hits",
        prefix_ram=counter(
            "llamax_prefix_ram_hits", "Prompts whose longest prefix was in host RAM"
        ),
        prefix_disk=counter("llamax_prefix_disk_hits", "Prompts whose longest prefix was on disk"),
    )
    """Prompts that found a longer prefix here than above (restores tried)."""
    num_restores: int = stat(
        "num_{group}_restores",
        prefix_ram=counter("llamax_prefix_ram_restores", "Prefixes restored from host RAM"),
        prefix_disk=counter("llamax_prefix_disk_restores", "Prefixes restored from disk"),
    )
    """Restores that succeeded."""
    num_refused: int = stat(
        "num_{group}_refused",
        prefix_ram=counter(
            "llamax_prefix_ram_refused", "Restores from host RAM refused (recomputed)"
        ),
        prefix_disk=counter(
            "llamax_prefix_disk_refused", "Files or states from disk refused (recomputed)"
        ),
    )
    """Entries that did not read back, or states the memory refused: recomputed."""
    num_restored_tokens: int = stat(
        "num_{group}_tokens",
        prefix_ram=counter(
            "llamax_prefix_ram_restored_tokens", "Prompt tokens restored from host RAM"
        ),
        prefix_disk=counter(
            "llamax_prefix_disk_restored_tokens", "Prompt tokens restored from disk"
        ),
    )
    """Prompt tokens restored instead of computed (also counted in
    :attr:`SequenceStats.num_cached_tokens`)."""
    restore_seconds: float = stat(
        "{group}_restore_seconds",
        prefix_ram=counter(
            "llamax_prefix_ram_restore_seconds", "Time spent restoring prefixes from host RAM"
        ),
        prefix_disk=counter(
            "llamax_prefix_disk_restore_seconds", "Time spent restoring prefixes from disk"
        ),
    )
    """Time spent reading and restoring (successful or not)."""

    def counted(self, **deltas: float) -> PrefixTierStats:
        """These stats with ``deltas`` added to the counters they name (a tier keeps its
        counts in a :class:`PrefixTierStats` and reports it with its sizes)."""
        return dataclasses.replace(
            self, **{name: getattr(self, name) + delta for name, delta in deltas.items()}
        )

    def with_restore(self, num_tokens: int, seconds: float) -> PrefixTierStats:
        """These stats after a restore gave ``num_tokens`` prompt tokens (0: none) in
        ``seconds``."""
        if not num_tokens:
            return self.counted(restore_seconds=seconds)
        return self.counted(restore_seconds=seconds, num_restores=1, num_restored_tokens=num_tokens)


@dataclass(frozen=True, slots=True)
class CheckpointStats:
    """Checkpoints of a memory that cannot be cut (recurrent or hybrid models,
    docs/kv-cache.md): the prefix cache cuts and copies such sequences only at these."""

    num_taken: int = stat(
        "num_checkpoints",
        counter("llamax_checkpoints", "Checkpoints taken (recurrent or hybrid memory)"),
    )
    """Checkpoints taken."""
    num_restores: int = stat(
        "num_checkpoint_restores",
        counter("llamax_checkpoint_restores", "Cuts and copies at a checkpoint"),
    )
    """Cuts and prefix copies that set a checkpoint back."""
    num_bytes: int = stat(
        "checkpoint_bytes",
        gauge("llamax_checkpoint_bytes", "Bytes of recurrent-state checkpoints held"),
    )
    """Bytes the retained and running sequences' checkpoints hold."""


@dataclass(frozen=True, slots=True)
class ThreadStats:
    """The CPU threads a step computes with, under contention (docs/performance.md)."""

    n_threads: int = stat("n_threads", gauge("llamax_threads", "CPU threads a step uses now"))
    """CPU threads a step uses now (0: the backend has no say in it, e.g. a GPU-only one
    or a fake). Fewer than ``n_threads`` asked for while :attr:`is_contended`."""
    is_contended: bool = stat(
        "is_contended",
        gauge("llamax_contended", "1 while other processes hold cores and fewer threads are used"),
        default=False,
    )
    """Whether steps ran many times slower than this machine's quiet ones (another process
    holds a core), so the engine computes with fewer threads."""
    num_changes: int = stat(
        "num_thread_changes",
        counter("llamax_thread_changes", "Changes of the thread count (contention)"),
    )
    """Times the engine changed the thread count (down, back up, and probes)."""


@dataclass(frozen=True, slots=True)
class SpeculationStats:
    """Speculative decoding's drafts (docs/speculative.md)."""

    num_drafted_tokens: int = stat("num_drafted_tokens")
    """Draft tokens verified by speculative decoding."""
    num_accepted_tokens: int = stat("num_accepted_tokens")
    """Draft tokens accepted (each saved a step for its sequence)."""


@dataclass(frozen=True, slots=True)
class ContextStats:
    """The engine's counters at one moment (see :meth:`llamax.Context.stats`), in groups.

    The loop publishes a snapshot after every step and every KV operation, so every field
    comes from the same moment and reading it from any thread never races the loop.

    Each group's fields are also readable under their flat names from before the groups
    (``stats.kv_cells_used`` is ``stats.kv.cells_used``, ``stats.num_prefix_ram_hits`` is
    ``stats.prefix_ram.num_hits``): read-only convenience aliases, listed with
    :func:`stat_fields` and returned all at once by :meth:`flat`.
    """

    state: str = field(metadata={KEY: StatSpec("state")})
    """``running``, ``closing``, ``closed`` or ``failed``."""
    num_unsettled: int = field(metadata={KEY: StatSpec("num_unsettled")})
    """Requests submitted and not yet resolved (queued ones included)."""
    num_sessions: int = field(metadata={KEY: StatSpec("num_sessions")})
    """Open sessions (and chats), each pinning a sequence id."""
    num_steps: int = field(
        metadata={KEY: StatSpec("num_steps", counter("llamax_engine_steps", "Decodes run"))}
    )
    """Decodes run."""
    sequences: SequenceStats
    """Sequences queued and running, and the tokens computed."""
    kv: KVStats
    """The KV cache's cells, layout and sequence ids."""
    prefix: PrefixCacheStats
    """Finished sequences retained in KV for their prefix."""
    prefix_ram: PrefixTierStats
    """The host-RAM tier of evicted prefixes (docs/prefix_ram.md; all 0 when off)."""
    prefix_disk: PrefixTierStats
    """The disk tier below the RAM tier (all 0 when there is none)."""
    checkpoints: CheckpointStats
    """Checkpoints of recurrent or hybrid memory."""
    threads: ThreadStats
    """The thread count under contention."""
    speculation: SpeculationStats
    """Speculative decoding's drafts."""

    def flat(self) -> dict[str, Any]:
        """Every flat alias with its value (``{"state": ..., "kv_cells_used": ...}``): the
        shape from before the groups, for logs and Ray's routing stats. For the nested
        shape, use ``dataclasses.asdict``."""
        return {f.flat: f.value(self) for f in stat_fields() if f.flat is not None}


@dataclass(frozen=True, slots=True)
class StatField:
    """One value of :class:`ContextStats` with what its field declares."""

    path: tuple[str, ...]
    """Where it is read: ``("kv", "cells_used")``, or ``("num_steps",)`` at the top."""
    flat: str | None
    """Its flat alias on :class:`ContextStats` (``"kv_cells_used"``), if any."""
    metric: MetricSpec | None
    """The Prometheus metric it is exported as, if any."""

    def value(self, stats: ContextStats) -> Any:
        """Its value in ``stats``."""
        found: Any = stats
        for name in self.path:
            found = getattr(found, name)
        return found


@cache
def stat_fields() -> tuple[StatField, ...]:
    """Every value of :class:`ContextStats` with what its field declares (its flat alias,
    its metric), in field order, groups' fields in place of their group."""
    found: list[StatField] = []
    hints = typing.get_type_hints(ContextStats)
    for top in dataclasses.fields(ContextStats):
        kind = hints[top.name]
        if dataclasses.is_dataclass(kind):
            found += (_field(top.name, inner) for inner in dataclasses.fields(kind))
        else:
            found.append(_field("", top))
    return tuple(found)


def _field(group: str, spec_of: dataclasses.Field[Any]) -> StatField:
    spec = spec_of.metadata.get(KEY, StatSpec())
    metric = spec.metric.get(group) if isinstance(spec.metric, Mapping) else spec.metric
    flat = spec.flat.format(group=group) if spec.flat is not None else None
    path = (group, spec_of.name) if group else (spec_of.name,)
    return StatField(path, flat, metric)


def stats_table(kind: Literal["values", "metrics"]) -> str:
    """A Markdown table of :class:`ContextStats`, from its fields' metadata: ``values``,
    every value with its flat alias and metric; ``metrics``, the exported ones with their
    type and help text (a counter's samples add ``_total`` to its name)."""
    if kind == "values":
        rows = ["| value | flat alias | metric |", "| --- | --- | --- |"]
        for f in stat_fields():
            flat = f"`{f.flat}`" if f.flat is not None else ""
            metric = f"`{_exposed(f.metric)}`" if f.metric is not None else ""
            rows.append(f"| `{'.'.join(f.path)}` | {flat} | {metric} |")
    else:
        rows = ["| metric | type | what | value |", "| --- | --- | --- | --- |"]
        for f in stat_fields():
            if (m := f.metric) is not None:
                rows.append(f"| `{_exposed(m)}` | {m.kind} | {m.help} | `{'.'.join(f.path)}` |")
    return "\n".join(rows) + "\n"


def _exposed(metric: MetricSpec) -> str:
    return metric.name + ("_total" if metric.kind == "counter" else "")


_BLOCK = re.compile(
    r"(<!-- stats: (?P<kind>values|metrics) -->\n)(?P<body>.*?)(<!-- /stats -->)", re.S
)
"""A generated block of the docs: ``<!-- stats: values -->``, the table, ``<!-- /stats -->``."""


def regenerate(text: str) -> str:
    """Markdown ``text`` with every generated stats block replaced by its current table."""

    def table(m: re.Match[str]) -> str:
        kind: Literal["values", "metrics"] = "values" if m["kind"] == "values" else "metrics"
        return m[1] + stats_table(kind) + m[4]

    return _BLOCK.sub(table, text)


def _add_aliases() -> None:
    """Give :class:`ContextStats` a read-only property per group field's flat alias."""
    for found in stat_fields():
        if found.flat is None or len(found.path) == 1:
            continue
        setattr(ContextStats, found.flat, _alias(*found.path))


def _alias(group: str, name: str) -> property:
    def read(self: ContextStats) -> Any:
        return getattr(getattr(self, group), name)

    return property(read, doc=f"Alias of ``{group}.{name}``.")


_add_aliases()
