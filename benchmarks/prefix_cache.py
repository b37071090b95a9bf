"""Prefix-cache benchmark: 16 requests sharing a ~1,300-token system prompt, at once.

Sixteen ChatML prompts share one system prompt of about 1,300 tokens and each ends with
its own ~20-token question (each starting with a different word). Each request asks for 32
greedy tokens with the end-of-generation tokens banned. All requests are submitted at once.
Systems (2 threads each; each is built, warmed up, timed and freed on a thread of its own):

``ideal``
    ``_loops.RawLoop.generate_shared``: the prefix once on seq 0, ``llama_memory_seq_cp``
    to seqs 1..15, the 16 questions in one batch, then 16 sequences decoded together.
``llamax_cache`` / ``llamax_nocache``
    ``llamax.Context(n_ctx=8192, n_seq_max=16, n_threads=2)`` with ``prefix_cache`` on /
    off: 16 ``add_request`` calls, then every handle is waited for.
``llama_cpp_python``
    ``Llama`` + ``LlamaRAMCache``, ``create_completion(stream=True)`` one after another
    (Llama reuses the common prefix with its previous prompt, so it computes it once).

Per system: total wall time, TTFT p50/p95 from the common start, prompt tokens computed.
Ratios: ``llamax_cache.total / ideal.total`` (target <= 1.15), ``llamax_cache.ttft_p50 /
ideal.total`` (target <= 0.7) and speedups over the others; greedy-output agreement, also
against the first ``--alone`` prompts run alone on a fresh no-cache context.

::

    .venv/bin/python benchmarks/prefix_cache.py --repeats 3 --json-out prefix_cache.json

``--n-ctx 32768`` gives every one of the 16 sequences a stream of 2,048 cells, which holds
the whole prompt: the default ``kv_layout="auto"`` then starts in streams, where a prefix hit
copies a whole stream, and moves to the unified layout to share the prefix
(``llamax.engine.kv.layout_policy``). The default 8,192 gives streams of 512 cells, which the
prompt outgrows, so the burst is unified from the start.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import llama_cpp
from _common import (
    N_THREADS,
    TokenTimes,
    add_common_args,
    agreement,
    base_config,
    common_prefix_len,
    emit_report,
    greedy,
    in_fresh_thread,
    load_average,
    log,
    model_path,
    ratio,
    spread,
    stats_delta,
    stdout_to_stderr,
    targets,
    text_of_tokens,
)
from _loops import RawLoop, load_model, tokenize
from _peers import LlamaCppPythonPeer

import llamax

N_REQUESTS, MAX_TOKENS, N_CTX, N_SEQ_MAX, N_BATCH = 16, 32, 8192, 16, 512
KV_LAYOUT = "auto"  # llamax's (--kv-layout); the ideal loop is unified
LLAMAX_OPTIONS: dict[str, Any] = {}  # more Context options for llamax's runs (--llamax-option)
LCP_N_CTX = 2048  # one sequence at a time: prompt (~1,330) + 32 tokens fit
SYSTEM_PROMPT_TOKENS, WARMUP_TOKENS = 1300, 4
LIMITS = {
    "llamax_cache_total_over_ideal_total": 1.15,
    "llamax_cache_ttft_p50_over_ideal_total": 0.7,
}
IDEAL, CACHE, NOCACHE, LCP = "ideal", "llamax_cache", "llamax_nocache", "llama_cpp_python"
SYSTEM_NAMES = (IDEAL, CACHE, NOCACHE, LCP)
HEAD = (
    "You are the support assistant of the Northwind Lighthouse Company. "
    "Answer customers briefly and follow every guideline below."
)
QUESTIONS = (
    "What is the fastest way to reset my account password if I lost access to my email?",
    "How do I change the shipping address on an order that is confirmed but not shipped?",
    "Why was my credit card charged twice for a single subscription renewal last month?",
    "Can you explain the difference between the standard warranty and the protection plan?",
    "Which lamp models are compatible with the new solar charging kit released this spring?",
    "Where can I find the installation manual for the coastal beacon model in Spanish?",
    "When will the replacement parts for my broken fog horn arrive if I order them today?",
    "Should I pick the annual plan or the monthly plan if I only visit the coast in summer?",
    "Is it possible to transfer my membership benefits to a family member living abroad?",
    "Do you offer discounts for schools, museums or charities that run educational tours?",
    "Please describe the steps to return a lantern that arrived with a cracked glass cover.",
    "Tell me how loyalty points are calculated and when exactly they expire each year.",
    "Could a technician visit my site next week to inspect the rotating lens mechanism?",
    "Give me a short summary of your privacy policy about location data from the app.",
    "List the safety precautions I must follow before climbing the tower to clean the lamp.",
    "Are gift cards refundable if the person who received them never used the balance?",
)


def chatml_system(text: str) -> str:
    return f"<|im_start|>system\n{text}<|im_end|>\n"


def build_workload(model: Path) -> tuple[list[str], dict[str, Any]]:
    """The 16 prompts (built with a vocabulary-only load) and their description."""
    vocab_model = load_model(model, vocab_only=True)
    try:
        vocab = llama_cpp.llama_model_get_vocab(vocab_model)
        count = lambda text: len(tokenize(vocab, chatml_system(text)))  # noqa: E731
        system = text_of_tokens(count, SYSTEM_PROMPT_TOKENS, HEAD, "Guideline")
        prompts = [
            f"{chatml_system(system)}<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"
            for q in QUESTIONS[:N_REQUESTS]
        ]
        lists = [tokenize(vocab, p) for p in prompts]
        system_tokens = count(system)
    finally:
        llama_cpp.llama_model_free(vocab_model)
    shared = min(common_prefix_len(lists[0], t) for t in lists)
    suffixes = [len(t) - shared for t in lists]
    return prompts, {
        "num_requests": len(prompts),
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "system_turn_tokens": system_tokens,
        "shared_prefix_tokens": shared,
        "unshared_tokens_per_prompt": {"min": min(suffixes), "max": max(suffixes)},
        "prompt_tokens_total": sum(len(t) for t in lists),
        "min_prompt_tokens_to_compute": shared + sum(suffixes),
    }


@dataclass(frozen=True)
class RunResult:
    """One timed run of one system on every prompt."""

    total_s: float
    ttft_s: tuple[float, ...]
    prefill_tokens: int
    generated_tokens: int
    token_ids: tuple[tuple[int, ...], ...] = ()
    texts: tuple[str, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)
    cpu_s: float = 0.0  # process CPU time during the timed part

    def sample(self) -> dict[str, Any]:
        tokens = {"prefill_tokens": self.prefill_tokens, "generated_tokens": self.generated_tokens}
        return {
            "total_s": round(self.total_s, 4),
            **spread("ttft", self.ttft_s),
            **tokens,
            **self.extra,
        }


def run_llamax(model: Path, prompts: Sequence[str], *, prefix_cache: bool) -> RunResult:
    with llamax.Context(
        model,
        n_ctx=N_CTX,
        n_seq_max=N_SEQ_MAX,
        n_threads=N_THREADS,
        prefix_cache=prefix_cache,
        kv_layout=KV_LAYOUT,
        **LLAMAX_OPTIONS,
    ) as ctx:
        ctx.add_request("Hello there!", greedy(WARMUP_TOKENS)).result()
        ctx.clear_cache()
        before = ctx.stats()
        cpu, start = time.process_time(), time.perf_counter()
        handles = [ctx.add_request(p, greedy(MAX_TOKENS)) for p in prompts]
        timers = [TokenTimes(h) for h in handles]
        ttfts = tuple(t.wait()[0] - start for t in timers)
        completions = [h.result() for h in handles]
        total, cpu = time.perf_counter() - start, time.process_time() - cpu
        after = ctx.stats()
    return RunResult(
        total,
        ttfts,
        after.num_prefill_tokens - before.num_prefill_tokens,
        sum(c.usage.completion_tokens for c in completions),
        tuple(c.token_ids for c in completions),
        tuple(c.text for c in completions),
        stats_delta(before, after, ("steps", "cached_tokens", "preemptions")),
        cpu,
    )


def run_ideal(model: Path, prompts: Sequence[str]) -> RunResult:
    loop = RawLoop(model, n_ctx=N_CTX, n_seq_max=N_SEQ_MAX, n_batch=N_BATCH, n_ubatch=N_BATCH)
    try:
        loop.generate_shared(["<|im_start|>user\nHello there!<|im_end|>\n"], WARMUP_TOKENS)
        cpu, start = time.process_time(), time.perf_counter()
        out = loop.generate_shared(prompts, MAX_TOKENS)
        total, cpu = time.perf_counter() - start, time.process_time() - cpu
    finally:
        loop.close()
    generated = sum(len(t) for t in out.token_ids)
    return RunResult(total, out.ttft_s, out.prefill_tokens, generated, out.token_ids, cpu_s=cpu)


def run_lcp(model: Path, prompts: Sequence[str]) -> RunResult:
    peer = LlamaCppPythonPeer(model, LCP_N_CTX)
    try:
        peer.complete("Hello there!", WARMUP_TOKENS, time.perf_counter())
        peer.reset()
        peer.llm.set_cache(llama_cpp.LlamaRAMCache())
        cpu, start = time.process_time(), time.perf_counter()
        done = [peer.complete(p, MAX_TOKENS, start) for p in prompts]
        total, cpu = time.perf_counter() - start, time.process_time() - cpu
    finally:
        peer.close()
    return RunResult(
        total,
        tuple(c.ttft_s for c in done),
        sum(c.prefill_tokens for c in done),
        sum(c.generated_tokens for c in done),
        texts=tuple(c.text for c in done),
        cpu_s=cpu,
    )


RUNNERS: dict[str, Callable[[Path, Sequence[str]], RunResult]] = {
    IDEAL: run_ideal,
    CACHE: lambda m, p: run_llamax(m, p, prefix_cache=True),
    NOCACHE: lambda m, p: run_llamax(m, p, prefix_cache=False),
    LCP: run_lcp,
}


def run_once(name: str, model: Path, prompts: Sequence[str]) -> RunResult:
    """One system, on a thread of its own; adds its CPU share and the load average.

    ``cpu_share`` = process CPU time / (wall time x 2 threads) over the timed part: a low
    value means the run competed with other processes and its times are inflated.
    """
    result = in_fresh_thread(lambda: RUNNERS[name](model, prompts))
    share = round(result.cpu_s / (result.total_s * N_THREADS), 3)
    noise = {"cpu_share": share, "load_1min": load_average()[0]}
    return dataclasses.replace(result, extra={**result.extra, **noise})


def compare_outputs(runs: dict[str, list[RunResult]], alone: Sequence[Any]) -> dict[str, Any]:
    """Greedy-output agreement between systems (first repeat of each)."""
    first = {name: results[0] for name, results in runs.items() if results}
    out: dict[str, Any] = {}
    for a, b in [(CACHE, NOCACHE), (IDEAL, CACHE), (IDEAL, NOCACHE)]:
        if a in first and b in first:
            out[f"{a}_vs_{b}"] = agreement(first[a].token_ids, first[b].token_ids)
    for name in (CACHE, NOCACHE, IDEAL):
        if name in first and alone:
            out[f"{name}_vs_alone"] = agreement(first[name].token_ids, alone)
    if CACHE in first and LCP in first:
        out[f"{LCP}_vs_{CACHE}_text"] = agreement(first[LCP].texts, first[CACHE].texts)
    for name, results in runs.items():
        if len(results) > 1 and results[0].token_ids:
            out[f"{name}_same_across_repeats"] = all(
                r.token_ids == results[0].token_ids for r in results
            )
    return out


def summarize(results: Sequence[RunResult]) -> dict[str, Any]:
    """Medians over repeats, and every sample."""
    samples = [r.sample() for r in results]
    out: dict[str, Any] = {
        key: round(statistics.median(s[key] for s in samples), 4)
        for key in ("total_s", "ttft_p50_s", "ttft_p95_s")
    }
    out["prefill_tokens"] = int(statistics.median(r.prefill_tokens for r in results))
    return {**out, "generated_tokens": results[0].generated_tokens, "samples": samples}


def ratios(summary: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    def get(name: str, key: str) -> float | None:
        return summary.get(name, {}).get(key)

    out = {
        "llamax_cache_total_over_ideal_total": ratio(get(CACHE, "total_s"), get(IDEAL, "total_s")),
        "llamax_cache_ttft_p50_over_ideal_total": ratio(
            get(CACHE, "ttft_p50_s"), get(IDEAL, "total_s")
        ),
        "llamax_cache_ttft_p50_over_ideal_ttft_p50": ratio(
            get(CACHE, "ttft_p50_s"), get(IDEAL, "ttft_p50_s")
        ),
    }
    for other, label in ((NOCACHE, "nocache"), (LCP, "llama_cpp_python")):
        for key in ("total", "ttft_p50", "ttft_p95"):
            out[f"speedup_{key}_vs_{label}"] = ratio(get(other, f"{key}_s"), get(CACHE, f"{key}_s"))
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    add_common_args(parser)
    parser.add_argument("--repeats", type=int, default=1, help="runs per system (medians)")
    parser.add_argument("--alone", type=int, default=4, help="prompts also run alone (no cache)")
    parser.add_argument("--systems", nargs="+", choices=SYSTEM_NAMES, default=list(SYSTEM_NAMES))
    parser.add_argument(
        "--n-ctx", type=int, default=N_CTX, help="KV cells of llamax and the ideal loop"
    )
    parser.add_argument(
        "--kv-layout", default=KV_LAYOUT, choices=["auto", "unified", "streams"],
        help="llamax's KV layout (the ideal loop's is unified)",
    )  # fmt: skip
    parser.add_argument(
        "--llamax-option", action="append", default=[], metavar="NAME=JSON",
        help="one more llamax.Context option for llamax's runs, its value as JSON "
        "(reproducible=true, kv_type_v='\"q8_0\"'); repeatable",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.repeats < 1 or not 0 <= args.alone <= N_REQUESTS:
        parser.error(f"--repeats must be >= 1 and --alone in [0, {N_REQUESTS}]")
    args.model = model_path(args.model)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    global N_CTX, KV_LAYOUT  # the systems read them: one value per run
    args = parse_args(argv)
    N_CTX, KV_LAYOUT = args.n_ctx, args.kv_layout
    for option in args.llamax_option:
        name, _, value = option.partition("=")
        LLAMAX_OPTIONS[name] = json.loads(value)
    load = load_average()
    log(f"load average: {load}")
    with stdout_to_stderr() as stdout:
        prompts, workload = build_workload(args.model)
        names = [n for n in SYSTEM_NAMES if n in args.systems]
        runs: dict[str, list[RunResult]] = {name: [] for name in names}
        for repeat in range(args.repeats):
            for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
                runs[name].append(result := run_once(name, args.model, prompts))
                log(f"repeat {repeat + 1}/{args.repeats} {name}: {result.sample()}")
        alone = []
        if args.alone and (CACHE in names or NOCACHE in names):
            with llamax.Context(
                args.model,
                n_ctx=N_CTX,
                n_seq_max=N_SEQ_MAX,
                n_threads=N_THREADS,
                prefix_cache=False,
            ) as ctx:
                alone = [
                    ctx.add_request(p, greedy(MAX_TOKENS)).result().token_ids
                    for p in prompts[: args.alone]
                ]
        summary = {name: summarize(results) for name, results in runs.items()}
        r = ratios(summary)
        sizes = {"n_ctx": N_CTX, "n_seq_max": N_SEQ_MAX, "n_batch": N_BATCH,
                 "kv_layout": KV_LAYOUT, "llamax_options": LLAMAX_OPTIONS}  # fmt: skip
        config = base_config(args, load, **sizes, llama_cpp_python_n_ctx=LCP_N_CTX)
        report = {
            "config": config,
            "workload": workload,
            "systems": summary,
            "ratios": r,
            "targets": targets(r, LIMITS, at_least=False),
            "outputs": compare_outputs(runs, alone),
        }
        emit_report(report, stdout, args.json_out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
