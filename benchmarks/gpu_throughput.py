"""GPU throughput: llamax against llama-server of the same llama.cpp build, per model shape.

For each ``--shape NAME=GGUF`` (``scripts/make_random_model.py`` writes them: ``tiny``,
whose decode costs almost nothing, then ``1b`` and ``8b``) and each N in ``--n`` (default
1, 16, 64, 128), N distinct short prompts are completed with ``--max-tokens`` (128) tokens
each, end-of-generation banned, in each sampling mode of ``--modes``: ``greedy``,
``sampled`` (temperature 0.8, top-k 40, top-p 0.95, min-p 0.05: llama-server's defaults,
spelled out; prompt ``i`` seeded with ``i``) and ``sampled_penalty`` (the same with repeat
penalty 1.1 over the last 64 tokens). Score: generated tokens / wall time. Systems (named
``<system>_<mode>`` outside greedy):

``llamax``
    One ``llamax.Context(n_gpu_layers=-1)`` built for the largest N (KV streams, one per
    sequence), N ``add_request`` calls, then every result; cache cleared before each run.
``raw_streams``
    ``_loops.RawLoop`` on the same model (one KV stream per sequence), each sequence sampled
    with a llama.cpp sampler chain (llamax samples greedy as an argmax of the row instead);
    greedy only.
``llama_server``
    ``llama-server -np N -c N*256 -ngl 99`` of the same build (``--llama-server PATH``), one
    process per N, N concurrent ``/completion`` requests (the mode's fields in the body:
    ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``repeat_penalty``, ``seed``).

With ``--backend-sampling both`` (the default; ``off``, ``on``) each of llamax and
llama-server also runs with backend sampling: ``llamax_bs`` is a second context made with
``backend_sampling=True`` (plain requests' chains run in the decode, on the device:
docs/logits.md#backend-sampling), ``llama_server_bs`` is llama-server started with
``--backend-sampling``. ``ratios`` compares each llamax with llama-server's same variant
(and ``llamax_bs`` with llama-server's default too); ``best_ratios``, what the targets read,
llamax's faster variant over llama-server's faster, per mode and N.

Then the overhead model at ``--overhead-n`` (64): one llamax run with ``backend.decode``
followed by ``llama_synchronize`` (CUDA's ``llama_decode`` returns before the GPU is done,
and the first logits read would wait instead) and ``backend.sample_rows`` timed (the engine
samples plain requests' rows with it); per mode and step,
``decode_ms`` (GPU and graph work), ``sample_ms`` (llama.cpp's samplers and reading the
logits), and ``python_ms``, the rest of the step's wall time (scheduling, detokenizing,
futures, the engine thread's hand-offs). The synchronize moves the GPU wait from sampling
into decode; it does not add a wait.

Each result is also given as memory bandwidth (``bandwidth``): a decode step reads the
weights once (every tensor but the token embedding table, whose rows are looked up, unless
the output matrix is that table) and each sequence's KV cells (its prompt and half the
reply on average, at the context's ``kv_bytes_per_cell``); bytes a step x steps a second
(tokens a second / N) is the bandwidth the run used, and with ``--peak-gbs`` (the device's
bound: about 4,800 GB/s for an H200, 3,350 for an H100 SXM) its share of the bound.

``--cpu`` runs everything with ``n_gpu_layers=0`` and ``-ngl 0`` (a smoke run on a machine
without a GPU); ``--quick`` runs N = 1 and 16 with 32 tokens and one repeat. Targets
(issue 62): llamax >= 1.2x llama-server at N >= 16 when sampling, >= 1.0x greedy at N >= 16
and in every mode at N = 1.

::

    python benchmarks/gpu_throughput.py --llama-server /tmp/llamax-gpu-build/bin/llama-server \\
        --shape 1b=/tmp/llamax-gpu-models/1b.gguf --shape 8b=/tmp/llamax-gpu-models/8b.gguf
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from _common import (
    N_THREADS,
    base_config,
    emit_report,
    greedy,
    load_average,
    log,
    ratio,
    short_prompts,
    stdout_to_stderr,
    targets,
)
from _loops import RawLoop
from _peers import LlamaServerPeer

import llamax
from llamax.backend.gguf_file import read_header

MODES: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "sampled": {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05},
    "sampled_penalty": {
        "temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repeat_penalty": 1.1,
    },
}  # fmt: skip
"""Each mode's sampling fields: ``SamplingParams``' names are llama-server's body fields too
(whose ``repeat_last_n`` is 64, as llamax's ``penalty_last_n``)."""
CELLS_PER_SEQ = 256  # a short prompt (~11 tokens) and 128 generated fit with room
N_BATCH = 2048  # every prompt of N = 128 prefills in one batch
LLAMAX, RAW, SERVER = "llamax", "raw_streams", "llama_server"
Run = Callable[[Sequence[str], int], tuple[int, float]]


def named(system: str, mode: str) -> str:
    """A system's name in a mode: ``llamax``, ``llamax_sampled`` ..."""
    return system if mode == "greedy" else f"{system}_{mode}"


def sampling(mode: str, max_tokens: int, seed: int) -> llamax.SamplingParams:
    """Request ``seed``'s parameters in ``mode``."""
    if mode == "greedy":
        return greedy(max_tokens)
    return llamax.SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=seed, **MODES[mode])


