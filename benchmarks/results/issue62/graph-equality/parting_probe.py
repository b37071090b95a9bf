"""Issue 62: where llama.cpp's graph-side chain (backend sampling) parts from its host chain,
on the CPU backend, per sampler mix. Two contexts of SmolLM2 decode the same batches (the
same floats); one samples every row with llama.cpp's chain on the host, the other in the
graph (llamax's ``GraphChains``, each chain forced into the graph even where llamax would
keep it on the host). For each mix and seed set: the number of rows drawn and the step at
which each sequence's first token parted (None: never, over ``--steps``). Prints JSON.

    .venv/bin/python benchmarks/results/issue62/graph-equality/parting_probe.py > parting.json
"""

from __future__ import annotations

import argparse
import json
import platform
from typing import Any

import llamax
from llamax.backend.base import BatchItem
from llamax.backend.llama_cpp import LlamaCppBackend
from llamax.config import ContextConfig
from llamax.params import SamplingParams

MIXES: dict[str, dict[str, Any]] = {
    "top-k 40, top-p 0.95, min-p 0.05, temp 0.8": {"temperature": 0.8},
    "top-k 40, top-p 0.95, min-p 0.05, temp 0.8, repeat 1.1": {
        "temperature": 0.8, "repeat_penalty": 1.1},
    "top-k 200, top-p 0.9, temp 1.0": {"temperature": 1.0, "top_k": 200, "top_p": 0.9,
                                       "min_p": 0.0},
    "greedy": {"temperature": 0.0},
    "top-k 40 alone, temp 1.2": {"temperature": 1.2, "top_k": 40, "top_p": 1.0, "min_p": 0.0},
    "top-k 40, min-p 0.05, temp 0.8": {"temperature": 0.8, "top_p": 1.0},
    "no top-k, top-p 0.9, temp 1.0": {"temperature": 1.0, "top_k": 0, "top_p": 0.9,
                                      "min_p": 0.0},
    "no top-k, temp 1.0": {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0},
}  # fmt: skip
PROMPTS = ("Once upon a time", "The three primary colours are", "def fibonacci(n):",
           "Dear diary, today I")  # fmt: skip


def backend(graph: bool, n_seq: int) -> LlamaCppBackend:
    config = ContextConfig(
        model_path=str(llamax.default_model_path()), n_ctx=4096, n_seq_max=n_seq,
        n_threads=2, kv_layout="streams", backend_sampling=graph,
    )  # fmt: skip
    made = LlamaCppBackend(config)
    made._host_sampling = False  # llama.cpp's own chains, dist included
    return made


def run_mix(mix: dict[str, Any], seeds: list[int], steps: int) -> dict[str, Any]:
    n = len(seeds)
    host, graph = backend(False, n), backend(True, n)
    params = SamplingParams(**mix)
    chains = [host.new_sampler(params, s, []) for s in seeds]
    drawn = [graph.new_sampler(params, s, [], graph=True) for s in seeds]
    for sampler in drawn:
        sampler.graph = True  # into the graph even where llamax keeps the chain on the host
    parted: list[int | None] = [None] * n
    parts = [(i, host.tokenize(PROMPTS[i % 4], parse_special=False), 0) for i in range(n)]
    try:
        for step in range(steps):
            items, offset = [], 0
            for seq_id, tokens, start in parts:
                offset += len(tokens)
                items.append(BatchItem(seq_id, tokens, start, (offset - 1,)))
            assert host.decode(items) == 0
            bound = [BatchItem(i.seq_id, i.token_ids, i.start_pos, i.rows, sampler=drawn[i.seq_id])
                     for i in items]  # fmt: skip
            assert graph.decode(bound) == 0
            rows = [item.rows[0] for item in items]
            want = [host.sample(c, r) for c, r in zip(chains, rows, strict=True)]
            got = graph.sample_rows(drawn, rows)
            for i in range(n):
                if parted[i] is None and got[i] != want[i]:
                    parted[i] = step
            # both go on with the host's tokens: every later step compares the same rows
            parts = [(i.seq_id, [t], i.start_pos + len(i.token_ids))
                     for i, t in zip(items, want, strict=True)]  # fmt: skip
        chains_state = graph._graph
        assert chains_state is not None
        draws = chains_state.num_draws
    finally:
        for c in chains:
            host.free_sampler(c)
        for d in drawn:
            graph.free_sampler(d)
        host.close()
        graph.close()
    return {"graph_draws": draws, "first_parting_step": parted,
            "sequences_parted": sum(p is not None for p in parted)}  # fmt: skip


def cpu_model() -> str:
    """The CPU's model name and its AVX-512 / AMX flags, from /proc/cpuinfo."""
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        text = f.read()
    name = next((ln.split(":", 1)[1].strip() for ln in text.splitlines()
                 if ln.startswith("model name")), platform.machine())  # fmt: skip
    flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines()
                  if ln.startswith("flags")), [])  # fmt: skip
    simd = sorted(f for f in flags if f.startswith(("avx512", "amx")) or f == "avx2")
    return f"{name} ({' '.join(simd)})"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--seed-sets", type=int, default=2)
    args = parser.parse_args()
    report: dict[str, Any] = {"cpu": cpu_model(),
                              "n_seq": args.n, "steps": args.steps, "mixes": {}}  # fmt: skip
    for name, mix in MIXES.items():
        report["mixes"][name] = [
            run_mix(mix, [1000 * k + 7 * i + 1 for i in range(args.n)], args.steps)
            for k in range(args.seed_sets)
        ]
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
