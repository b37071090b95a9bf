"""The engine's Prometheus metrics are pinned: every name, type and help text, and the
stats field each one reads (``ctx.stats().<name>``), as exported before the stats nested.
The pool's per-model collector and the server's registry export the same engine metrics."""

from __future__ import annotations

import inspect
from pathlib import Path

import llamax
from llamax.server import metrics as metrics_module
from llamax.server.metrics import ServerMetrics, engine_metrics
from llamax.stats import regenerate, stat_fields
from llamax.testing import FakeBackend

# (metric, type, help, the flat ContextStats attribute it reads)
ENGINE_METRICS = [
    ("llamax_queue_waiting_sequences", "gauge", "Sequences queued", "num_waiting"),
    ("llamax_running_sequences", "gauge", "Sequences being computed", "num_running"),
    ("llamax_retained_sequences", "gauge", "Finished sequences kept for their prefix",
     "num_retained"),
    ("llamax_retained_hinted_sequences", "gauge", "Of those, kept longer by a hint",
     "num_retained_hinted"),
    ("llamax_kv_cells_used", "gauge", "KV cells in use", "kv_cells_used"),
    ("llamax_kv_cells_total", "gauge", "KV cells in the context", "kv_cells_total"),
    ("llamax_prefix_ram_bytes", "gauge", "Bytes of evicted prefixes kept in host RAM",
     "prefix_ram_bytes"),
    ("llamax_prefix_ram_budget_bytes", "gauge", "The host-RAM prefix tier's budget",
     "prefix_ram_budget_bytes"),
    ("llamax_prefix_ram_entries", "gauge", "Evicted prefixes kept in host RAM",
     "prefix_ram_entries"),
    ("llamax_prefix_ram_hinted_entries", "gauge", "Of those, kept longer by a hint",
     "prefix_ram_hinted_entries"),
    ("llamax_prefix_disk_bytes", "gauge", "Bytes of evicted prefixes kept on disk",
     "prefix_disk_bytes"),
    ("llamax_prefix_disk_budget_bytes", "gauge", "The disk prefix tier's budget",
     "prefix_disk_budget_bytes"),
    ("llamax_prefix_disk_entries", "gauge", "Evicted prefixes kept on disk",
     "prefix_disk_entries"),
    ("llamax_prefix_disk_hinted_entries", "gauge", "Of those, kept longer by a hint",
     "prefix_disk_hinted_entries"),
    ("llamax_checkpoint_bytes", "gauge", "Bytes of recurrent-state checkpoints held",
     "checkpoint_bytes"),
    ("llamax_threads", "gauge", "CPU threads a step uses now", "n_threads"),
    ("llamax_contended", "gauge", "1 while other processes hold cores and fewer threads are used",
     "is_contended"),
    ("llamax_engine_steps", "counter", "Decodes run", "num_steps"),
    ("llamax_engine_prefill_tokens", "counter", "Prompt tokens computed", "num_prefill_tokens"),
    ("llamax_engine_decode_tokens", "counter", "Generated tokens computed", "num_decode_tokens"),
    ("llamax_engine_preemptions", "counter", "Sequences preempted", "num_preemptions"),
    ("llamax_thread_changes", "counter", "Changes of the thread count (contention)",
     "num_thread_changes"),
    ("llamax_kv_relayouts", "counter", "Moves between KV layouts", "num_relayouts"),
    ("llamax_checkpoints", "counter", "Checkpoints taken (recurrent or hybrid memory)",
     "num_checkpoints"),
    ("llamax_checkpoint_restores", "counter", "Cuts and copies at a checkpoint",
     "num_checkpoint_restores"),
    ("llamax_prefix_ram_hits", "counter", "Prompts whose longest prefix was in host RAM",
     "num_prefix_ram_hits"),
    ("llamax_prefix_ram_restores", "counter", "Prefixes restored from host RAM",
     "num_prefix_ram_restores"),
    ("llamax_prefix_ram_refused", "counter", "Restores from host RAM refused (recomputed)",
     "num_prefix_ram_refused"),
    ("llamax_prefix_ram_restored_tokens", "counter", "Prompt tokens restored from host RAM",
     "num_prefix_ram_tokens"),
    ("llamax_prefix_ram_restore_seconds", "counter", "Time spent restoring prefixes from host RAM",
     "prefix_ram_restore_seconds"),
    ("llamax_prefix_disk_stores", "counter", "Prefixes written to disk", "num_prefix_disk_stores"),
    ("llamax_prefix_disk_hits", "counter", "Prompts whose longest prefix was on disk",
     "num_prefix_disk_hits"),
    ("llamax_prefix_disk_restores", "counter", "Prefixes restored from disk",
     "num_prefix_disk_restores"),
    ("llamax_prefix_disk_refused", "counter", "Files or states from disk refused (recomputed)",
     "num_prefix_disk_refused"),
    ("llamax_prefix_disk_restored_tokens", "counter", "Prompt tokens restored from disk",
     "num_prefix_disk_tokens"),
    ("llamax_prefix_disk_restore_seconds", "counter", "Time spent restoring prefixes from disk",
     "prefix_disk_restore_seconds"),
]  # fmt: skip