def llamax_run(ctx: llamax.Context, mode: str = "greedy") -> Run:
    """N requests on the context at once; ``(tokens, seconds)``."""

    def run(prompts: Sequence[str], max_tokens: int) -> tuple[int, float]:
        ctx.clear_cache()
        params = [sampling(mode, max_tokens, i) for i in range(len(prompts))]
        start = time.perf_counter()
        handles = [ctx.add_request(p, params[i]) for i, p in enumerate(prompts)]
        tokens = sum(h.result().usage.completion_tokens for h in handles)
        return tokens, time.perf_counter() - start

    return run


def raw_run(loop: RawLoop) -> Run:
    """The raw loop: every prompt in one batch, then one token per sequence per step."""

    def run(prompts: Sequence[str], max_tokens: int) -> tuple[int, float]:
        start = time.perf_counter()
        out = loop.generate(prompts, max_tokens)
        return sum(len(t) for t in out.token_ids), time.perf_counter() - start

    return run


def server_runs(
    binary: Path, model: Path, ngl: int, closers: list[Callable[[], None]], graph: bool = False
) -> Callable[[str], Run]:
    """llama-server with ``-np N``, started on first use for each N (kept until the end,
    shared by the modes); a mode's run. ``graph``: with ``--backend-sampling``."""
    servers: dict[int, LlamaServerPeer] = {}

    def for_mode(mode: str) -> Run:
        fields = {} if mode == "greedy" else MODES[mode]
        return lambda prompts, max_tokens: run(prompts, max_tokens, fields)

    def run(prompts: Sequence[str], max_tokens: int, fields: dict[str, Any]) -> tuple[int, float]:
        n = len(prompts)
        if n not in servers:
            extra = ["-ngl", str(ngl), "-b", str(N_BATCH), *(["-bs"] if graph else [])]
            servers[n] = LlamaServerPeer(
                binary, model, n_parallel=n, n_ctx=n * CELLS_PER_SEQ, extra_args=extra
            )
            closers.append(servers[n].close)
            servers[n].run_batch(prompts, 4)  # warm-up
        start = time.perf_counter()
        tokens = servers[n].run_batch(prompts, max_tokens, lambda i: fields | {"seed": i})
        return tokens, time.perf_counter() - start

    return for_mode


def weight_bytes_per_step(model: Path) -> int:
    """Bytes of weights one decode step reads: every tensor's data (to the next tensor's
    offset, so with its alignment padding), less the token embedding table where the model
    has an output matrix of its own (a step reads only its rows' embeddings)."""
    header = read_header(model)
    tensors = sorted(header.tensors, key=lambda t: t.offset)
    ends = [t.offset for t in tensors[1:]] + [header.file_size - header.data_offset]
    sizes = {t.name: end - t.offset for t, end in zip(tensors, ends, strict=True)}
    if "output.weight" in sizes:
        sizes.pop("token_embd.weight", None)
    return sum(sizes.values())


