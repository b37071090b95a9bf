"""Prefix-aware vs Ray's default routing: 4 long system prompts x many requests, 2 replicas.

One local Ray cluster; the same workload runs against a fresh deployment under each
routing policy (fresh replicas, so empty prefix caches). Per policy: the fraction of prompt
tokens served from the replicas' prefix caches, total wall time, per-request latency and
which replica served each system prompt. JSON on stdout.

    .venv/bin/python benchmarks/ray_routing.py [--requests-per-prompt 8] [--concurrency 4]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import ray
from _common import load_average, log, machine, ratio, stdout_to_stderr
from ray import serve

import llamax.ray

TOPICS = ["astronomy", "cooking", "maritime law", "botany"]


def system_prompt(topic: str, index: int) -> str:
    """A distinct ~1,000-token system prompt about ``topic``."""
    rules = " ".join(
        f"Rule {i} for the {topic} desk: cite source {index}-{i} and keep answers short."
        for i in range(55)
    )
    return f"You are assistant number {index}, an expert in {topic}. {rules}"


def run_policy(routing: str, args: argparse.Namespace, port: int) -> dict[str, Any]:
    """Deploy with ``routing``, send the workload, return its measurements."""
    app = llamax.ray.deployment(
        num_replicas=2,
        routing=routing,  # type: ignore[arg-type]
        context_options={"n_ctx": 8192, "n_seq_max": 8, "n_threads": 1},
    )
    serve.run(app, name="llamax", route_prefix="/")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", timeout=600)
    prompts = [system_prompt(topic, i) for i, topic in enumerate(TOPICS)]
    jobs = [(p, f"Question {r}?") for r in range(args.requests_per_prompt) for p in range(4)]

    def send(job: tuple[int, str]) -> dict[str, Any]:
        started = time.perf_counter()
        raw = client.chat.completions.with_raw_response.create(
            model="llamax", max_tokens=args.max_tokens, temperature=0,
            messages=[{"role": "system", "content": prompts[job[0]]},
                      {"role": "user", "content": job[1]}],
        )  # fmt: skip
        usage = raw.parse().usage
        assert usage is not None and usage.prompt_tokens_details is not None
        return {"prompt": job[0], "replica": raw.headers["x-llamax-replica"],
                "prompt_tokens": usage.prompt_tokens,
                "cached_tokens": usage.prompt_tokens_details.cached_tokens or 0,
                "seconds": time.perf_counter() - started}  # fmt: skip

    log(f"[{routing}] {len(jobs)} requests, concurrency {args.concurrency}")
    started = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        rows = list(pool.map(send, jobs))
    wall = time.perf_counter() - started
    serve.delete("llamax")
    prompt_tokens = sum(r["prompt_tokens"] for r in rows)
    cached = sum(r["cached_tokens"] for r in rows)
    placement = {TOPICS[p]: dict(Counter(r["replica"] for r in rows if r["prompt"] == p))
                 for p in range(4)}  # fmt: skip
    return {
        "routing": routing,
        "num_requests": len(rows),
        "total_seconds": round(wall, 2),
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached,
        "cached_token_fraction": ratio(cached, prompt_tokens),
        "median_latency_seconds": round(statistics.median(r["seconds"] for r in rows), 3),
        "requests_per_replica": dict(Counter(r["replica"] for r in rows)),
        "replicas_per_prompt": placement,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests-per-prompt", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with stdout_to_stderr() as real_stdout:  # Ray's raylet prints to stdout at shutdown
        prefix, default = run_both(args, port)
        report = {
            "machine": machine(),
            "config": {**vars(args), "replicas": 2, "threads_per_replica": 1,
                       "system_prompts": len(TOPICS), "load_average_end": load_average()},
            "prefix": prefix,
            "default": default,
            "speedup_prefix_vs_default": ratio(default["total_seconds"], prefix["total_seconds"]),
        }  # fmt: skip
        print(json.dumps(report, indent=2), file=real_stdout)


def run_both(args: argparse.Namespace, port: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Start a local cluster, measure prefix then default routing, shut it down."""
    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=80 << 20,
             log_to_driver=False)  # fmt: skip
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        return run_policy("prefix", args, port), run_policy("default", args, port)
    finally:
        serve.shutdown()  # type: ignore[no-untyped-call]
        ray.shutdown()


if __name__ == "__main__":
    main()
