"""HTTP serving benchmark: ``llamax serve`` against llama.cpp's ``llama-server`` and
llama-cpp-python's server, each started as a subprocess on 127.0.0.1 with the same model,
context size, sequence count and threads.

Workloads (every request streams ``/v1/chat/completions``, greedy, end-of-generation tokens
banned with ``logit_bias`` so each reply is exactly ``max_tokens`` long):

- W1: N = 16 and 64 concurrent short prompts, 64 tokens each: generated tokens/s (wall).
- W2: 16 requests sharing a ~1,300-token system prompt, sent at once, 32 tokens each:
  wall time and time to first token (TTFT) p50/p95.

Peers: llama-server runs with per-slot KV streams (``-no-kvu``, its faster layout here),
llama-cpp-python's server serves one request at a time (``--interrupt_requests false`` so a
new request queues instead of cutting the running one). Each workload runs ``--repeats``
times per peer; the report holds every run and the medians.
Usage::

    .venv/bin/python benchmarks/server.py --llama-server "$(bash benchmarks/peers.sh)" > out.json

stdout is one JSON object; progress goes to stderr. ``--llama-cpp-python`` needs that
server's dependencies: ``pip install -e '.[server-bench]'``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from _common import machine

import llamax

NO_EOG = {"0": -100, "2": -100, "4": -100}  # SmolLM2's end-of-generation token ids
TOPICS = ["rivers", "owls", "bread", "trains", "glaciers", "chess", "tea", "volcanoes"]


@dataclass
class Peer:
    """A server to benchmark: how to start it and where it listens."""

    name: str
    argv: list[str]
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def peers(args: argparse.Namespace, model: str) -> list[Peer]:
    found = [
        Peer(
            "llamax",
            [
                sys.executable,
                "-m",
                "llamax.server",
                model,
                "--port",
                "{port}",
                "--n-ctx",
                str(args.n_ctx),
                "--n-seq-max",
                "{n_seq}",
                "--n-threads",
                str(args.threads),
                "--log-level",
                "warning",
                "--max-queue",
                "1024",
            ],
            0,
        )
    ]
    if args.llama_server:
        found.append(
            Peer(
                "llama-server",
                [
                    args.llama_server,
                    "-m",
                    model,
                    "--host",
                    "127.0.0.1",
                    "--port",
                    "{port}",
                    "-c",
                    str(args.n_ctx),
                    "-np",
                    "{n_seq}",
                    "-no-kvu",
                    "-t",
                    str(args.threads),
                    "-tb",
                    str(args.threads),
                    "--log-disable",
                ],
                0,
            )
        )
    if args.llama_cpp_python:
        found.append(
            Peer(
                "llama-cpp-python",
                [
                    sys.executable,
                    "-m",
                    "llama_cpp.server",
                    "--model",
                    model,
                    "--port",
                    "{port}",
                    "--n_ctx",
                    str(args.n_ctx),
                    "--n_threads",
                    str(args.threads),
                    "--n_threads_batch",
                    str(args.threads),
                    "--n_batch",
                    "512",
                    "--verbose",
                    "false",
                    "--interrupt_requests",
                    "false",
                ],
                0,
            )
        )
    return found


def start(peer: Peer, n_seq: int) -> subprocess.Popen[bytes]:
    peer.port = free_port()
    argv = [a.replace("{port}", str(peer.port)).replace("{n_seq}", str(n_seq)) for a in peer.argv]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(peer.url + "/v1/models", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"{peer.name} exited with {proc.returncode}")
        time.sleep(0.3)
    proc.terminate()
    raise TimeoutError(f"{peer.name} did not start")


async def one_request(
    client: httpx.AsyncClient, messages: list[dict[str, str]], max_tokens: int
) -> tuple[float, int]:
    """Stream one chat completion; return (TTFT seconds, content chunks received)."""
    body = {
        "model": "m",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "logit_bias": NO_EOG,
        "stream": True,
    }
    started, ttft, chunks = time.perf_counter(), None, 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or [{}]
            if (choices[0].get("delta") or {}).get("content"):
                ttft = ttft if ttft is not None else time.perf_counter() - started
                chunks += 1
    return (ttft if ttft is not None else float("nan")), chunks


async def burst(url: str, conversations: list[list[dict[str, str]]], max_tokens: int) -> Any:
    limits = httpx.Limits(max_connections=len(conversations) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        started = time.perf_counter()
        results = await asyncio.gather(*(one_request(client, c, max_tokens) for c in conversations))
        return time.perf_counter() - started, results


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def w1(url: str, n: int, max_tokens: int) -> dict[str, Any]:
    prompts = [
        [{"role": "user", "content": f"Write about {TOPICS[i % 8]}, note {i}."}] for i in range(n)
    ]
    wall, results = asyncio.run(burst(url, prompts, max_tokens))
    ttfts = [r[0] for r in results]
    return {
        "wall_s": round(wall, 3),
        "tokens_per_s": round(n * max_tokens / wall, 2),
        "chunks": sum(r[1] for r in results),
        "ttft_p50_s": round(percentile(ttfts, 0.5), 3),
        "ttft_p95_s": round(percentile(ttfts, 0.95), 3),
    }


def system_prompt() -> str:
    rules = [
        f"Rule {i}: when a customer asks about order {1000 + i}, check the ledger entry "
        f"for warehouse {i % 7} and reply politely with the tracking code."
        for i in range(39)
    ]
    return "You are the support assistant of a shop. " + " ".join(rules)


def w2(url: str, max_tokens: int) -> dict[str, Any]:
    system = system_prompt()
    conversations = [
        [
            {"role": "system", "content": system},
            {"role": "user", "content": f"Where is order {1000 + 3 * i}?"},
        ]
        for i in range(16)
    ]
    wall, results = asyncio.run(burst(url, conversations, max_tokens))
    ttfts = [r[0] for r in results]
    return {
        "wall_s": round(wall, 3),
        "ttft_p50_s": round(percentile(ttfts, 0.5), 3),
        "ttft_p95_s": round(percentile(ttfts, 0.95), 3),
    }


def run_peer(peer: Peer, args: argparse.Namespace) -> dict[str, Any]:
    """W1 with ``--n-seq`` sequences, then W2 on a fresh server with 16 (so that
    llama-server's per-slot KV, ``n_ctx / slots`` cells, holds the long prompt)."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for n_seq, workloads in ((args.n_seq, [f"w1_n{n}" for n in args.w1]), (16, ["w2"])):
        proc = start(peer, n_seq)
        try:
            w1(peer.url, 2, 8)  # warm up
            for _ in range(args.repeats):
                for name in workloads:
                    print(f"[server] {peer.name} {name}", file=sys.stderr, flush=True)
                    result = (
                        w2(peer.url, 32)
                        if name == "w2"
                        else w1(peer.url, int(name.removeprefix("w1_n")), args.max_tokens)
                    )
                    runs.setdefault(name, []).append(result)
        finally:
            proc.terminate()
            proc.wait(60)
    medians = {
        name: {key: statistics.median(r[key] for r in rs) for key in rs[0]}
        for name, rs in runs.items()
    }
    return {"median": medians, "runs": runs}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=os.environ.get("LLAMAX_MODEL"))
    p.add_argument("--llama-server", metavar="PATH", help="llama-server binary (peers.sh)")
    p.add_argument("--llama-cpp-python", action="store_true", help="also llama_cpp.server")
    p.add_argument("--n-ctx", type=int, default=24576)
    p.add_argument("--n-seq", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--w1", type=int, nargs="+", default=[16, 64])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    model = args.model or str(llamax.default_model_path())
    report: dict[str, Any] = {
        "machine": machine(),
        "benchmark": "server",
        "model": Path(model).name,
        "config": {k: v for k, v in vars(args).items() if k != "model"},
        "load_average_start": list(os.getloadavg()),
        "peers": {},
    }
    for peer in peers(args, model):
        try:
            report["peers"][peer.name] = run_peer(peer, args)
        except (RuntimeError, TimeoutError, httpx.HTTPError) as exc:
            report["peers"][peer.name] = {"error": f"{type(exc).__name__}: {exc}"}
    report["load_average_end"] = list(os.getloadavg())
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
