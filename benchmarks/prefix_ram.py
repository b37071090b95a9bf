"""Host-RAM prefix tier benchmark: 24 long system prompts cycled through a small KV cache.

Twenty-four ChatML prompts each open with a distinct system prompt of about 1,200 tokens
and end with a short user turn (a different one each round). They are sent one at a time,
round after round, to a context whose KV holds only about three of them
(``n_ctx=4096, n_seq_max=2``), so by the time a system prompt comes back its slot was
evicted long ago. Each request streams ``MAX_TOKENS`` greedy tokens (end of generation
banned). Systems, each run on a thread of its own, one after another:

``llamax_ram``
    ``llamax.Context(prefix_ram_bytes=RAM_BYTES)``: an evicted system prompt's KV state
    waits in host RAM and is restored on its next turn (docs/prefix_ram.md).
``llamax_noram``
    The same context with ``prefix_ram_bytes=0``: the system prompt is computed again.
``llama_server_cache_ram``
    ``llama-server -np 2 -c 4096 --cache-ram RAM_MIB`` (its host-memory prompt cache),
    requests with ``cache_prompt: true``, streamed over ``/completion``.

Round 0 is cold everywhere (every system prompt is new); the later rounds are repeat hits.
Per system and repeat round: TTFT p50/p95; their medians over rounds. Ratio
``llamax_ram.hit_ttft_p50 / llamax_noram.hit_ttft_p50`` (target <= 1/3). Greedy agreement
of ``llamax_ram`` with ``llamax_noram`` (token ids) on every request; where they part, a
cold probe's logprobs of the two picks (a near tie is < 0.1 nats apart, as in the tests).
Those two compute the repeat's user turn in different batch shapes (one chunk after the
restored prefix; inside the last chunk of a whole prefill), so they may part. The exact
check is ``restores_identical_to_kv_hits``: each repeat served as a KV hit of the same
prefix (computed the same way, the user turn then computed alone) on the same context
settings must give the very tokens the restore gave.

::

    .venv/bin/python benchmarks/prefix_ram.py --quick
    .venv/bin/python benchmarks/prefix_ram.py --rounds 4 --json-out prefix_ram.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import llama_cpp
from _common import (
    N_THREADS,
    add_common_args,
    base_config,
    emit_report,
    greedy,
    in_fresh_thread,
    load_average,
    log,
    model_path,
    percentile,
    ratio,
    stdout_to_stderr,
    targets,
    text_of_tokens,
)
from _loops import load_model, tokenize
from _peers import LlamaServerPeer, default_llama_server

import llamax

N_SYSTEMS, SYSTEM_TOKENS, MAX_TOKENS = 24, 1200, 8
N_CTX, N_SEQ_MAX = 4096, 2
RAM_BYTES = 2 << 30
LIMITS = {"llamax_ram_hit_ttft_p50_over_noram": 1 / 3}
USER_TURNS = (
    "Hi! What can you help me with today?",
    "Please summarise your main guideline in one sentence.",
    "Which guideline matters most for a new customer?",
    "Thanks. Anything else I should know?",
)

Timed = tuple[float, tuple[int, ...], str]  # TTFT, token ids, text
Runner = Callable[[str], Timed]


def build_prompts(model: Path) -> tuple[list[str], list[int]]:
    """The 24 system turns (vocabulary-only load) and their token counts."""
    vocab_model = load_model(model, vocab_only=True)
    try:
        vocab = llama_cpp.llama_model_get_vocab(vocab_model)
        systems = []
        for i in range(N_SYSTEMS):
            head = f"You are assistant {i + 1} of {N_SYSTEMS}, for the department number {i + 1}."
            label = f"Rule {chr(65 + i)}"
            count = lambda text: len(tokenize(vocab, _system_turn(text)))  # noqa: E731
            systems.append(_system_turn(text_of_tokens(count, SYSTEM_TOKENS, head, label)))
        lengths = [len(tokenize(vocab, s)) for s in systems]
    finally:
        llama_cpp.llama_model_free(vocab_model)
    return systems, lengths


def _system_turn(text: str) -> str:
    return f"<|im_start|>system\n{text}<|im_end|>\n"


def prompt(system: str, round_index: int) -> str:
    """``system`` followed by this round's user turn."""
    user = USER_TURNS[round_index % len(USER_TURNS)]
    return f"{system}<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def llamax_runner(ctx: llamax.Context) -> Runner:
    def run(text: str) -> Timed:
        started = time.perf_counter()
        handle = ctx.add_request(text, greedy(MAX_TOKENS))
        first = None
        for _event in handle:
            first = first or time.perf_counter()
        done = handle.result()
        assert first is not None
        return first - started, done.token_ids, done.text

    return run


def server_runner(peer: LlamaServerPeer) -> Runner:
    def run(text: str) -> Timed:
        started = time.perf_counter()
        first, pieces = None, []
        for piece in peer.stream(text, MAX_TOKENS):
            first = first or time.perf_counter()
            pieces.append(piece)
        assert first is not None
        return first - started, (), "".join(pieces)

    return run


