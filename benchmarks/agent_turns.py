"""Multi-turn agent workload (issue 40): what each turn recomputes, with and without checkpoints.

``--conversations`` agents (default 4) run at once, each a ``--turns``-turn chat (default
12): a system prompt of about 300 tokens, then per turn a tool result of about
``--turn-tokens`` tokens (default 200) as the user message and a greedy reply of
``--max-tokens`` tokens (default 24, end-of-generation ignored), so the context grows to
about 3,000 tokens. Each turn's prompt is the whole conversation rendered with the model's
chat template (``Context.chat_prompt``), as a chat client sends it, so the reply comes back
re-tokenized from its text: where that differs from the tokens generated, the cache can
reuse only up to the turn's start.

Systems, per model (each built, run and freed in turn; ``N_THREADS`` threads):

``llamax``
    ``llamax.Context(n_ctx, n_seq_max=conversations)``: prefix reuse, on a recurrent or
    hybrid model through checkpoints (docs/kv-cache.md).
``llamax_nocache``
    the same with ``prefix_cache=False``: every turn computes its whole prompt (what
    llamax did for recurrent and hybrid models before checkpoints).
``llama_server``
    with ``--llama-server PATH`` (``benchmarks/peers.sh`` builds one from the vendored
    llama.cpp): ``-np conversations -c n_ctx`` and its default context checkpoints,
    ``cache_prompt: true``, the same rendered prompts on ``/completion``.

``--interleave`` (with ``--llama-server``, one conversation): llamax and llama-server
run the same conversation turn by turn, both alive at once, which of the two goes first
alternating each turn, so that a machine whose speed drifts between sittings (15-20% within
an hour on the 2-core VMs, issue 59) slows both alike; ``wall_s`` is then the time in the
system's own turns, and ``llamax_nocache`` is not run.

Models: ``--model`` (default SmolLM2; ``--skip-default`` skips it) and ``--memory-kind``
(default ``hybrid``: a random LFM2 written by ``scripts/make_memory_model.py``;
``hybrid_350m``: the same in LFM2-350M's shape; ``none`` skips it). ``--nocache-turns N``
runs ``llamax_nocache`` for N turns only (on the 350M shape its 12 turns take ~15 minutes);
the TTFT ratios then cover turns 4 to N of each system. Per system, model and
turn: the median over conversations of the prompt tokens computed (llamax: ``prompt -
cached``; llama-server: ``timings.prompt_n``) and of the TTFT; and the median TTFT from
turn 4 on against ``llamax_nocache``'s and llama-server's. Per system and model also the
gaps between a reply's streamed tokens over every turn (``gap_p95_s``, ``gap_worst_s``):
how long a reply waits while other conversations' prompts are computed.

::

    .venv/bin/python benchmarks/agent_turns.py --json-out agent_turns.json
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _common import (
    N_THREADS,
    add_common_args,
    base_config,
    emit_report,
    filler_sentences,
    load_average,
    load_script,
    log,
    model_path,
    ratio,
    stdout_to_stderr,
)

import llamax

Turn = tuple[int, int, float, list[float]]
"""One turn of one conversation: prompt tokens, tokens computed, TTFT in seconds, and the
seconds between the reply's streamed tokens."""
Submit = Callable[[int, list[int]], tuple[list[int], int, float, list[float]]]
"""``(conversation, prompt tokens) -> (reply tokens, tokens computed, TTFT, gaps)``."""


def _tool_result(conversation: int, turn: int, count: Callable[[str], int], target: int) -> str:
    lines = [f"Tool result {turn + 1} for agent {conversation + 1}:"]
    sentences = filler_sentences(f"Record {conversation}.{turn}")
    while count("\n".join(lines)) < target:
        lines.append(next(sentences))
    return "\n".join(lines)


def system_prompt() -> str:
    """The agents' system message (about 300 tokens)."""
    return "\n".join(
        ["You are an operations agent. Follow the handbook below."]
        + [s for _, s in zip(range(14), filler_sentences("Rule"), strict=False)]
    )


