"""What mixing LoRA adapters costs: 16 streams over two adapters against 16 over one.

llama.cpp applies adapters to a whole context (``llama_set_adapters_lora``), so a decode
carries one adapter set: 16 streams under one adapter decode 16 rows a step, and 16 split
over two adapters decode two groups of 8 that take turns (docs/lora.md). Workloads, each
16 distinct short prompts streaming ``--max-tokens`` greedy tokens (end of generation
banned), all at once:

``base`` no adapter; ``one`` all 16 under adapter ``a``; ``mixed`` 8 under ``a``, 8 under ``b``.

Systems, one after another, every workload ``--repeats`` times (interleaved):

``llamax``
    ``llamax.Context(lora={"a": ..., "b": ...}, n_ctx=4096, n_seq_max=16)``, requests with
    ``SamplingParams(lora=...)``.
``raw``
    The raw ``llama_decode`` loop (benchmarks/_loops.py) with the same adapters: every
    step decodes each adapter group's rows in a decode of its own, after
    ``llama_set_adapters_lora`` when the set changes. What any engine that keeps
    llama.cpp's one-set-per-context rule can reach.
``llama_server``
    ``llama-server -np 16 -c 4096 --lora A --lora B --lora-init-without-apply``; each
    request's ``lora`` field picks its scales.

Reported per system and workload, each repeat and their median: ``steady_tok_s`` (every
stream's tokens between the moment the last stream had its first token and the moment the
first stream ended, over that time; None when one set's streams all ended before another's
began, as llama-server runs them), ``total_tok_s`` (all tokens over the time from the first
request to the last token) and ``last_first_token_s`` (when the stream that waited longest
had its first token: how fairly the sets share the steps). Then ``mixed_over_one`` (the
cost of mixing) and ``one_over_base`` (the cost of an adapter) per system, and llamax over
the raw loop and over llama-server per workload. The adapters are
scripts/make_lora_adapter.py's (rank 8 on attn_q, attn_v and ffn_down of every block;
random weights).

::

    .venv/bin/python benchmarks/lora_mix.py --json-out lora_mix.json
    .venv/bin/python benchmarks/lora_mix.py --quick --no-llama-server
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import llama_cpp.llama_cpp as C
from _common import (
    TokenTimes,
    add_common_args,
    base_config,
    emit_report,
    greedy,
    in_fresh_thread,
    load_average,
    load_script,
    log,
    model_path,
    ratio,
    short_prompts,
    stdout_to_stderr,
)
from _loops import RawLoop, tokenize
from _peers import LlamaServerPeer, default_llama_server

import llamax

N_STREAMS = 16
N_CTX = 4096
WORKLOADS: dict[str, list[str | None]] = {
    "base": [None] * N_STREAMS,
    "one": ["a"] * N_STREAMS,
    "mixed": ["a", "b"] * (N_STREAMS // 2),
}
"""Each stream's adapter (``None``: the base model)."""


Progress = list[tuple[float, int]]
"""One stream: at each arrival, its time and how many tokens the stream has made so far."""


def steady_rate(streams: Sequence[Progress]) -> float:
    """Tokens per second of every stream between the last first token and the first end."""
    begin = max(p[0][0] for p in streams)
    end = min(p[-1][0] for p in streams)
    if end <= begin:
        raise RuntimeError("no steady state: a stream ended before the last one started")

    def made_by(progress: Progress, moment: float) -> int:
        return max((count for at, count in progress if at <= moment), default=0)

    tokens = sum(made_by(p, end) - made_by(p, begin) for p in streams)
    return tokens / (end - begin)


def per_token(times: Sequence[float]) -> Progress:
    """The progress of a stream timed token by token."""
    return [(at, i + 1) for i, at in enumerate(times)]


def make_adapters(model: Path, directory: Path) -> dict[str, Path]:
    """Adapters ``a`` and ``b`` (two seeds) written by scripts/make_lora_adapter.py."""
    module = load_script("make_lora_adapter")
    return {
        name: module.write_lora_adapter(directory / f"{name}.gguf", model=model, seed=seed)
        for seed, name in enumerate(("a", "b"))
    }


