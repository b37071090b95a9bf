"""Lifecycle on SmolLM2 (issue 22, items 5, 6 and 7c).

Use after close and races with close() used to crash the process (SIGABRT in
``llama_tokenize``, a segfault in ``chat_prompt``), so those run in a subprocess: a crash
fails the test instead of killing pytest. Damaged session files are refused on load with a
typed error, and the engine keeps serving (a bystander succeeds, ``audit()`` is clean)."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import llamax
from llamax.testing import assert_idle

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 240.0
GREEDY = llamax.SamplingParams(temperature=0, max_tokens=4)
PROMPT = "<|im_start|>user\nSay hello.<|im_end|>\n<|im_start|>assistant\n"


def _run(script: str, model_path: Path, tmp_path: Path) -> list[str]:
    """Run ``script`` with this checkout's llamax in a fresh interpreter; it must exit 0."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LLAMAX_MODEL": str(model_path)}
    env["TMP_DIR"] = str(tmp_path)
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert done.returncode == 0, (
        f"exit status {done.returncode} (negative: killed by that signal)\n"
        f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}"
    )
    return done.stdout.splitlines()


USE_AFTER_CLOSE = """
    import asyncio, os
    import llamax

    tmp = os.environ["TMP_DIR"]
    ctx = llamax.Context(n_ctx=512, n_seq_max=2)
    session = ctx.session()
    session.add_request("Hello", llamax.SamplingParams(max_tokens=2)).result()
    session.save(f"{tmp}/s.llamax")
    ctx.close()
    messages = [{"role": "user", "content": "hi"}]
    calls = {
        "tokenize": lambda: ctx.tokenize("hello world"),
        "detokenize": lambda: ctx.detokenize([1, 2, 3]),
        "chat_prompt": lambda: ctx.chat_prompt(messages),
        "chat_template": lambda: ctx.chat_template,
        "can_shift": lambda: ctx.can_shift,
        "add_request": lambda: ctx.add_request("hello"),
        "chat_completion": lambda: ctx.chat_completion(messages),
        "completion": lambda: ctx.completion("hello"),
        "generate": lambda: ctx.generate(["a"], return_exceptions=True),
        "chat": lambda: ctx.chat(),
        "session": lambda: ctx.session(),
        "embed": lambda: ctx.embed(["hello"]),
        "Session.load": lambda: llamax.Session.load(ctx, f"{tmp}/s.llamax"),
        "Session.save": lambda: session.save(f"{tmp}/t.llamax"),
        "Session.add_request": lambda: session.add_request("x"),
        "Session.token_ids": lambda: session.token_ids,
    }
    for name, call in calls.items():
        try:
            call()
            print(name, "ANSWERED")
        except llamax.ContextClosedError:
            print(name, "closed")
    print("embedder", ctx._embedder)
    print("end")
"""


@pytest.mark.integration
def test_every_call_after_close_raises_instead_of_crashing(
    model_path: Path, tmp_path: Path
) -> None:
    """Regression (item 5): ``tokenize`` after close aborted the process (SIGABRT), and
    ``chat_prompt`` segfaulted; ``embed`` loaded a second model that nothing freed (7c)."""
    lines = _run(USE_AFTER_CLOSE, model_path, tmp_path)
    assert lines[-1] == "end"
    assert "embedder None" in lines
    answers = lines[:-2]
    assert answers and all(line.endswith(" closed") for line in answers), lines


RACE_CLOSE = """
    import os, threading, time
    import llamax

    tmp = os.environ["TMP_DIR"]
    text = "The quick brown fox jumps over the lazy dog. " * 40
    unexpected = []

    def hammer(ctx, start, kind):
        start.wait()
        for i in range(400):
            try:
                if kind == 0:
                    ctx.tokenize(text)
                elif kind == 1:
                    ctx.add_request(text, llamax.SamplingParams(max_tokens=1))
                elif kind == 2:
                    ctx.chat_prompt([{"role": "user", "content": text}])
                elif kind == 3:
                    ctx.detokenize(list(range(1, 200)))
                else:
                    llamax.Session.load(ctx, f"{tmp}/s.llamax").close()
            except llamax.ContextClosedError:
                return
            except BaseException as exc:
                unexpected.append(repr(exc))
                return

    with llamax.Context(n_ctx=512, n_seq_max=4) as first:
        with first.session() as s:
            s.add_request("Hello", llamax.SamplingParams(max_tokens=2)).result()
            s.save(f"{tmp}/s.llamax")
    for round in range(3):
        ctx = llamax.Context(n_ctx=512, n_seq_max=4)
        start = threading.Barrier(9)
        threads = [threading.Thread(target=hammer, args=(ctx, start, i % 5)) for i in range(8)]
        for t in threads:
            t.start()
        start.wait()
        time.sleep(0.004 * round)  # close at 0, 4 and 8 ms into the hammering
        ctx.close()
        for t in threads:
            t.join()
    print("unexpected", unexpected)
    print("end")
"""