def bandwidth(
    tokens_per_s: dict[str, dict[str, float]],
    weight_bytes: int,
    kv_bytes_per_cell: int,
    mean_cells: float,
    peak_gbs: float | None,
) -> dict[str, Any]:
    """The memory bandwidth each system's runs used (module docstring), and its share of
    ``peak_gbs`` when given."""
    step_bytes = {
        n: weight_bytes + int(n) * mean_cells * kv_bytes_per_cell
        for by_n in tokens_per_s.values()
        for n in by_n
    }
    used = {
        system: {n: round(step_bytes[n] * tps / int(n) / 1e9, 1) for n, tps in by_n.items()}
        for system, by_n in tokens_per_s.items()
    }
    out: dict[str, Any] = {
        "weight_bytes": weight_bytes,
        "kv_bytes_per_cell": kv_bytes_per_cell,
        "mean_cells": round(mean_cells, 1),
        "bytes_per_step": {
            n: int(b) for n, b in sorted(step_bytes.items(), key=lambda x: int(x[0]))
        },
        "gbs": used,
    }
    if peak_gbs:
        out["peak_gbs"] = peak_gbs
        out["share_of_peak"] = {
            system: {n: round(gbs / peak_gbs, 4) for n, gbs in by_n.items()}
            for system, by_n in used.items()
        }
    return out


def overhead(ctx: llamax.Context, n: int, max_tokens: int, mode: str) -> dict[str, Any]:
    """Where a step's time goes at ``n`` streams: decode, sampling and the rest (Python)."""
    backend = ctx._engine.backend
    sync = backend._context.C.llama_synchronize
    decode, sample = backend.decode, backend.sample_rows
    spent = {"decode": 0.0, "sample": 0.0}

    def timed_decode(items: Any) -> int:
        t = time.perf_counter()
        status: int = decode(items)
        sync(backend._context.ptr)
        spent["decode"] += time.perf_counter() - t
        return status

    def timed_sample(samplers: Any, rows: Any) -> list[int]:
        t = time.perf_counter()
        tokens: list[int] = sample(samplers, rows)
        spent["sample"] += time.perf_counter() - t
        return tokens

    backend.decode, backend.sample_rows = timed_decode, timed_sample
    try:
        steps = ctx.stats().num_steps
        tokens, seconds = llamax_run(ctx, mode)(short_prompts(n), max_tokens)
        steps = ctx.stats().num_steps - steps
    finally:
        del backend.decode, backend.sample_rows  # the class's methods again
    per_step = {k: round(v / steps * 1e3, 3) for k, v in spent.items()}
    wall = seconds / steps * 1e3
    return {
        "mode": mode,
        "n": n,
        "steps": steps,
        "tokens_per_s": round(tokens / seconds, 1),
        "step_ms": round(wall, 3),
        "decode_ms": per_step["decode"],
        "sample_ms": per_step["sample"],
        "python_ms": round(wall - per_step["decode"] - per_step["sample"], 3),
        "python_share": round(1 - (spent["decode"] + spent["sample"]) / seconds, 4),
    }