def run_conversations(
    ctx: llamax.Context, submit: Submit, args: argparse.Namespace
) -> list[list[Turn]]:
    """Every conversation at once, one thread each; each conversation's turns in order."""
    system = system_prompt()

    def count(text: str) -> int:
        return len(ctx.tokenize(text, add_special=False))

    turns: list[list[Turn]] = [[] for _ in range(args.conversations)]
    errors: list[BaseException] = []

    def one(c: int) -> None:
        try:
            messages: list[dict[str, str]] = [{"role": "system", "content": system}]
            for t in range(args.turns):
                messages.append(
                    {"role": "user", "content": _tool_result(c, t, count, args.turn_tokens)}
                )
                prompt = ctx.chat_prompt(messages)
                reply, computed, ttft, gaps = submit(c, prompt)
                turns[c].append((len(prompt), computed, ttft, gaps))
                messages.append({"role": "assistant", "content": ctx.detokenize(reply)})
        except BaseException as exc:  # re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(c,)) for c in range(args.conversations)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return turns


def llamax_submit(ctx: llamax.Context, max_tokens: int) -> Submit:
    params = llamax.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    def submit(_c: int, prompt: list[int]) -> tuple[list[int], int, float, list[float]]:
        start = time.perf_counter()
        handle = ctx.add_request(prompt, params)
        ttft = None
        times: list[float] = []
        for _ in handle:
            times.append(time.perf_counter())
            if ttft is None:
                ttft = times[-1] - start
        done = handle.result(timeout=600)
        usage = done.usage
        computed = usage.prompt_tokens - usage.cached_tokens
        return done.token_ids, computed, ttft or 0.0, _gaps(times)

    return submit


def server_submit(port: int, max_tokens: int) -> Submit:
    def submit(_c: int, prompt: list[int]) -> tuple[list[int], int, float, list[float]]:
        body = {
            "prompt": prompt,
            "n_predict": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "cache_prompt": True,
            "stream": True,
            "return_tokens": True,
        }
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        start = time.perf_counter()
        ttft = None
        tokens: list[int] = []
        times: list[float] = []
        computed = len(prompt)
        try:
            conn.request("POST", "/completion", json.dumps(body))
            response = conn.getresponse()
            if response.status != 200:
                raise RuntimeError(f"llama-server answered {response.status}")
            for line in response:
                if not line.startswith(b"data: "):
                    continue
                event = json.loads(line[6:])
                if event.get("tokens"):
                    times.append(time.perf_counter())
                if ttft is None:
                    ttft = time.perf_counter() - start
                tokens.extend(event.get("tokens") or [])
                if event.get("stop"):
                    timings = event.get("timings") or {}
                    computed = int(timings.get("prompt_n", computed))
                    break
        finally:
            conn.close()
        return tokens, computed, ttft or 0.0, _gaps(times)

    return submit


def _gaps(times: list[float]) -> list[float]:
    """The seconds between a reply's consecutive streamed tokens."""
    return [later - earlier for earlier, later in itertools.pairwise(times)]


def summarize(turns: list[list[Turn]]) -> dict[str, Any]:
    """Per turn: the medians over conversations (prompt tokens, tokens computed, TTFT)."""
    per_turn = []
    for t in range(len(turns[0])):
        column = [conversation[t] for conversation in turns]
        per_turn.append(
            {
                "turn": t + 1,
                "prompt_tokens": statistics.median(c[0] for c in column),
                "computed_tokens": statistics.median(c[1] for c in column),
                "ttft_s": round(statistics.median(c[2] for c in column), 4),
            }
        )
    late = [p for p in per_turn if p["turn"] >= 4]
    gaps = sorted(g for conversation in turns for c in conversation for g in c[3])
    return {
        "per_turn": per_turn,
        # between a reply's tokens: what a turn's prompt beside the others' decoding costs them
        "gap_p95_s": round(gaps[int(0.95 * (len(gaps) - 1))], 4) if gaps else None,
        "gap_worst_s": round(gaps[-1], 4) if gaps else None,
        "computed_by_conversation": [[c[1] for c in conversation] for conversation in turns],
        "computed_tokens_total": sum(c[1] for conversation in turns for c in conversation),
        "ttft_median_from_turn_4_s": round(statistics.median(p["ttft_s"] for p in late), 4),
    }