def cycle(run: Runner, systems: list[str], rounds: int) -> list[list[Timed]]:
    """Every system prompt once per round, one request at a time."""
    run("<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n")  # warm-up
    results = []
    for r in range(rounds):
        results.append([run(prompt(s, r)) for s in systems])
        log(f"  round {r}: TTFT p50 {statistics.median(t for t, _, _ in results[-1]):.3f}s")
    return results


def run_llamax(model: Path, systems: list[str], rounds: int, ram: int) -> tuple[Any, Any]:
    with llamax.Context(
        model, n_ctx=N_CTX, n_seq_max=N_SEQ_MAX, n_threads=N_THREADS, prefix_ram_bytes=ram
    ) as ctx:
        results = cycle(llamax_runner(ctx), systems, rounds)
        stats = ctx.stats()
    tier = {
        "ram_bytes": stats.prefix_ram_bytes,
        "ram_entries": stats.prefix_ram_entries,
        "stores": stats.num_prefix_ram_stores,
        "hits": stats.num_prefix_ram_hits,
        "restores": stats.num_prefix_ram_restores,
        "refused": stats.num_prefix_ram_refused,
        "restored_tokens": stats.num_prefix_ram_tokens,
        "restore_seconds": round(stats.prefix_ram_restore_seconds, 4),
        "prefill_tokens": stats.num_prefill_tokens,
        "cached_tokens": stats.num_cached_tokens,
    }
    return results, tier


def run_kv_hits(model: Path, systems: list[str], rounds: int) -> list[list[tuple[int, ...]]]:
    """The repeat rounds' outputs when each is a KV hit instead of a restore: the same
    context, each system prompt's cold round-0 prompt and then its repeat prompt at once,
    so the prefix was computed exactly as ``llamax_ram`` computed it before storing it, and
    the repeat computes only its user turn, as after a restore. A restore puts back the
    very K/V values, so the outputs must be identical token for token."""
    with llamax.Context(
        model, n_ctx=N_CTX, n_seq_max=N_SEQ_MAX, n_threads=N_THREADS, prefix_ram_bytes=0
    ) as ctx:
        run = llamax_runner(ctx)
        run("<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n")  # as cycle() does
        outputs: list[list[tuple[int, ...]]] = [[] for _ in range(1, rounds)]
        for system in systems:
            run(prompt(system, 0))
            for r in range(1, rounds):
                outputs[r - 1].append(run(prompt(system, r))[1])
    return outputs


def run_server(binary: Path, model: Path, systems: list[str], rounds: int) -> Any:
    peer = LlamaServerPeer(
        binary,
        model,
        n_parallel=N_SEQ_MAX,
        n_ctx=N_CTX,
        extra_args=["--cache-ram", str(RAM_BYTES >> 20)],
        cache_prompt=True,
    )
    try:
        return cycle(server_runner(peer), systems, rounds)
    finally:
        peer.close()


NEAR_TIE_NATS = 0.1
"""tests/near_tie.py's rule: two greedy picks closer than this on a cold probe are a tie
that llama.cpp's batch-shape rounding may break either way."""


def probe_partings(
    model: Path, texts: list[str], pairs: list[tuple[Timed, Timed]]
) -> list[dict[str, Any]]:
    """Where ``llamax_ram`` and ``llamax_noram`` part, the two picks' logprobs on a cold
    probe of the common prefix (a fresh context, nothing cached, computed whole)."""
    partings: list[dict[str, Any]] = []
    differing = [i for i, (a, b) in enumerate(pairs) if a[1] != b[1]]
    if not differing:
        return partings
    params = llamax.SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)
    with llamax.Context(
        model, n_ctx=N_CTX, n_seq_max=N_SEQ_MAX, n_threads=N_THREADS, prefix_ram_bytes=0
    ) as probe:
        for i in differing:
            ram_ids, noram_ids = pairs[i][0][1], pairs[i][1][1]
            at = next(
                (k for k, (x, y) in enumerate(zip(ram_ids, noram_ids, strict=False)) if x != y),
                min(len(ram_ids), len(noram_ids)),
            )
            tokens = probe.tokenize(texts[i]) + list(noram_ids[:at])
            done = probe.add_request(tokens, params).result()
            probe.clear_cache()
            logprobs = done.choices[0].logprobs or ()
            top = {t.token_id: t.logprob for t in logprobs[0].top_logprobs} if logprobs else {}
            picks = [ids[at] if at < len(ids) else None for ids in (ram_ids, noram_ids)]
            known = [top[p] for p in picks if p in top]
            margin = abs(known[0] - known[1]) if len(known) == 2 else None
            partings.append({
                "request": i, "at_token": at, "picks": picks,
                "margin_nats": None if margin is None else round(margin, 4),
                "near_tie": margin is not None and margin < NEAR_TIE_NATS,
            })  # fmt: skip
            log(f"  request {i} parts at token {at}: {partings[-1]}")
    return partings