def llamax_system(model: Path, adapters: dict[str, Path]) -> Callable[[str, int], list[Progress]]:
    ctx = llamax.Context(model, lora={k: str(v) for k, v in adapters.items()},
                         n_ctx=N_CTX, n_seq_max=N_STREAMS, n_threads=2)  # fmt: skip
    prompts = short_prompts(N_STREAMS)

    def run(workload: str, max_tokens: int) -> list[Progress]:
        handles = []
        for prompt, name in zip(prompts, WORKLOADS[workload], strict=True):
            params = dataclasses.replace(greedy(max_tokens), lora={name: 1.0} if name else None)
            handles.append(ctx.add_request(prompt, params))
        consumers = [TokenTimes(h) for h in handles]
        times = [per_token(c.wait()) for c in consumers]
        ctx.clear_cache()  # every repeat prefills its prompts again, as the others do
        return times

    run.close = ctx.close  # type: ignore[attr-defined]
    return run


class RawLora:
    """The raw loop with two adapters: each step decodes each group in a decode of its own."""

    def __init__(self, model: Path, adapters: dict[str, Path]) -> None:
        self.loop = RawLoop(model, n_ctx=N_CTX, n_seq_max=N_STREAMS, n_batch=512)
        self.handles = {}
        for name, path in adapters.items():
            handle = C.llama_adapter_lora_init(self.loop.model, str(path).encode())
            if not handle:
                raise RuntimeError(f"llama.cpp could not load {path}")
            self.handles[name] = handle
        self.applied: str | bool | None = False  # False: nothing applied yet
        self.prompts = [tokenize(self.loop.vocab, p) for p in short_prompts(N_STREAMS)]

    def apply(self, name: str | None) -> None:
        if name == self.applied:
            return
        n = 0 if name is None else 1
        handles = (C.llama_adapter_lora_p_ctypes * 1)(*([self.handles[name]] if name else []))
        scales = (ctypes.c_float * 1)(1.0)
        status = C.llama_set_adapters_lora(self.loop.ctx, handles if n else None, n, scales)
        if status != 0:
            raise RuntimeError(f"llama_set_adapters_lora failed with status {status}")
        self.applied = name

    def __call__(self, workload: str, max_tokens: int) -> list[Progress]:
        loop, names = self.loop, WORKLOADS[workload]
        groups: dict[str | None, list[int]] = {}
        for seq, name in enumerate(names):
            groups.setdefault(name, []).append(seq)
        C.llama_memory_clear(loop.memory, True)
        chains = [loop.new_chain() for _ in names]
        times: list[list[float]] = [[] for _ in names]
        pending: list[int] = [0] * len(names)
        try:
            for name, seqs in groups.items():  # prefill each group under its adapter
                self.apply(name)
                items = [(t, pos, s, pos == len(self.prompts[s]) - 1)
                         for s in seqs for pos, t in enumerate(self.prompts[s])]  # fmt: skip
                rows = loop.decode_rows(items)
                for s in seqs:
                    pending[s] = C.llama_sampler_sample(chains[s], loop.ctx, rows[s])
                    times[s].append(time.perf_counter())
            for step in range(1, max_tokens):
                for name, seqs in groups.items():
                    self.apply(name)
                    loop.decode([(pending[s], len(self.prompts[s]) + step - 1, s, True)
                                 for s in seqs])  # fmt: skip
                    for row, s in enumerate(seqs):
                        pending[s] = C.llama_sampler_sample(chains[s], loop.ctx, row)
                        times[s].append(time.perf_counter())
        finally:
            for chain in chains:
                C.llama_sampler_free(chain)
        return [per_token(t) for t in times]

    def close(self) -> None:
        self.loop.close()  # the adapters are freed with the model


def server_system(peer: LlamaServerPeer) -> Callable[[str, int], list[Progress]]:
    prompts = short_prompts(N_STREAMS)

    def follow(prompt: str, name: str | None, max_tokens: int) -> Progress:
        # llama-server sends no event for a token whose text it holds back (random
        # adapters make broken UTF-8), so count with each event's tokens_predicted
        lora = [{"id": 0, "scale": float(name == "a")}, {"id": 1, "scale": float(name == "b")}]
        stream = peer.stream_progress(prompt, max_tokens, extra={"lora": lora})
        return [(time.perf_counter(), count) for count in stream]

    def run(workload: str, max_tokens: int) -> list[Progress]:
        with ThreadPoolExecutor(N_STREAMS) as pool:
            names = WORKLOADS[workload]
            futures = [pool.submit(follow, prompt, name, max_tokens)
                       for prompt, name in zip(prompts, names, strict=True)]  # fmt: skip
            return [f.result() for f in futures]

    return run