def median_ttft(result: dict[str, Any], last_turn: int) -> float:
    """The median per-turn TTFT of ``result`` over turns 4 to ``last_turn``."""
    late = [p["ttft_s"] for p in result["per_turn"] if 4 <= p["turn"] <= last_turn]
    return round(statistics.median(late), 4)


def run_llamax(path: Path, args: argparse.Namespace, *, cache: bool) -> dict[str, Any]:
    with llamax.Context(
        path,
        n_ctx=args.n_ctx,
        n_seq_max=args.conversations,
        n_threads=N_THREADS,
        prefix_cache=cache,
        kv_layout=args.kv_layout,
        **step_budget(args),
    ) as ctx:
        started = time.perf_counter()
        turns = run_conversations(ctx, llamax_submit(ctx, args.max_tokens), args)
        out = summarize(turns)
        stats = ctx.stats()
        out |= {
            "wall_s": round(time.perf_counter() - started, 2),
            "num_checkpoints": stats.num_checkpoints,
            "num_checkpoint_restores": stats.num_checkpoint_restores,
            "checkpoint_bytes": stats.checkpoint_bytes,
        }
        return out


def step_budget(args: argparse.Namespace) -> dict[str, Any]:
    """``max_step_ms`` for llamax.Context when ``--max-step-ms`` is given (0: None)."""
    ms = getattr(args, "max_step_ms", None)
    if ms is None:
        return {}
    return {"max_step_ms": ms or None}