def summary(results: list[list[Timed]]) -> dict[str, Any]:
    """TTFT of the cold round and of every repeat round (p50/p95), and their medians."""
    ttft = [[t for t, _, _ in round_] for round_ in results]
    repeats = [
        {"p50": round(percentile(r, 0.5), 4), "p95": round(percentile(r, 0.95), 4)}
        for r in ttft[1:]
    ]
    return {
        "cold_ttft_p50": round(percentile(ttft[0], 0.5), 4),
        "cold_ttft_p95": round(percentile(ttft[0], 0.95), 4),
        "hit_rounds": repeats,
        "hit_ttft_p50": round(statistics.median(r["p50"] for r in repeats), 4),
        "hit_ttft_p95": round(statistics.median(r["p95"] for r in repeats), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser)
    parser.add_argument("--rounds", type=int, default=3, help="rounds (the first is cold)")
    parser.add_argument("--quick", action="store_true", help="two rounds (one repeat)")
    parser.add_argument("--llama-server", type=Path, default=default_llama_server())
    parser.add_argument("--no-llama-server", action="store_true", help="skip llama-server")
    args = parser.parse_args()
    rounds = 2 if args.quick else max(2, args.rounds)
    load_at_start = load_average()
    with stdout_to_stderr() as stdout:
        model = model_path(args.model)
        systems, lengths = build_prompts(model)
        systems_report: dict[str, Any] = {}
        log("llamax_ram")
        ram, tier = in_fresh_thread(lambda: run_llamax(model, systems, rounds, RAM_BYTES))
        systems_report["llamax_ram"] = {**summary(ram), "tier": tier}
        log(json.dumps({"llamax_ram": systems_report["llamax_ram"]}))
        log("llamax_noram")
        noram, base = in_fresh_thread(lambda: run_llamax(model, systems, rounds, 0))
        systems_report["llamax_noram"] = {**summary(noram), "tier": base}
        log(json.dumps({"llamax_noram": systems_report["llamax_noram"]}))
        log("llamax_kv_hit (the repeats as KV hits, for the output check)")
        kv_hits = in_fresh_thread(lambda: run_kv_hits(model, systems, rounds))
        restored = [[ids for _, ids, _ in round_] for round_ in ram[1:]]
        same_as_kv_hit = sum(
            a == b for ra, rb in zip(restored, kv_hits, strict=True)
            for a, b in zip(ra, rb, strict=True)
        )  # fmt: skip
        log(f"  restores identical to KV hits: {same_as_kv_hit} of {N_SYSTEMS * (rounds - 1)}")
        if args.llama_server is not None and not args.no_llama_server:
            log("llama_server_cache_ram")
            server = in_fresh_thread(lambda: run_server(args.llama_server, model, systems, rounds))
            systems_report["llama_server_cache_ram"] = summary(server)
        pairs = [
            (a, b) for ra, rb in zip(ram, noram, strict=True) for a, b in zip(ra, rb, strict=True)
        ]
        same = sum(a[1] == b[1] for a, b in pairs)
        texts = [prompt(system, r) for r in range(rounds) for system in systems]
        partings = in_fresh_thread(lambda: probe_partings(model, texts, pairs))
        ratios = {
            "llamax_ram_hit_ttft_p50_over_noram": ratio(
                systems_report["llamax_ram"]["hit_ttft_p50"],
                systems_report["llamax_noram"]["hit_ttft_p50"],
            ),
        }
        if "llama_server_cache_ram" in systems_report:
            ratios["llamax_ram_hit_ttft_p50_over_llama_server"] = ratio(
                systems_report["llamax_ram"]["hit_ttft_p50"],
                systems_report["llama_server_cache_ram"]["hit_ttft_p50"],
            )
        report = {
            "benchmark": "prefix_ram",
            "config": base_config(
                args,
                load_at_start,
                n_ctx=N_CTX,
                n_seq_max=N_SEQ_MAX,
                max_tokens=MAX_TOKENS,
                ram_bytes=RAM_BYTES,
                rounds=rounds,
            ),
            "workload": {
                "num_systems": N_SYSTEMS,
                "system_turn_tokens": {"min": min(lengths), "max": max(lengths)},
                "requests": N_SYSTEMS * rounds,
            },
            "systems": systems_report,
            "ratios": ratios,
            "targets": targets(ratios, LIMITS, at_least=False),
            "restores_identical_to_kv_hits": {
                "identical": same_as_kv_hit,
                "repeats": N_SYSTEMS * (rounds - 1),
            },
            "greedy_agreement": {
                "same_token_ids": same,
                "requests": len(pairs),
                "partings": partings,
                "all_partings_near_ties": all(p["near_tie"] for p in partings),
            },
        }
        emit_report(report, stdout, args.json_out)


if __name__ == "__main__":
    main()