def measure(
    system: Callable[[str, int], list[Progress]], repeats: int, max_tokens: int, label: str
) -> dict[str, Any]:
    """Warm up once per workload, then every workload ``repeats`` times, interleaved."""
    figures: dict[str, dict[str, list[float | None]]] = {
        w: {"steady_tok_s": [], "total_tok_s": [], "last_first_token_s": []} for w in WORKLOADS
    }
    for workload in WORKLOADS:
        system(workload, 8)
    for repeat in range(repeats):
        for workload in WORKLOADS:
            started = time.perf_counter()
            streams = system(workload, max_tokens)
            if any(p[-1][1] != max_tokens for p in streams):
                raise RuntimeError(f"{label}: streams made {[p[-1][1] for p in streams]} tokens")
            try:
                steady: float | None = round(steady_rate(streams), 2)
            except RuntimeError:  # one set's streams all ended before the other's began
                steady = None
            ended = max(p[-1][0] for p in streams)
            mine = figures[workload]
            mine["steady_tok_s"].append(steady)
            mine["total_tok_s"].append(round(len(streams) * max_tokens / (ended - started), 2))
            mine["last_first_token_s"].append(round(max(p[0][0] for p in streams) - started, 3))
            log(f"{label} {workload} repeat {repeat}: "
                f"{ {k: v[-1] for k, v in mine.items()} } (load {load_average()})")  # fmt: skip
    out: dict[str, Any] = {
        w: {k: _median(v) for k, v in table.items()} | {"repeats": table}
        for w, table in figures.items()
    }
    for key in ("steady_tok_s", "total_tok_s"):
        out[f"mixed_over_one_{key}"] = ratio(out["mixed"][key], out["one"][key])
        out[f"one_over_base_{key}"] = ratio(out["one"][key], out["base"][key])
    return out


def _median(values: Sequence[float | None]) -> float | None:
    """The median, or None when any repeat had no value (no steady state)."""
    known = [v for v in values if v is not None]
    return statistics.median(known) if len(known) == len(values) else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens each stream makes")
    parser.add_argument("--quick", action="store_true", help="2 repeats of 64 tokens")
    parser.add_argument("--llama-server", type=Path, default=default_llama_server())
    parser.add_argument("--no-llama-server", action="store_true", help="skip llama-server")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.max_tokens = 2, 64
    load_at_start = load_average()
    model = model_path(args.model)
    results: dict[str, Any] = {}
    with stdout_to_stderr() as stdout, tempfile.TemporaryDirectory() as tmp:
        adapters = make_adapters(model, Path(tmp))

        def run_llamax() -> dict[str, Any]:
            system = llamax_system(model, adapters)
            try:
                return measure(system, args.repeats, args.max_tokens, "llamax")
            finally:
                system.close()  # type: ignore[attr-defined]

        def run_raw() -> dict[str, Any]:
            raw = RawLora(model, adapters)
            try:
                return measure(raw, args.repeats, args.max_tokens, "raw")
            finally:
                raw.close()

        results["llamax"] = in_fresh_thread(run_llamax)
        results["raw"] = in_fresh_thread(run_raw)
        if args.llama_server is not None and not args.no_llama_server:
            extra = ["--lora", str(adapters["a"]), "--lora", str(adapters["b"]),
                     "--lora-init-without-apply"]  # fmt: skip
            peer = LlamaServerPeer(
                args.llama_server, model, n_parallel=N_STREAMS, n_ctx=N_CTX, extra_args=extra
            )
            try:
                results["llama_server"] = measure(
                    server_system(peer), args.repeats, args.max_tokens, "llama-server"
                )
            finally:
                peer.close()
        report = {
            "benchmark": "lora_mix",
            "config": base_config(args, load_at_start, n_streams=N_STREAMS, n_ctx=N_CTX),
            "results": results,
            "ratios": {
                f"llamax_over_{peer_name}_{w}_{key}": ratio(
                    results["llamax"][w][key], results[peer_name][w][key]
                )
                for peer_name in ("raw", "llama_server")
                if peer_name in results
                for w in WORKLOADS
                for key in ("steady_tok_s", "total_tok_s")
            },
        }
        emit_report(report, stdout, args.json_out)


if __name__ == "__main__":
    main()