def bench_shape(
    args: argparse.Namespace, name: str, model: Path, ns: Sequence[int]
) -> dict[str, Any]:
    """Every system at every N on one model, interleaved; then the overhead model."""
    log(f"== {name}: {model}")
    closers: list[Callable[[], None]] = []
    ngl = 0 if args.cpu else -1
    n_max = max([*ns, args.overhead_n])
    options = dict(n_ctx=n_max * CELLS_PER_SEQ, n_seq_max=n_max, n_batch=N_BATCH)
    variants = VARIANTS[args.backend_sampling]
    contexts: dict[str, llamax.Context] = {}
    try:
        systems: dict[str, Run] = {}
        for suffix in variants:
            ctx = llamax.Context(
                model, n_gpu_layers=ngl, n_threads=N_THREADS, kv_layout="streams",
                backend_sampling=bool(suffix), **options,
            )  # fmt: skip
            closers.append(ctx.close)
            contexts[suffix] = ctx
            systems |= {named(LLAMAX + suffix, m): llamax_run(ctx, m) for m in args.modes}
        if RAW not in args.skip and "greedy" in args.modes:
            loop = RawLoop(model, kv_unified=False, **options)
            closers.append(loop.close)
            systems[RAW] = raw_run(loop)
        if args.llama_server is not None:
            for suffix in variants:
                ngl_server = 0 if args.cpu else 99
                server = server_runs(args.llama_server, model, ngl_server, closers, bool(suffix))
                systems |= {named(SERVER + suffix, m): server(m) for m in args.modes}
        for system, run in systems.items():
            if not system.startswith(SERVER):
                run(short_prompts(min(2, n_max)), 4)  # warm-up (the server warms per N)
        samples: dict[str, dict[str, list[float]]] = {s: {} for s in systems}
        for repeat in range(args.repeats):
            for n in ns:
                order = (
                    list(systems)[repeat % len(systems) :] + list(systems)[: repeat % len(systems)]
                )
                for system in order:
                    tokens, seconds = systems[system](short_prompts(n), args.max_tokens)
                    if tokens != n * args.max_tokens:
                        log(f"  warning: {system} made {tokens} != {n * args.max_tokens} tokens")
                    samples[system].setdefault(str(n), []).append(round(tokens / seconds, 2))
                    log(f"{name} N={n:<3} {system:<12} {tokens / seconds:9.1f} tok/s")
        breakdown = [
            overhead(c, args.overhead_n, args.max_tokens, m) | {"backend_sampling": bool(suffix)}
            for suffix, c in contexts.items()
            for m in args.modes
        ]
        log(f"{name} overhead at N={args.overhead_n}: {breakdown}")
        ctx = next(iter(contexts.values()))
        prompt_tokens = statistics.mean(len(ctx.tokenize(p)) for p in short_prompts(n_max))
        kv_bytes_per_cell = ctx.model_info().kv_bytes_per_cell
    finally:
        for close in reversed(closers):
            close()
    med = {s: {n: statistics.median(v) for n, v in by_n.items()} for s, by_n in samples.items()}
    mean_cells = prompt_tokens + args.max_tokens / 2
    return {
        "model": str(model),
        "model_bytes": model.stat().st_size,
        "median_tokens_per_s": {s: {n: round(v, 2) for n, v in m.items()} for s, m in med.items()},
        "bandwidth": bandwidth(
            med, weight_bytes_per_step(model), kv_bytes_per_cell, mean_cells, args.peak_gbs
        ),
        "ratios": {
            f"{named(mine, m)}_over_{named(other, m)}": {
                str(n): ratio(
                    med.get(named(mine, m), {}).get(str(n)),
                    med.get(named(other, m), {}).get(str(n)),
                )
                for n in ns
            }
            for m in args.modes
            for mine, other in pairs(variants)
            if other != RAW or m == "greedy"
        },
        "best_ratios": {
            m: {str(n): best_ratio(med, variants, m, str(n)) for n in ns} for m in args.modes
        },
        "overhead": breakdown,
        "samples": samples,
    }


VARIANTS: dict[str, tuple[str, ...]] = {"off": ("",), "on": ("_bs",), "both": ("", "_bs")}
"""``--backend-sampling``: the name suffixes of the systems run (``_bs``: llamax with
``backend_sampling=True``, llama-server with ``--backend-sampling``)."""


def pairs(variants: Sequence[str]) -> list[tuple[str, str]]:
    """The (llamax, peer) systems compared: each variant against llama-server's same
    variant, llamax's backend sampling against llama-server's default too, and the raw loop."""
    out = [(LLAMAX + v, SERVER + v) for v in variants]
    if "_bs" in variants and "" in variants:
        out.append((LLAMAX + "_bs", SERVER))
    return [*out, (LLAMAX, RAW)] if "" in variants else out


