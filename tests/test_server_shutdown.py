"""A shutdown tells the streams it cuts (issue 57, item 6): each open stream ends with its
API's error event, then the end of its body; a second Ctrl-C cuts at once and exits 130
without a traceback."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import llamax
from llamax.server import BackgroundServer, create_app
from llamax.testing import FakeBackend, assert_idle

TEMPLATE = (Path(__file__).parent / "data" / "smollm2_chat_template.jinja").read_text()
SPECIALS = {"<|im_start|>": 300, "<|im_end|>": 301}
HELLO = [{"role": "user", "content": "Hi"}]
LONG = 3000  # tokens: at >= 20 ms a step, a stream that outlives every bound below
CODE = "server_shutting_down"


@pytest.fixture
def slow_ctx() -> Iterator[llamax.Context]:
    """A fake context whose streams run for a minute: 20 ms a decode step, 3000 tokens."""
    backend = FakeBackend(
        n_ctx=4096, metadata={"tokenizer.chat_template": TEMPLATE}, special_tokens=SPECIALS
    )
    backend.fault = lambda where: time.sleep(0.02) if where == "decode" else None
    ctx = llamax.Context(backend=backend)
    yield ctx
    backend.fault = None
    assert_idle(ctx)  # the cut streams were cancelled, their cells freed
    ctx.close()


def _stream_cut_by_stop(server: BackgroundServer, path: str, body: dict[str, Any],
                        force: bool = False) -> list[str]:  # fmt: skip
    """Open a stream, stop the server once its first event is in, and return every event
    (``event:``/``data:`` blocks) the client got before the body ended."""
    stop = (lambda: server.stop(60, force=True)) if force else (lambda: server.stop(60))
    stopper = threading.Thread(target=stop)
    with httpx.stream("POST", server.url + path, json=body, timeout=30) as response:
        assert response.status_code == 200
        chunks = response.iter_text()
        text = next(chunks)
        stopper.start()
        text += "".join(chunks)  # a stream never cut ends by the read timeout: an error
    stopper.join(60)
    assert not stopper.is_alive(), "the server did not stop"
    return [event for event in text.split("\n\n") if event.strip()]


def _data(event: str) -> Any:
    (line,) = [line for line in event.splitlines() if line.startswith("data: ")]
    return json.loads(line.removeprefix("data: "))


OPENAI_TAILS = [
    ("/v1/chat/completions", {"messages": HELLO, "max_tokens": LONG, "stream": True}),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": LONG, "stream": True}),
]


@pytest.mark.parametrize(("path", "body"), OPENAI_TAILS)
def test_a_cut_openai_stream_ends_with_an_error_then_done(
    slow_ctx: llamax.Context, path: str, body: dict[str, Any]
) -> None:
    server = BackgroundServer(create_app(slow_ctx), shutdown_timeout=0)
    server.start()
    events = _stream_cut_by_stop(server, path, body)
    assert events[-1] == "data: [DONE]", events[-3:]
    error = _data(events[-2])["error"]
    assert error["code"] == CODE and "shutting down" in error["message"]


def test_a_cut_anthropic_stream_ends_with_an_overloaded_error_event(
    slow_ctx: llamax.Context,
) -> None:
    server = BackgroundServer(create_app(slow_ctx), shutdown_timeout=0)
    server.start()
    body = {"messages": HELLO, "max_tokens": LONG, "stream": True}
    events = _stream_cut_by_stop(server, "/v1/messages", body)
    assert events[-1].startswith("event: error\n"), events[-2:]
    assert _data(events[-1])["type"] == "error"
    assert _data(events[-1])["error"]["type"] == "overloaded_error"
    assert "shutting down" in _data(events[-1])["error"]["message"]


def test_a_cut_responses_stream_ends_with_an_error_event(slow_ctx: llamax.Context) -> None:
    server = BackgroundServer(create_app(slow_ctx), shutdown_timeout=0)
    server.start()
    body = {"input": "Hi", "max_output_tokens": LONG, "stream": True}
    events = _stream_cut_by_stop(server, "/v1/responses", body)
    assert events[-1].startswith("event: error\n"), events[-2:]
    error = _data(events[-1])
    assert (error["type"], error["code"]) == ("error", CODE)
    assert error["sequence_number"] == _data(events[-2])["sequence_number"] + 1


@pytest.mark.parametrize(
    ("path", "body", "done"),
    [
        ("/completion", {"prompt": "Hi", "n_predict": LONG, "stream": True}, False),
        ("/chat/completions", {"messages": HELLO, "max_tokens": LONG, "stream": True}, True),
    ],
)
def test_a_cut_llama_server_stream_ends_with_its_error_shape(
    slow_ctx: llamax.Context, path: str, body: dict[str, Any], done: bool
) -> None:
    server = BackgroundServer(create_app(slow_ctx), shutdown_timeout=0)
    server.start()
    events = _stream_cut_by_stop(server, path, body)
    if done:
        assert events.pop() == "data: [DONE]"
    error = _data(events[-1])["error"]
    assert (error["code"], error["type"]) == (503, "unavailable_error"), error
    assert "shutting down" in error["message"]


def test_a_forced_stop_cuts_streams_at_once_whatever_the_timeout(
    slow_ctx: llamax.Context,
) -> None:
    """The shutdown timeout (600 s) would let the stream run to its end (a minute); a
    forced stop (a second Ctrl-C) ends it at once with the error event."""
    server = BackgroundServer(create_app(slow_ctx), shutdown_timeout=600)
    server.start()
    body = {"prompt": "Hi", "max_tokens": LONG, "stream": True}
    events = _stream_cut_by_stop(server, "/v1/completions", body, force=True)
    assert events[-1] == "data: [DONE]"
    assert _data(events[-2])["error"]["code"] == CODE


@pytest.mark.model
@pytest.mark.integration
def test_a_second_ctrl_c_exits_at_once_without_a_traceback(model_path: Path) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    argv = [sys.executable, "-m", "llamax.server", str(model_path), "--port", str(port),
            "--n-ctx", "4096", "--n-threads", "1", "--shutdown-timeout", "600",
            "--log-level", "info"]  # fmt: skip
    env = {name: value for name, value in os.environ.items() if name != "LLAMAX_API_KEY"}
    process = subprocess.Popen(
        argv, stderr=subprocess.PIPE, text=True, env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    body = {"prompt": "Once", "max_tokens": LONG, "stream": True,
            "logit_bias": {"0": -100, "2": -100, "4": -100}}  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not _is_ready(url):
            assert process.poll() is None and time.monotonic() < deadline, "did not start"
            time.sleep(0.2)
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as response:
            lines = response.iter_lines()
            next(lines)
            process.send_signal(signal.SIGINT)
            assert process.stderr is not None
            while "shutting down" not in (line := process.stderr.readline()).lower():
                assert line, "the server said nothing about the shutdown"
            process.send_signal(signal.SIGINT)
            events = [line for line in lines if line]
        status = process.wait(30)
        stderr = process.stderr.read()
        assert "Traceback" not in stderr and "CancelledError" not in stderr, stderr
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == CODE
        assert (status, "forced exit" in stderr) == (130, True)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def _is_ready(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