# the server's own request-level metrics, beside the engine's
SERVER_METRICS = [
    ("llamax_requests", "counter"),
    ("llamax_prompt_tokens", "counter"),
    ("llamax_generated_tokens", "counter"),
    ("llamax_cached_prompt_tokens", "counter"),
    ("llamax_time_to_first_token_seconds", "histogram"),
    ("llamax_inter_token_latency_seconds", "histogram"),
    ("llamax_request_duration_seconds", "histogram"),
    ("llamax_requests_in_flight", "gauge"),
]


def _stats() -> llamax.ContextStats:
    with llamax.Context(backend=FakeBackend()) as ctx:
        ctx.completion("hello there", max_tokens=3)
        return ctx.stats()


def test_engine_metrics_are_pinned() -> None:
    stats = _stats()
    assert stats.num_steps and stats.kv_cells_total  # values worth comparing
    found = {m.name: m for m in engine_metrics([((), stats)])}
    pinned = {name: (kind, doc, flat) for name, kind, doc, flat in ENGINE_METRICS}
    assert sorted(found) == sorted(pinned)
    for name, (kind, doc, flat) in pinned.items():
        metric = found[name]
        assert (metric.type, metric.documentation) == (kind, doc), name
        (sample,) = metric.samples
        assert sample.labels == {}
        assert sample.value == float(getattr(stats, flat)), name


def test_labelled_engine_metrics_carry_one_sample_per_model() -> None:
    """The pool's collector: the same metrics, a ``model`` label, a sample per model."""
    a, b = _stats(), _stats()
    found = {m.name: m for m in engine_metrics([(("a",), a), (("b",), b)], ("model",))}
    assert sorted(found) == sorted(name for name, *_ in ENGINE_METRICS)
    for name, _kind, _doc, flat in ENGINE_METRICS:
        samples = {s.labels["model"]: s.value for s in found[name].samples}
        assert samples == {"a": float(getattr(a, flat)), "b": float(getattr(b, flat))}


def test_server_registry_exports_the_pinned_metrics() -> None:
    stats = _stats()
    registry = ServerMetrics(lambda: stats).registry
    found = sorted((m.name, m.type) for m in registry.collect())
    expected = SERVER_METRICS + [(name, kind) for name, kind, *_ in ENGINE_METRICS]
    assert found == sorted(expected)
    loading = ServerMetrics(lambda: None).registry  # no engine metrics while it loads
    assert sorted((m.name, m.type) for m in loading.collect()) == sorted(SERVER_METRICS)


def test_every_metric_field_is_exported_from_its_metadata() -> None:
    """The collector is derived: every field whose metadata names a metric is exported, as
    declared, with its value, and ``server/metrics.py`` names no engine metric itself."""
    stats = _stats()
    declared = [f for f in stat_fields() if f.metric is not None]
    names = [f.metric.name for f in declared if f.metric is not None]
    assert len(names) == len(set(names))  # one field per metric
    found = {m.name: m for m in engine_metrics([((), stats)])}
    assert sorted(found) == sorted(names)
    for field in declared:
        assert field.metric is not None
        metric = found[field.metric.name]
        assert (metric.type, metric.documentation) == (field.metric.kind, field.metric.help)
        assert metric.samples[0].value == float(field.value(stats)), field.path
    source = inspect.getsource(metrics_module)
    assert not [name for name in names if name in source]  # no hand-kept table


def test_the_docs_stats_tables_are_current() -> None:
    found = 0
    for path in sorted(Path(__file__).resolve().parent.parent.joinpath("docs").glob("*.md")):
        text = path.read_text(encoding="utf-8")
        found += text.count("<!-- stats: ")
        assert regenerate(text) == text, (
            f"{path.name}: a stats table is stale; run python scripts/option_tables.py"
        )
    assert found == 2  # api.md (values), server.md (metrics)