def best_ratio(
    med: dict[str, dict[str, float]], variants: Sequence[str], mode: str, n: str
) -> float | None:
    """llamax's faster variant over llama-server's faster one, in ``mode`` at ``n``."""
    mine = [med.get(named(LLAMAX + v, mode), {}).get(n) for v in variants]
    theirs = [med.get(named(SERVER + v, mode), {}).get(n) for v in variants]
    a, b = [x for x in mine if x], [x for x in theirs if x]
    return ratio(max(a), max(b)) if a and b else None


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--json-out", type=Path, help="also write the JSON report here")
    parser.add_argument(
        "--shape", action="append", default=[], metavar="NAME=GGUF", help="a model (repeatable)"
    )
    parser.add_argument("--n", type=int, nargs="+", default=[1, 16, 64, 128])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--overhead-n", type=int, default=64)
    parser.add_argument("--llama-server", help="llama-server binary of the same build, or 'none'")
    parser.add_argument("--skip", nargs="*", default=[], help="systems not to run (raw_streams)")
    parser.add_argument("--cpu", action="store_true", help="n_gpu_layers=0 and -ngl 0")
    parser.add_argument(
        "--modes", nargs="+", choices=list(MODES), default=list(MODES), help="sampling modes"
    )
    parser.add_argument("--quick", action="store_true", help="N = 1 16, 32 tokens, 1 repeat")
    parser.add_argument(
        "--backend-sampling",
        choices=list(VARIANTS),
        default="both",
        help="llamax's backend_sampling and llama-server's --backend-sampling: off, on, both",
    )
    parser.add_argument(
        "--peak-gbs",
        type=float,
        help="the device's memory bandwidth bound in GB/s (H200: ~4800): report each share",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.n, args.max_tokens, args.repeats = [1, 16], 32, 1
        args.overhead_n = min(args.overhead_n, 16)
    if not args.shape:
        args.shape = [f"default={llamax.default_model_path()}"]
    try:
        args.models = {k: Path(v) for k, v in (s.split("=", 1) for s in args.shape)}
    except ValueError:
        parser.error("--shape takes NAME=GGUF")
    server = args.llama_server
    args.llama_server = None if server in (None, "none") else Path(server)
    return args


def report(
    args: argparse.Namespace, load: list[float], ns: Sequence[int], shapes: dict[str, Any]
) -> dict[str, Any]:
    """The JSON report: config, every shape's results, and the targets (issue 62: llamax's
    faster variant over llama-server's faster, >= 1.2x at N >= 16 sampled, >= 1.0x at N
    >= 16 greedy and at N = 1)."""
    values = {
        f"{name}_{named(LLAMAX, m)}_vs_llama_server_N{n}": result["best_ratios"][m].get(str(n))
        for name, result in shapes.items()
        for m in args.modes
        for n in ns
        if n >= 16 or n == 1
    }
    goals = {key: 1.2 if "_sampled" in key and not key.endswith("_N1") else 1.0 for key in values}
    config = base_config(
        args, load, cells_per_seq=CELLS_PER_SEQ, n_batch=N_BATCH, n_gpu_layers=0 if args.cpu else -1
    )
    config.pop("models", None)
    return {
        "config": config,
        "shapes": shapes,
        "targets": targets(values, goals, at_least=True),
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    ns = sorted(set(args.n))
    load = load_average()
    shapes: dict[str, dict[str, Any]] = {}
    with stdout_to_stderr() as stdout:
        for name, path in args.models.items():
            shapes[name] = bench_shape(args, name, path, ns)
            if args.json_out:  # a run cut short keeps the shapes it finished
                args.json_out.write_text(json.dumps(report(args, load, ns, shapes), indent=2))
        emit_report(report(args, load, ns, shapes), stdout, args.json_out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
