"""How far batch composition moves greedy replies under random LoRA adapters, by strength.

For each adapter strength, 48 soak-style prompts (four adapter sets: none, ``{"a": 1}``,
``{"b": 0.5}``, ``{"a": 0.5, "b": 1}``) run batched in one context (64 sequences, prefix
cache on or off) and each reply is teacher-forced on a cold probe (one sequence, nothing
cached): a token's *regret* is how many nats the probe's best pick beats it by. With the
prefix cache off no KV is shared, so every regret is batch noise. Also reported: how many
LoRA replies the adapters change against the base model, and, as the scale of a wrong-KV
reply, the regret of a base reply scored under adapter ``a`` and of another prompt's reply.

The model soak (``tests/test_soak.py``) takes its adapter strength and its tolerance from
this::

    .venv/bin/python benchmarks/lora_noise.py --strengths 1.0 0.1 --json-out noise.json

Which layout makes the noise (``--layouts``; ``--requests`` more than 64 puts decode
steps on ggml's tiled attention; ``--base-only`` leaves LoRA out)::

    .venv/bin/python benchmarks/lora_noise.py --strengths 0.1 --layouts streams unified \
        --requests 96 --max-tokens 32 --no-prefix-cache [--base-only]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import _common as bench

import llamax

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts"))

from make_lora_adapter import write_lora_adapter  # noqa: E402
from near_tie import forced_regrets  # noqa: E402
from test_soak import soak_prompt  # noqa: E402

SETS: list[dict[str, float] | None] = [None, {"a": 1.0}, {"b": 0.5}, {"a": 0.5, "b": 1.0}]


def measure(
    strength: float,
    seed: int,
    prefix_cache: bool,
    n: int,
    *,
    layout: str = "auto",
    max_tokens: int = 16,
    base_only: bool = False,
) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="llamax-lora-noise-"))
    adapters = {
        name: str(write_lora_adapter(tmp / f"{name}.gguf", seed=k, strength=strength))
        for k, name in enumerate("ab")
    }
    rng = random.Random(seed)
    sets = [None] if base_only else SETS
    reqs = [(soak_prompt(rng), rng.choice(sets)) for _ in range(n)]

    def params(lora: dict[str, float] | None) -> llamax.SamplingParams:
        return llamax.SamplingParams(
            max_tokens=max_tokens, temperature=0, lora=lora, ignore_eos=True
        )

    with llamax.Context(
        n_ctx=max(8192, 128 * n), n_seq_max=max(64, n), n_batch=512, lora=adapters,
        prefix_cache=prefix_cache, prefix_ram_bytes=0, kv_layout=layout,
    ) as ctx:  # fmt: skip
        handles = [ctx.add_request(p, params(lora)) for p, lora in reqs]
        batched = [tuple(h.result(600).token_ids) for h in handles]
    with llamax.Context(n_ctx=1024, n_seq_max=1, prefix_cache=False, lora=adapters) as probe:
        backend = probe._engine.backend
        eog = [t for t in range(backend.facts.n_vocab) if backend.is_eog(t)]
        regrets: list[float] = []
        worst: list[float] = []
        changed = wrong_adapter = 0
        wrong: dict[str, list[float]] = {"base_reply_under_a": [], "other_prompts_reply": []}
        for k, ((prompt, lora), tokens) in enumerate(zip(reqs, batched, strict=True)):
            ids = probe.tokenize(prompt)
            r = forced_regrets(probe, ids, tokens, lora=lora, banned=eog)
            regrets += r
            worst.append(max(r))
            if lora is not None:
                base = tuple(probe.add_request(ids, params(None)).result(600).token_ids)
                probe.clear_cache()
                changed += base != tokens
            if k < 8:  # the scale of wrong KV
                base = tuple(probe.add_request(ids, params(None)).result(600).token_ids)
                other = batched[(k + 1) % n]
                probe.clear_cache()
                scored = forced_regrets(probe, ids, base, lora={"a": 1.0}, banned=eog)
                wrong["base_reply_under_a"].append(round(max(scored), 3))
                wrong_adapter += max(scored) >= 0.3
                scored = forced_regrets(probe, ids, other, banned=eog)
                wrong["other_prompts_reply"].append(round(max(scored), 3))
    regrets.sort()
    return {
        "strength": strength,
        "seed": seed,
        "prefix_cache": prefix_cache,
        "kv_layout": layout,
        "max_tokens": max_tokens,
        "replies": n,
        "lora_replies": sum(lora is not None for _, lora in reqs),
        "lora_replies_changed_vs_base": changed,
        "regret_median": statistics.median(regrets),
        "regret_p99": regrets[int(0.99 * len(regrets))],
        "regret_max": regrets[-1],
        "replies_over_0.3_nats": sum(w >= 0.3 for w in worst),
        "wrong_kv_scale": wrong,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strengths", type=float, nargs="+", default=[1.0, 0.1])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument(
        "--layouts", nargs="+", default=["auto"], choices=["auto", "unified", "streams"]
    )
    parser.add_argument(
        "--no-prefix-cache", action="store_true", help="off in every run (default: even seeds)"
    )
    parser.add_argument("--base-only", action="store_true", help="every request on the base model")
    parser.add_argument("--json-out")
    args = parser.parse_args()
    runs = [
        measure(
            strength,
            seed,
            prefix_cache=seed % 2 == 0 and not args.no_prefix_cache,
            n=args.requests,
            layout=layout,
            max_tokens=args.max_tokens,
            base_only=args.base_only,
        )
        for strength in args.strengths
        for layout in args.layouts
        for seed in args.seeds
    ]
    report = {"benchmark": "lora_noise", "machine": bench.machine(), "runs": runs}
    bench.emit_report(report, sys.stdout, Path(args.json_out) if args.json_out else None)


if __name__ == "__main__":
    main()
