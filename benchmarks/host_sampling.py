"""Host sampling's cost per step (issue 62): llama.cpp's sampler chain row by row against
the rows sampled together on the host (``llamax.backend.host_sampling``), N = 16 and 64.

Two vocabularies: SmolLM2's 49,152 (real logits: the rows of a prompt of N tokens decoded
with logits at every position, the default model) and a 128,256-wide random matrix (Llama
3's vocabulary; logits N(0, 3)). Per parameter mix, N and repeat, ``--steps`` steps over
the same rows (each sampler's generator moving on): ``chain_ms`` per step, every row through
its own chain (SmolLM2: ``LlamaCppBackend.sample``, i.e. ``llama_sampler_sample`` on the
context; random rows: the chain applied to a candidate array of the row, the same work
with the row's copy done by NumPy), and ``host_ms``, the rows sampled together
(``sample_rows``), which also checks that both pick the same tokens. The mixes: llamax's
and llama-server's default (top-k 40, top-p 0.95, min-p 0.05, temperature 0.8), and top-k
40 alone (chains without top-k stay on llama.cpp, so there is nothing to compare).

This measures a backend component, so it uses ``llamax.backend`` rather than the public
API. Prints JSON with the CPU model and every repeat.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from _common import emit_report, filler_sentences, load_average, log, model_path, stdout_to_stderr

from llamax.backend.base import BatchItem
from llamax.backend.llama_cpp import LlamaCppBackend
from llamax.backend.native import NativeSampler, bindings, sample_on_host
from llamax.backend.sampler_chain import new_sampler
from llamax.config import ContextConfig
from llamax.params import SamplingParams

MIXES = {
    "default": {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05},
    "top_k_only": {"temperature": 0.8, "top_k": 40, "top_p": 1.0, "min_p": 0.0},
}
WIDE_VOCAB = 128_256
Step = Callable[[], list[int]]


def cpu_model() -> str:
    """``model name`` of /proc/cpuinfo."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def timed(step: Step, steps: int) -> tuple[float, list[list[int]]]:
    """Milliseconds per step over ``steps`` steps, and every step's tokens."""
    tokens = []
    start = time.perf_counter()
    for _ in range(steps):
        tokens.append(step())
    return (time.perf_counter() - start) / steps * 1e3, tokens


def compare(name: str, chain: Step, host: Step, args: argparse.Namespace) -> dict[str, Any]:
    """Both ways, alternating, ``--repeats`` times; each repeat's ms per step."""
    out: dict[str, Any] = {"chain_ms": [], "host_ms": [], "same_tokens": True}
    for _ in range(args.repeats):
        chain_ms, chain_tokens = timed(chain, args.steps)
        host_ms, host_tokens = timed(host, args.steps)
        out["chain_ms"].append(round(chain_ms, 3))
        out["host_ms"].append(round(host_ms, 3))
        out["same_tokens"] &= chain_tokens == host_tokens
    log(f"{name}: chain {out['chain_ms']} ms, host {out['host_ms']} ms")
    return out


def smollm2(args: argparse.Namespace, ns: Sequence[int]) -> list[dict[str, Any]]:
    """Real rows: one prompt of max(ns) tokens, logits at every position."""
    backend = LlamaCppBackend(ContextConfig(model_path=str(model_path(args.model)), n_ctx=512))
    results = []
    try:
        text = " ".join(s for s, _ in zip(filler_sentences(), range(20), strict=False))
        tokens = backend.tokenize(text, parse_special=False)[: max(ns)]
        assert backend.decode([BatchItem(0, tokens, 0, tuple(range(len(tokens))))]) == 0
        n_vocab = backend.facts.n_vocab
        for mix in args.mixes:
            params = SamplingParams(**MIXES[mix])
            for n in ns:
                rows = list(range(n))
                chains, hosts = ([], [])
                for host, built in ((False, chains), (True, hosts)):
                    backend._host_sampling = host
                    built.extend(backend.new_sampler(params, 1000 + i, []) for i in rows)

                def chain_step(chains: list[Any] = chains, rows: list[int] = rows) -> list[int]:
                    return [backend.sample(s, r) for s, r in zip(chains, rows, strict=True)]

                def host_step(hosts: list[Any] = hosts, rows: list[int] = rows) -> list[int]:
                    return backend.sample_rows(hosts, rows)

                result = compare(f"smollm2 {mix} N={n}", chain_step, host_step, args)
                results.append({"vocab": n_vocab, "mix": mix, "n": n, **result})
                for s in chains + hosts:
                    backend.free_sampler(s)
    finally:
        backend.close()
    return results


class Rows:
    """A context's logits, for samplers fed rows of a matrix."""

    def __init__(self, block: np.ndarray) -> None:
        self.block = block

    def logits(self, row: int, n_vocab: int) -> np.ndarray:
        return self.block[row]


def samplers(params: SamplingParams, n: int, host: bool) -> list[NativeSampler]:
    """N samplers of ``params`` for the wide rows, llama.cpp's chain or the host's."""
    options: dict[str, Any] = {"eog": frozenset(), "n_vocab": WIDE_VOCAB, "n_ctx": 4096}
    C = bindings()
    return [
        new_sampler(C, None, params, 1000 + i, [], None, host=host, **options) for i in range(n)
    ]


def wide(args: argparse.Namespace, ns: Sequence[int]) -> list[dict[str, Any]]:
    """Random rows of Llama 3's vocabulary width."""
    block = np.random.default_rng(62).normal(0, 3, (max(ns), WIDE_VOCAB)).astype(np.float32)
    context = Rows(block)
    results = []
    for mix in args.mixes:
        params = SamplingParams(**MIXES[mix])
        for n in ns:
            chains, hosts = samplers(params, n, False), samplers(params, n, True)

            def chain_step(chains: list[NativeSampler] = chains) -> list[int]:
                out = []
                for i, sampler in enumerate(chains):
                    kept, selected = sampler.draw(context, i)  # type: ignore[arg-type]
                    out.append(int(kept["id"][selected]))
                return out

            def host_step(hosts: list[NativeSampler] = hosts, n: int = n) -> list[int]:
                return sample_on_host(hosts, list(block[:n]))

            result = compare(f"random-{WIDE_VOCAB} {mix} N={n}", chain_step, host_step, args)
            results.append({"vocab": WIDE_VOCAB, "mix": mix, "n": n, **result})
            for s in chains + hosts:
                s.close()
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--json-out", type=Path, help="also write the JSON report here")
    parser.add_argument("--model", type=Path, help="GGUF (default: SmolLM2)")
    parser.add_argument("--n", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mixes", nargs="+", choices=list(MIXES), default=list(MIXES))
    args = parser.parse_args(argv)
    load = load_average()
    with stdout_to_stderr() as stdout:
        results = smollm2(args, args.n) + wide(args, args.n)
        report = {
            "config": {
                "cpu": cpu_model(),
                "n": args.n,
                "steps": args.steps,
                "repeats": args.repeats,
                "mixes": {m: MIXES[m] for m in args.mixes},
                "load_average_before": load,
                "load_average_after": load_average(),
            },
            "results": results,
        }
        emit_report(report, stdout, args.json_out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
