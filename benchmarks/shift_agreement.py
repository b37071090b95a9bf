"""How closely a shifted chat follows a cold prefill of the shortened conversation.

Runs chat_shift.py's 60-turn conversation (n_ctx=2048, greedy, 64 new tokens) twice: with
the history shift and with re-prefill after each drop (a Chat whose ``_shift`` returns 0).
Then, for every turn, it prefills the exact conversation that turn answered in a fresh,
cold context (prefix cache off) and compares the greedy reply tokens. The report gives,
for each chat and separately for turns with and without a drop: how many turns agree with
the cold reply on their first 16 tokens (or all of a shorter reply), how many agree
entirely, and where the others first differ.

The control matters: turns *before* any drop also differ from a cold prefill now and then,
because a history prefilled turn by turn runs in other batch shapes than one big prefill.

::

    .venv/bin/python benchmarks/shift_agreement.py --json-out agreement.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import _common as bench
from _chat import SYSTEM, Message, ReprefillChat, user_messages
from chat_shift import MAX_TOKENS, N_CTX

import llamax

AGREE = 16


def chat_run(ctx: llamax.Context, *, shift: bool, turns: int) -> list[dict[str, Any]]:
    """One chat; per turn the conversation it answered, its reply tokens and its stats."""
    params = llamax.SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    chat = ctx.chat(system=SYSTEM, params=params) if shift else ReprefillChat(ctx, SYSTEM, params)
    out = []
    for k, text in enumerate(user_messages(turns)):
        reply = chat.send(text)
        stats = chat.last_turn
        assert stats is not None
        sent: list[Message] = list(chat.messages[:-1])
        out.append(
            {
                "turn": k,
                "sent": sent,
                "tokens": list(reply.token_ids),
                "dropped": stats.dropped_messages,
                "shifted": stats.shifted_tokens,
                "computed": stats.computed_tokens,
            }
        )
        bench.log(f"  turn {k}: dropped={stats.dropped_messages}")
    chat.close()
    return out


def cold_reply(ctx: llamax.Context, sent: list[Message]) -> list[int]:
    """Greedy reply to ``sent`` from an empty cache."""
    ctx.clear_cache()
    params = llamax.SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0, stop_token_ids=ctx.end_of_turn_token_ids
    )
    return list(ctx.add_request(ctx.chat_prompt(sent), params).result().token_ids)


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Agreement counts over ``rows`` (each with ``agreed`` and ``length``)."""
    ok = [r for r in rows if r["agreed"] >= min(AGREE, r["length"])]
    full = [r for r in rows if r["agreed"] == r["length"]]
    return {
        "turns": len(rows),
        f"agree_first_{AGREE}": len(ok),
        "agree_entirely": len(full),
        "first_difference_of_the_others": sorted(
            r["agreed"] for r in rows if r["agreed"] < min(AGREE, r["length"])
        ),
        "median_agreed_tokens": statistics.median(r["agreed"] for r in rows) if rows else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    bench.add_common_args(parser)
    parser.add_argument("--turns", type=int, default=60)
    args = parser.parse_args()
    args.model = bench.model_path(args.model)
    load = bench.load_average()
    with bench.stdout_to_stderr() as stdout:
        report = measure(args)
        report["config"] = bench.base_config(args, load, n_ctx=N_CTX, max_tokens=MAX_TOKENS)
        bench.emit_report(report, stdout, args.json_out)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Both chats, then every turn's cold reply; the agreement summaries."""
    started = time.perf_counter()
    report: dict[str, Any] = {}
    with llamax.Context(args.model, n_ctx=N_CTX, n_seq_max=2) as ctx:
        runs = {
            "shift": chat_run(ctx, shift=True, turns=args.turns),
            "reprefill": chat_run(ctx, shift=False, turns=args.turns),
        }
        ctx.clear_cache()
        with llamax.Context(args.model, n_ctx=N_CTX, n_seq_max=1, prefix_cache=False) as cold:
            for name, turns in runs.items():
                for t in turns:
                    want = cold_reply(cold, t["sent"])
                    t["agreed"] = bench.common_prefix_len(want, t["tokens"])
                    t["length"] = max(len(want), len(t["tokens"]))
                    bench.log(f"  {name} turn {t['turn']}: agreed {t['agreed']}")
        for name, turns in runs.items():
            first_drop = next((t["turn"] for t in turns if t["dropped"]), len(turns))
            report[name] = {
                "first_turn_with_a_drop": first_drop,
                "shifted_turns": sum(1 for t in turns if t["shifted"]),
                "turns_with_a_drop": summarize([t for t in turns if t["dropped"]]),
                "turns_without_a_drop": summarize([t for t in turns[1:] if not t["dropped"]]),
                "first_turn": summarize(turns[:1]),
            }
    report["wall_s"] = round(time.perf_counter() - started, 1)
    return report


if __name__ == "__main__":
    main()