def run_interleaved(binary: Path, path: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One conversation on llamax and on llama-server, turn by turn (``--interleave``):
    each turn goes to both, the first of the two alternating; per system its summary, with
    ``wall_s`` the time in its own turns."""
    sys.path.insert(0, str(Path(__file__).parent))
    from _peers import LlamaServerPeer

    peer = LlamaServerPeer(binary, path, n_parallel=1, n_ctx=args.n_ctx, cache_prompt=True)
    try:
        with llamax.Context(
            path,
            n_ctx=args.n_ctx,
            n_seq_max=1,
            n_threads=N_THREADS,
            kv_layout=args.kv_layout,
            **step_budget(args),
        ) as ctx:
            submits = {
                "llamax": llamax_submit(ctx, args.max_tokens),
                "llama_server": server_submit(peer.port, args.max_tokens),
            }
            messages = {name: [{"role": "system", "content": system_prompt()}] for name in submits}
            turns: dict[str, list[Turn]] = {name: [] for name in submits}
            walls = dict.fromkeys(submits, 0.0)

            def count(text: str) -> int:
                return len(ctx.tokenize(text, add_special=False))

            for t in range(args.turns):
                user = _tool_result(0, t, count, args.turn_tokens)
                order = list(submits) if t % 2 == 0 else list(reversed(submits))
                for name in order:
                    history = messages[name]
                    history.append({"role": "user", "content": user})
                    prompt = ctx.chat_prompt(history)
                    start = time.perf_counter()
                    reply, computed, ttft, gaps = submits[name](0, prompt)
                    walls[name] += time.perf_counter() - start
                    turns[name].append((len(prompt), computed, ttft, gaps))
                    history.append({"role": "assistant", "content": ctx.detokenize(reply)})
        return {
            name: summarize([turns[name]]) | {"wall_s": round(walls[name], 2)} for name in submits
        }
    finally:
        peer.close()


def run_server(binary: Path, path: Path, args: argparse.Namespace) -> dict[str, Any]:
    sys.path.insert(0, str(Path(__file__).parent))
    from _peers import LlamaServerPeer

    peer = LlamaServerPeer(
        binary, path, n_parallel=args.conversations, n_ctx=args.n_ctx, cache_prompt=True
    )
    try:
        with llamax.Context(path, n_ctx=512, n_seq_max=1, n_threads=1) as tokenizer:
            started = time.perf_counter()
            turns = run_conversations(tokenizer, server_submit(peer.port, args.max_tokens), args)
        return summarize(turns) | {"wall_s": round(time.perf_counter() - started, 2)}
    finally:
        peer.close()


def memory_model(kind: str, tokenizer_from: Path, folder: Path) -> Path:
    path: Path = load_script("make_memory_model").write_memory_model(
        folder / f"{kind}.gguf", kind=kind, tokenizer_from=tokenizer_from
    )
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser)
    parser.add_argument(
        "--memory-kind", default="hybrid", choices=("hybrid", "hybrid_350m", "recurrent", "none")
    )
    parser.add_argument("--skip-default", action="store_true", help="run the memory model only")
    parser.add_argument(
        "--nocache-turns",
        type=int,
        help="turns of llamax_nocache (default: --turns); ratios then cover turns 4 to this",
    )
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=12)
    parser.add_argument("--turn-tokens", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--n-ctx", type=int, default=16384)
    parser.add_argument(
        "--kv-layout",
        default="auto",
        choices=("auto", "unified", "streams"),
        help="llamax's kv_layout (auto adapts a hybrid as a plain model, keeps a recurrent "
        "or sliding-window one unified)",
    )
    parser.add_argument("--llama-server", type=Path, help="a llama-server binary (peers.sh)")
    parser.add_argument(
        "--max-step-ms",
        type=float,
        help="llamax's max_step_ms (0: None, fixed n_batch chunks; default: llamax's own)",
    )
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="one conversation on llamax and llama-server turn by turn (needs --llama-server)",
    )
    parser.add_argument(
        "--llama-server-first",
        action="store_true",
        help="run llama-server before llamax (to alternate the order between runs)",
    )
    args = parser.parse_args()
    if args.interleave and (args.llama_server is None or args.conversations != 1):
        parser.error("--interleave needs --llama-server and --conversations 1")
    load_at_start = load_average()
    with stdout_to_stderr() as stdout, tempfile.TemporaryDirectory() as folder:
        smol = model_path(args.model)
        models = {} if args.skip_default else {"default": smol}
        if args.memory_kind != "none":
            models[args.memory_kind] = memory_model(args.memory_kind, smol, Path(folder))
        results: dict[str, Any] = {}
        for name, path in models.items():
            row: dict[str, Any] = {}
            if args.interleave:
                log(f"{name}: llamax and llama-server, turn by turn")
                row = run_interleaved(args.llama_server, path, args)
                row["ratios"] = {
                    "llamax_ttft_from_turn_4_vs_llama_server": ratio(
                        row["llamax"]["ttft_median_from_turn_4_s"],
                        row["llama_server"]["ttft_median_from_turn_4_s"],
                    ),
                    "llamax_turn_time_vs_llama_server": ratio(
                        row["llamax"]["wall_s"], row["llama_server"]["wall_s"]
                    ),
                }
                results[name] = row
                continue
            if args.llama_server is not None and args.llama_server_first:
                log(f"{name}: llama-server")
                row["llama_server"] = run_server(args.llama_server, path, args)
            log(f"{name}: llamax")
            row["llamax"] = run_llamax(path, args, cache=True)
            log(f"{name}: llamax without the prefix cache")
            nocache_turns = min(args.nocache_turns or args.turns, args.turns)
            short = argparse.Namespace(**{**vars(args), "turns": nocache_turns})
            row["llamax_nocache"] = run_llamax(path, short, cache=False)
            if args.llama_server is not None and not args.llama_server_first:
                log(f"{name}: llama-server")
                row["llama_server"] = run_server(args.llama_server, path, args)
            base = median_ttft(row["llamax_nocache"], nocache_turns)
            row["ratios"] = {  # over the turns both ran: 4 to nocache_turns
                f"{system}_ttft_turns_4_to_{nocache_turns}_vs_nocache": ratio(
                    median_ttft(row[system], nocache_turns), base
                )
                for system in row
                if system != "llamax_nocache"
            }
            if "llama_server" in row:
                row["ratios"]["llamax_ttft_from_turn_4_vs_llama_server"] = ratio(
                    row["llamax"]["ttft_median_from_turn_4_s"],
                    row["llama_server"]["ttft_median_from_turn_4_s"],
                )
            results[name] = row
        emit_report(
            {"config": base_config(args, load_at_start), "results": results}, stdout, args.json_out
        )


if __name__ == "__main__":
    main()
