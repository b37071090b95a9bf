"""``ContextStats`` in groups, each built by its engine component, on the fake backend; the
flat names from before the groups stay readable as aliases, and the stats serialise."""

from __future__ import annotations

import dataclasses
import json

import pytest

import llamax
from llamax.stats import (
    ContextStats,
    KVStats,
    PrefixTierStats,
    SequenceStats,
    SpeculationStats,
    ThreadStats,
    stat_fields,
)
from llamax.testing import FakeBackend, assert_idle

GREEDY = llamax.SamplingParams(max_tokens=4, temperature=0)
MB = 1 << 20

# every field of ContextStats before it nested: each is still readable under this name
FLAT_NAMES = {
    "state", "num_waiting", "num_running", "num_retained", "num_sessions", "num_unsettled",
    "kv_cells_used", "kv_cells_total", "kv_cells_per_seq", "kv_layout", "kv_bytes_total",
    "num_free_seq_ids", "num_steps", "num_prefill_tokens", "num_decode_tokens",
    "num_cached_tokens", "num_preemptions", "num_evictions", "num_drafted_tokens",
    "num_accepted_tokens", "kv_cells_per_stream", "num_relayouts", "num_retained_hinted",
    "prefix_ram_bytes", "prefix_ram_budget_bytes", "prefix_ram_entries",
    "prefix_ram_hinted_entries", "num_prefix_ram_stores", "num_prefix_ram_hits",
    "num_prefix_ram_restores", "num_prefix_ram_refused", "num_prefix_ram_tokens",
    "prefix_ram_restore_seconds", "prefix_disk_bytes", "prefix_disk_budget_bytes",
    "prefix_disk_entries", "prefix_disk_hinted_entries", "num_prefix_disk_stores",
    "num_prefix_disk_hits", "num_prefix_disk_restores", "num_prefix_disk_refused",
    "num_prefix_disk_tokens", "prefix_disk_restore_seconds", "num_checkpoints",
    "num_checkpoint_restores", "checkpoint_bytes", "n_threads", "is_contended",
    "num_thread_changes",
}  # fmt: skip


def system(i: int) -> str:
    """A ~60-token prompt (one fake token per byte) sharing no first token with another's."""
    return f"{chr(65 + i)}: " + " ".join(f"rule {i}.{k} holds" for k in range(5)) + "\n"


def complete(ctx: llamax.Context, prompt: str) -> None:
    handle = ctx.add_request(prompt, GREEDY)
    while ctx.has_work():
        ctx.process()
    handle.result(0)


@pytest.fixture
def ran() -> tuple[llamax.Context, FakeBackend]:
    """A context with one sequence id and a RAM tier, after three prompts: the second
    evicted the first to RAM, the third restored it."""
    backend = FakeBackend(n_ctx=512, n_seq_max=1)
    ctx = llamax.Context(backend=backend, autostart=False, prefix_ram_bytes=MB)
    for prompt in (system(0) + "A?", system(1) + "B?", system(0) + "C?"):
        complete(ctx, prompt)
    yield ctx, backend
    assert_idle(ctx)
    ctx.close()


def test_each_group_is_its_components_snapshot(ran: tuple[llamax.Context, FakeBackend]) -> None:
    ctx, backend = ran
    stats = ctx.stats()
    assert (stats.state, stats.num_unsettled, stats.num_sessions) == ("running", 0, 0)
    assert stats.num_steps > 0
    queue = stats.sequences
    assert isinstance(queue, SequenceStats)
    assert (queue.num_waiting, queue.num_running, queue.num_preemptions) == (0, 0, 0)
    # each request's last sampled token is never computed: 3 decodes for 4 tokens
    assert queue.num_prefill_tokens > 0 and queue.num_decode_tokens == 3 * 3
    assert queue.num_cached_tokens == len(system(0))  # the restore from RAM
    kv = stats.kv
    assert isinstance(kv, KVStats)
    assert kv.cells_total == backend.kv_cells and kv.cells_per_seq == backend.facts.n_ctx_seq
    assert kv.bytes_total == backend.kv_cells * backend.kv_bytes_per_cell
    assert 0 < kv.cells_used <= kv.cells_total
    assert (kv.layout, kv.num_free_seq_ids, kv.num_relayouts) == ("unified", 0, 0)
    assert (stats.prefix.num_retained, stats.prefix.num_evictions) == (1, 2)
    ram = stats.prefix_ram
    assert isinstance(ram, PrefixTierStats)
    assert (ram.num_stored, ram.num_hits, ram.num_restores, ram.num_entries) == (2, 1, 1, 1)
    assert ram.num_restored_tokens == len(system(0)) and ram.restore_seconds > 0
    assert 0 < ram.num_bytes <= ram.budget_bytes == MB
    assert stats.prefix_disk == PrefixTierStats()  # no disk tier: all 0
    assert stats.checkpoints.num_taken == 0  # the fake's memory can be cut anywhere
    assert stats.threads == ThreadStats(n_threads=backend.n_threads)  # never contended
    assert stats.speculation == SpeculationStats()


def test_every_flat_name_reads_its_group(ran: tuple[llamax.Context, FakeBackend]) -> None:
    ctx, _ = ran
    stats = ctx.stats()
    aliases = {f.flat: f for f in stat_fields() if f.flat is not None}
    assert set(aliases) == FLAT_NAMES
    for name, found in aliases.items():
        assert getattr(stats, name) == found.value(stats), name
    assert stats.kv_cells_used == stats.kv.cells_used
    assert stats.num_prefix_ram_hits == stats.prefix_ram.num_hits == 1
    assert stats.num_retained_hinted is stats.prefix.num_hinted
    assert stats.flat() == {name: getattr(stats, name) for name in FLAT_NAMES}
    # read-only (Python 3.11's frozen slots dataclasses raise TypeError for a name that is
    # not a field, later ones FrozenInstanceError)
    with pytest.raises((AttributeError, TypeError)):
        stats.kv_cells_used = 0  # type: ignore[attr-defined]
    assert ContextStats.kv_cells_used.__doc__ == "Alias of ``kv.cells_used``."  # type: ignore[attr-defined]


def test_stats_serialise_nested_and_flat(ran: tuple[llamax.Context, FakeBackend]) -> None:
    ctx, _ = ran
    stats = ctx.stats()
    nested = dataclasses.asdict(stats)
    assert nested["kv"]["cells_used"] == stats.kv.cells_used
    assert nested["prefix_ram"]["num_restores"] == 1
    assert json.loads(json.dumps(nested)) == nested
    assert json.loads(json.dumps(stats.flat()))["kv_layout"] == "unified"
    replaced = dataclasses.replace(stats, num_unsettled=3)
    assert replaced.num_unsettled == 3 and replaced.kv is stats.kv


def test_ray_routing_stats_stay_flat(ran: tuple[llamax.Context, FakeBackend]) -> None:
    pytest.importorskip("ray")
    from llamax.ray.deployment import replica_summary

    ctx, _ = ran
    summary = replica_summary(ctx.stats())
    assert set(summary) == FLAT_NAMES | {"cached_token_fraction", "kv_used_fraction"}
    assert summary["num_unsettled"] == 0 and 0 < summary["kv_used_fraction"] <= 1
