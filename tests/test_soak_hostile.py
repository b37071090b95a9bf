"""Hostile clients beside normal traffic (issue 54): a live ``llamax serve`` process on
SmolLM2 with a random projector, attacked from several threads by random mixes of every
reproducer of the issue, while one well-behaved client keeps asking one greedy question.

Asserted at the end:

- **No 5xx for a client's mistake.** Every attack is answered, with a 4xx (or a 200 where
  the request is legitimate but large), never 500-599, never a hang.
- **Normal traffic is correct and not stalled.** The bystander's streamed reply equals its
  solo reply bit for bit (``kv_layout="streams"`` and fixed threads: batch-invariant), and
  no gap between its events (first token included) exceeds :data:`MAX_GAP_S`.
- **Bounded memory.** The server's resident memory stays within :data:`MAX_RSS_GROWTH`
  of its size after warm-up (sampled from ``/proc`` every 0.2 s).

Wall-clock bounds live here, behind the ``soak`` marker, never in the default selection:
``pytest -m soak tests/test_soak_hostile.py`` (``LLAMAX_HOSTILE_SECONDS`` sets the length,
default 120 s).
"""

from __future__ import annotations

import base64
import json
import multiprocessing
import os
import random
import socket
import struct
import subprocess
import sys
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import vision_files

pytestmark = pytest.mark.soak

SECONDS = float(os.environ.get("LLAMAX_HOSTILE_SECONDS", "120"))
MAX_GAP_S = 2.0
"""The longest wait the bystander may see between two of its stream's events."""
MAX_RSS_GROWTH = 768 << 20
"""Resident memory the server may gain over its warm-up size while under attack."""
ATTACKERS = 3
PACE_S = 0.05
"""An attacker's mean pause between requests: hostile requests, not a flood (a flood of
cheap 4xx answers is a rate limit's job, a reverse proxy's; measured here, it only takes
the CPU from everyone on a 2-core machine)."""
QUESTION = {
    "messages": [{"role": "user", "content": "Name three colours."}],
    "max_tokens": 12,
    "temperature": 0.0,
    "stream": True,
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def server(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    """``llamax serve`` in its own process: streams layout, 2 fixed threads, 8 sequences."""
    mmproj = vision_files.script().cached_vision_model(projector="janus_pro")
    port = _free_port()
    slots = tmp_path_factory.mktemp("slots")
    argv = [
        sys.executable, "-m", "llamax.server", str(model_path), "--mmproj", str(mmproj),
        "--port", str(port), "--n-ctx", "4096", "--n-seq-max", "8", "--kv-layout", "streams",
        "--n-threads", "2", "--no-adapt-threads", "--slot-save-path", str(slots),
        "--allow-image-urls", "--log-level", "warning",
    ]  # fmt: skip
    process = subprocess.Popen(argv, env=os.environ | {"LLAMAX_ADAPT_THREADS": "0"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, "the server exited"
            assert time.monotonic() < deadline, "the server did not start"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        yield url, process.pid
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


# --- the attacks -------------------------------------------------------------------------


def _data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_bomb(inflated: int = 64 << 20) -> bytes:
    """A 1x1 RGB PNG whose IDAT inflates to ``inflated`` bytes."""
    ihdr = struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\0" * inflated, 9)
    chunks = _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")
    return b"\x89PNG\r\n\x1a\n" + chunks


def bmp_header_only(side: int = 4096) -> bytes:
    """A 54-byte BMP header declaring ``side`` x ``side`` 24-bit pixels, and no pixels."""
    size = 54 + side * side * 3
    return (
        b"BM" + struct.pack("<IHHI", size, 0, 0, 54)
        + struct.pack("<IiiHHIIiiII", 40, side, side, 1, 24, 0, side * side * 3, 2835, 2835, 0, 0)
    )  # fmt: skip


def _image_chat(url: str) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": url}},
        ]}],
        "max_tokens": 2,
    }  # fmt: skip


def _schema_bomb(digits: int) -> dict[str, Any]:
    schema = {"type": "integer", "minimum": -(10**digits), "maximum": 10**digits}
    return {
        "messages": [{"role": "user", "content": "A number"}],
        "max_tokens": 4,
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
    }


Attack = Callable[[httpx.Client, str], httpx.Response]


def _post(path: str, body: Any, **kw: Any) -> Attack:
    return lambda client, url: client.post(url + path, json=body, **kw)


def _cross_site(path: str, text: str) -> Attack:
    headers = {"Origin": "http://evil.example", "Content-Type": "text/plain"}
    return lambda client, url: client.post(url + path, content=text, headers=headers)


def _rebound(path: str) -> Attack:
    return lambda client, url: client.get(url + path, headers={"Host": "evil.example"})


def _leaver(client: httpx.Client, url: str) -> httpx.Response:
    """A streaming client that reads two events and leaves."""
    body = {"prompt": "Once upon a time", "max_tokens": 200, "stream": True}
    with client.stream("POST", url + "/v1/completions", json=body) as response:
        for n, _ in enumerate(response.iter_lines()):
            if n >= 2:
                break
        return response


def _slots(client: httpx.Client, url: str) -> httpx.Response:
    """Every slot named once: the llama-server ``id_slot`` lock-out."""
    last = None
    for slot in range(8):
        last = client.post(url + "/completion", json={"prompt": "Hi", "n_predict": 1,
                                                       "id_slot": slot})  # fmt: skip
    assert last is not None
    return last


def _ssrf(target: str) -> Attack:
    return _post("/v1/chat/completions", _image_chat(target))


def _images_chat(urls: list[str]) -> dict[str, Any]:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return {"messages": [{"role": "user", "content": parts}], "max_tokens": 1}