@pytest.mark.integration
def test_calls_racing_close_from_eight_threads_never_crash(
    model_path: Path, tmp_path: Path
) -> None:
    """Regression (item 5): ``tokenize`` racing ``close()`` from 8 threads segfaulted, and
    so could ``add_request`` (between its closed check and its tokenizing), ``chat_prompt``
    and ``Session.load``. Native memory is now freed after the last caller is out."""
    lines = _run(RACE_CLOSE, model_path, tmp_path)
    assert lines[-2:] == ["unexpected []", "end"], lines


FEWER_ROWS_THAN_SEQUENCES = """
    import llamax

    for make in (
        lambda: llamax.Context(n_ctx=1024, n_batch=4, n_seq_max=8),
        lambda: llamax.Context(n_ctx=32, n_seq_max=64),
        lambda: llamax.Context(n_ctx=32, n_seq_max=64, kv_layout="unified"),
        lambda: llamax.Embedder(n_ctx=16, n_seq_max=64),
    ):
        try:
            make().close()
            print("loaded")
        except llamax.InvalidParameterError as exc:
            print("refused", "n_seq_max" in str(exc))
    print("end")
"""


def test_fewer_batch_rows_than_sequences_is_refused_not_an_abort(
    model_path: Path, tmp_path: Path
) -> None:
    """Regression (issue 36, item 9): ``n_batch`` (or ``n_ctx``, which caps it) below
    ``n_seq_max`` aborted the process in ``llama_init_from_model`` (GGML_ASSERT
    ``n_outputs_max``); the config now refuses it before any native call."""
    lines = _run(FEWER_ROWS_THAN_SEQUENCES, model_path, tmp_path)
    assert lines[-5:] == ["refused True"] * 4 + ["end"], lines


# ---------------------------------------------------------------------- item 6
@pytest.fixture(scope="module")
def lie_ctx(model_path: Path) -> Iterator[llamax.Context]:
    """A small context of its own: a lie that kills the engine stays in this module."""
    ctx = llamax.Context(model_path, n_ctx=1024, n_seq_max=4, kv_layout="unified")
    yield ctx
    ctx.close()