def attacks(url: str) -> dict[str, Attack]:
    """Every reproducer of issue 54 that a live server on loopback can be sent."""
    port = url.rsplit(":", 1)[1]
    bmp = _data_url(bmp_header_only(), "image/bmp")
    chat_text = '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}'
    many = {"prompt": ["x"] * 64, "n_cmpl": 256, "n_predict": 4}
    count = {"model": "m", "messages": [{"role": "user", "content": "word " * 400_000}]}
    return {
        "schema_bomb_450": _post("/v1/chat/completions", _schema_bomb(450)),
        "schema_bomb_900": _post("/v1/chat/completions", _schema_bomb(900)),
        "ssrf_loopback": _ssrf(f"http://127.0.0.1:{port}/health"),
        "ssrf_short": _ssrf(f"http://127.1:{port}/props"),
        "ssrf_hex": _ssrf(f"http://0x7f000001:{port}/props"),
        "ssrf_localhost": _ssrf(f"http://localhost:{port}/slots"),
        "ssrf_v6": _ssrf(f"http://[::ffff:127.0.0.1]:{port}/"),
        "png_bomb": _post("/v1/chat/completions", _image_chat(_data_url(png_bomb(), "image/png"))),
        "bmp_headers": _post("/v1/chat/completions", _images_chat([bmp] * 16)),
        "slots": _slots,
        "cross_site_reset": _cross_site("/reset_prefix_cache", ""),
        "cross_site_save": _cross_site("/slots/0?action=save", '{"filename": "x.bin"}'),
        "cross_site_chat": _cross_site("/v1/chat/completions", chat_text),
        "rebound_props": _rebound("/props"),
        "rebound_slots": _rebound("/slots"),
        "many_sequences": _post("/completion", many),
        "count_tokens_big": _post("/v1/messages/count_tokens", count),
        "leaver": _leaver,
    }


# --- the run -----------------------------------------------------------------------------


@dataclass
class Record:
    statuses: Counter[tuple[str, int]] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    replies: list[str] = field(default_factory=list)
    rss: list[int] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def _ask(client: httpx.Client, url: str) -> tuple[str, float]:
    """The bystander's question, streamed: its text and its longest gap between events."""
    parts: list[str] = []
    last, worst = time.monotonic(), 0.0
    with client.stream("POST", url + "/v1/chat/completions", json=QUESTION) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            now = time.monotonic()
            worst, last = max(worst, now - last), now
            if line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                parts.append(delta.get("content") or "")
    return "".join(parts), worst


def _attacker(url: str, seed: int, stop: Any, out: Any) -> None:
    """One hostile client (its own process, so its work never takes the bystander's GIL):
    random attacks, :data:`PACE_S` apart, until ``stop``; ``(name, status or error)``
    tuples go to ``out``."""
    rng = random.Random(seed)
    table = attacks(url)
    names = sorted(table)
    with httpx.Client(timeout=120) as client:
        while not stop.is_set():
            name = rng.choice(names)
            try:
                out.put((name, table[name](client, url).status_code))
            except httpx.HTTPError as e:
                out.put((name, f"{type(e).__name__}: {e}"))
            stop.wait(rng.uniform(0, 2 * PACE_S))
    out.put(None)


def _sample_rss(pid: int, stop: Any, record: Record) -> None:
    while not stop.wait(0.2):
        rss = _rss(pid)
        with record.lock:
            record.rss.append(rss)


def test_hostile_clients_do_not_hurt_a_bystander(server: tuple[str, int]) -> None:
    url, pid = server
    record = Record()
    processes = multiprocessing.get_context("spawn")
    stop, out = processes.Event(), processes.Queue()
    with httpx.Client(timeout=120) as client:
        solo, _ = _ask(client, url)
        _ask(client, url)
        baseline = _rss(pid)
        attackers = [
            processes.Process(target=_attacker, args=(url, seed, stop, out), daemon=True)
            for seed in range(ATTACKERS)
        ]
        for attacker in attackers:
            attacker.start()
        sampler = threading.Thread(target=_sample_rss, args=(pid, stop, record))
        sampler.start()
        end = time.monotonic() + SECONDS
        while time.monotonic() < end:
            reply, gap = _ask(client, url)
            record.replies.append(reply)
            record.gaps.append(gap)
        stop.set()
        num_done = 0
        while num_done < ATTACKERS:
            item = out.get(timeout=300)  # every attack settles: answered, or failed typed
            if item is None:
                num_done += 1
            elif isinstance(item[1], int):
                record.statuses[item] += 1
            else:
                record.errors.append(f"{item[0]}: {item[1]}")
        for attacker in attackers:
            attacker.join(60)
        sampler.join(60)
    print(json.dumps({  # for `pytest -s`: what the run saw
        "attacks": {f"{name} {status}": n for (name, status), n in sorted(record.statuses.items())},
        "num_asks": len(record.gaps), "max_gap_s": round(max(record.gaps), 3),
        "rss_mib": [baseline >> 20, max(record.rss) >> 20],
    }, indent=1))
    server_errors = {k: n for k, n in record.statuses.items() if k[1] >= 500}
    assert not server_errors, f"5xx answers to client mistakes: {server_errors}"
    assert not record.errors, record.errors[:5]
    assert len({name for name, _ in record.statuses}) >= 10, record.statuses
    assert all(reply == solo for reply in record.replies), Counter(record.replies)
    assert max(record.gaps) <= MAX_GAP_S, sorted(record.gaps)[-5:]
    assert max(record.rss) - baseline <= MAX_RSS_GROWTH, (baseline, max(record.rss))