@pytest.fixture(scope="module")
def saved(lie_ctx: llamax.Context, tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = tmp_path_factory.mktemp("lies") / "good.llamax"
    with lie_ctx.session() as session:
        session.add_request(PROMPT, GREEDY).result(TIMEOUT)
        session.save(path)
    return path.read_bytes()


def _split(data: bytes) -> tuple[dict[str, object], bytes]:
    _, size = struct.unpack_from("<8sI", data)
    return json.loads(data[12 : 12 + size]), data[12 + size :]


def _join(header: dict[str, object], state: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<8sI", b"LLAMAXS1", len(raw)) + raw + state


def _tokens(header: dict[str, object]) -> list[int]:
    tokens = header["tokens"]
    assert isinstance(tokens, list)
    return tokens


def _with_tokens(tokens: Callable[[list[int]], object]) -> Callable[[bytes], bytes]:
    def lie(data: bytes) -> bytes:
        header, state = _split(data)
        return _join({**header, "tokens": tokens(_tokens(header))}, state)

    return lie


def _with_state(change: Callable[[bytes], bytes]) -> Callable[[bytes], bytes]:
    def lie(data: bytes) -> bytes:
        header, state = _split(data)
        return _join(header, change(state))

    return lie


def _poke(offset: int, value: bytes) -> Callable[[bytes], bytes]:
    return lambda state: state[:offset] + value + state[offset + len(value) :]


CELL0 = 16  # u32 magic, i32 seq_id, u32 n_stream, u32 cell_count; then pos, n_seq_id, seq_id
LIES: dict[str, Callable[[bytes], bytes]] = {
    # the header lies about the KV state
    "more tokens than the state holds": _with_tokens(lambda t: t + t[:4]),
    "fewer tokens than the state holds": _with_tokens(lambda t: t[:-3]),
    "no tokens for a full state": _with_tokens(lambda t: []),
    "an id past the vocabulary": _with_tokens(lambda t: [*t[:-1], 49152]),
    "a negative id": _with_tokens(lambda t: [*t[:-1], -1]),
    "a bool id": _with_tokens(lambda t: [*t[:-1], True]),
    "a float id": _with_tokens(lambda t: [*t[:-1], 1.5]),
    "a string id": _with_tokens(lambda t: [*t[:-1], "12"]),
    "more tokens than a sequence holds": _with_tokens(lambda t: t * 200),
    "tokens not a list": _with_tokens(lambda t: "hello"),
    # the state is damaged
    "a truncated state": _with_state(lambda s: s[:-100]),
    "a state with bytes left over": _with_state(lambda s: s + b"\0" * 8),
    "a garbage state": _with_state(lambda s: s[:12] + bytes(range(256)) * (len(s) // 256)),
    "cells at other positions": _with_state(_poke(CELL0, struct.pack("<i", 500))),
    "a cell listed twice": _with_state(_poke(CELL0 + 12, struct.pack("<i", 0))),
    "a cell shared with another sequence": _with_state(_poke(CELL0 + 4, struct.pack("<I", 2))),
    "a huge cell count": _with_state(_poke(12, struct.pack("<I", 2**31))),
    "a huge stream count": _with_state(_poke(8, struct.pack("<I", 2**31))),
    "an empty state": _with_state(lambda s: b""),
    # the file is damaged
    "a huge header size": lambda d: d[:8] + struct.pack("<I", 2**32 - 1) + d[12:],
    "a header past the end": lambda d: d[:8] + struct.pack("<I", len(d)) + d[12:],
    "a header that is not JSON": lambda d: d[:12] + b"\xff" * (len(d) - 12),
    "a header that is a list": lambda d: _join([1, 2], b""),  # type: ignore[arg-type]
    "a foreign model": lambda d: _join(
        {**_split(d)[0], "model": {"name": "Other-7B"}}, _split(d)[1]
    ),
    "an empty file": lambda d: b"",
    "another magic": lambda d: b"LLAMAXS9" + d[8:],
}


DEFAULT_LIES = ("more tokens than the state holds", "a truncated state", "another magic")
"""One lie of each kind (the header about the state, the state, the file) in the default
run; the other lies, each its own check in the loader, are integration."""


@pytest.mark.parametrize(
    "lie",
    [
        pytest.param(lie, marks=() if lie in DEFAULT_LIES else pytest.mark.integration)
        for lie in sorted(LIES)
    ],
)
def test_a_damaged_session_file_is_refused_and_the_engine_keeps_serving(
    lie_ctx: llamax.Context, saved: bytes, tmp_path: Path, lie: str
) -> None:
    """Regression (item 6): a file whose header listed more (or fewer) tokens than its KV
    state, or ids outside the vocabulary, loaded; the next request on it ended in
    EngineError, closing the context for everyone. Each lie is now refused on load."""
    path = tmp_path / "bad.llamax"
    path.write_bytes(LIES[lie](saved))
    header, _ = _split(saved)
    tokens = _tokens(header)
    try:
        with pytest.raises(llamax.SessionLoadError):
            loaded = llamax.Session.load(lie_ctx, path)
            # what the old code then did: a request that reuses the loaded "prefix"
            with loaded:
                loaded.add_request(tokens + tokens[:6], GREEDY).result(TIMEOUT)
    finally:
        assert not lie_ctx.closed, "the damaged file closed the context"
    with lie_ctx.session() as fresh:  # a bystander session, on any sequence id
        bystander = fresh.add_request(PROMPT, GREEDY).result(TIMEOUT)
    assert bystander.finish_reason == "length"
    assert lie_ctx.audit() == []
    assert_idle(lie_ctx, timeout=60)


def test_the_good_file_still_loads_in_both_layouts(
    lie_ctx: llamax.Context, saved: bytes, tmp_path: Path, make_real: Callable[..., llamax.Context]
) -> None:
    path = tmp_path / "good.llamax"
    path.write_bytes(saved)
    tokens = tuple(_tokens(_split(saved)[0]))
    for ctx in (lie_ctx, make_real(n_ctx=1024, n_seq_max=4, kv_layout="streams")):
        with llamax.Session.load(ctx, path) as loaded:
            assert loaded.token_ids == tokens
            loaded.add_request([*tokens, 28], GREEDY).result(TIMEOUT)
        assert ctx.audit() == []
