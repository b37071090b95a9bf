"""The ``llamax`` console script, driven as a terminal program with pexpect."""

from __future__ import annotations

import json
import signal
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

import llamax.info
from llamax import cli

pexpect = pytest.importorskip("pexpect")

SCRIPT = Path(sys.executable).parent / "llamax"
FAST = ["--threads", "1", "--n-ctx", "1024"]


def spawn(*args: str, timeout: float = 120) -> object:
    assert SCRIPT.is_file(), "the llamax console script is not installed (pip install -e .)"
    # as from a terminal: a shell without job control starts ``cmd &`` with SIGINT ignored,
    # the child would inherit that, and Python then installs no KeyboardInterrupt handler
    child = pexpect.spawn(
        str(SCRIPT),
        list(args),
        encoding="utf-8",
        timeout=timeout,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    child.setwinsize(40, 200)
    return child


def finish(child: object) -> int:
    child.expect(pexpect.EOF)  # type: ignore[attr-defined]
    child.close()  # type: ignore[attr-defined]
    return int(child.exitstatus)  # type: ignore[attr-defined]


@pytest.mark.model
@pytest.mark.integration
def test_run_streams_a_chat_reply() -> None:
    child = spawn(
        "run",
        "What is the capital of France?",
        "--max-tokens",
        "12",
        "--temperature",
        "0",
        "--system",
        "Answer briefly.",
        *FAST,
    )
    child.expect(r"\w+")
    assert finish(child) == 0


@pytest.mark.model
@pytest.mark.integration
def test_run_writes_as_tokens_arrive(monkeypatch: pytest.MonkeyPatch, model_path: Path) -> None:
    writes: list[str] = []
    monkeypatch.setattr(sys.stdout, "write", writes.append)
    status = cli.main(
        [
            "run",
            "Count from one to ten.",
            "--max-tokens",
            "16",
            "--temperature",
            "0",
            "--model",
            str(model_path),
            *FAST,
        ]
    )
    assert status == 0
    assert len([w for w in writes if w]) > 3 and writes[-1] == "\n"  # many pieces, then newline
    writes.clear()
    args = ["run", "--raw", "The capital of France is", "--max-tokens", "4", "--temperature", "0"]
    assert cli.main([*args, "--model", str(model_path), *FAST]) == 0
    assert "".join(writes).strip()


@pytest.mark.model
@pytest.mark.integration
def test_chat_repl_streams_resets_and_exits() -> None:
    child = spawn("chat", "--max-tokens", "12", "--temperature", "0", *FAST)
    child.expect("/reset clears the conversation")
    child.expect("> ")
    child.sendline("Hello! My name is Bob.")
    child.expect(r"\w+.*\r\n> ")
    child.sendline("/reset")
    child.expect(r"\(conversation cleared\)")
    child.expect("> ")
    child.sendline("/bogus")
    child.expect("unknown command /bogus")
    child.expect("> ")
    child.sendline("/exit")
    assert finish(child) == 0


@pytest.mark.model
@pytest.mark.integration
def test_ctrl_c_stops_a_reply_and_the_chat_goes_on() -> None:
    child = spawn("chat", "--max-tokens", "400", "--temperature", "0", *FAST)
    child.expect("> ")
    for _ in range(3):  # a reply that ends before the interrupt arrives is retried
        child.sendline("Write a very long story about a dragon and a knight.")
        child.expect_exact("knight.\r\n")  # the echo of the typed line
        child.expect(r"\w")  # the reply has started streaming
        child.sendintr()
        if child.expect([r"\(interrupted\)", "> "]) == 0:
            break
    else:
        pytest.fail("every reply ended before Ctrl-C reached it")
    child.expect("> ")
    child.sendline("Say hi.")
    child.expect(r"\w+.*\r\n> ")  # the conversation goes on
    child.sendline("/exit")
    assert finish(child) == 0


@pytest.mark.model
@pytest.mark.integration
def test_chat_shifts_history_and_ends_at_eof() -> None:
    child = spawn("chat", "--max-tokens", "16", "--temperature", "0", "--max-context", "96", *FAST)
    child.expect("> ")
    for i in range(6):
        child.sendline(f"Tell me about the number {i}.")
        index = child.expect([r"\(history: dropped \d+ old messages", "> "])
        if index == 0:
            break
    else:
        pytest.fail("the conversation never outgrew --max-context 96")
    child.expect("> ")
    child.sendeof()
    assert finish(child) == 0


@pytest.mark.model
@pytest.mark.integration
def test_info_prints_gguf_metadata(capsys: pytest.CaptureFixture[str], model_path: Path) -> None:
    child = spawn("info", str(model_path))
    child.expect(r"architecture:\s+llama")
    child.expect(r"context length:\s+8192")
    child.expect(r"chat template:\s+yes")
    child.expect(r"can shift: yes, can copy: yes")
    assert finish(child) == 0
    assert cli.main(["info", "--json", str(model_path)]) == 0
    facts = json.loads(capsys.readouterr().out)
    assert facts["n_embd"] == 576 and facts["has_chat_template"] is True
    assert cli.main(["info", str(model_path.with_suffix(".missing"))]) == 1
    assert "llamax: error: model file not found" in capsys.readouterr().err


@pytest.mark.model
@pytest.mark.integration
def test_info_measures_what_the_kv_cache_costs(
    capsys: pytest.CaptureFixture[str], model_path: Path
) -> None:
    """``llamax info`` measures a cell's cost (issue 57: the "Choosing a model" page's
    table): SmolLM2 has 30 layers of 3 KV heads of 64 dims, K and V in F16, so 23,040 bytes
    a cell, plus the 12 bytes a saved cell carries (its position and sequence id)."""
    info = llamax.model_info(model_path)
    assert info.kv_bytes_per_cell == 30 * 3 * 64 * 2 * 2 + 12
    assert info.state_bytes_per_seq < 4096  # attention alone: a header, no fixed state
    assert llamax.info.max_cells(info, 8 << 30) == (
        ((8 << 30) - info.size_bytes - info.state_bytes_per_seq) // info.kv_bytes_per_cell
    )
    assert llamax.info.max_cells(info, info.size_bytes) == 0
    assert cli.main(["info", str(model_path)]) == 0
    out = capsys.readouterr().out
    assert "KV per cell:    22.5 KiB (F16; n_ctx 8192: 180 MiB)" in out
    assert "n_ctx in RAM:   8 GiB: " in out


@pytest.mark.model
@pytest.mark.integration
def test_info_says_whether_the_model_sees_images(
    capsys: pytest.CaptureFixture[str], model_path: Path
) -> None:
    """With ``--mmproj`` (issue 42) the projector is loaded and asked; without, it says so."""
    import vision_files

    projector = vision_files.script().cached_vision_model(projector="janus_pro")
    assert cli.main(["info", "--mmproj", str(projector), str(model_path)]) == 0
    assert "sees images:    yes\n" in capsys.readouterr().out
    assert cli.main(["info", str(model_path)]) == 0
    assert "sees images:    no (no --mmproj given)" in capsys.readouterr().out
    assert cli.main(["info", "--json", "--mmproj", str(projector), str(model_path)]) == 0
    assert json.loads(capsys.readouterr().out)["sees_images"] is True
    assert cli.main(["info", "--mmproj", str(model_path), str(model_path)]) == 1
    assert "projector" in capsys.readouterr().err  # a model is not a projector: typed error


@pytest.mark.model
@pytest.mark.integration
def test_bench_prints_tokens_per_second() -> None:
    child = spawn("bench", "--n", "1", "4", "--max-tokens", "8", *FAST, timeout=300)
    child.expect(r"N=1\s+[\d.]+ tok/s")
    child.expect(r"N=4\s+[\d.]+ tok/s .*x N=1")
    assert finish(child) == 0


@pytest.fixture
def no_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setitem(sys.modules, "llamax.server", None)  # import raises ImportError
    yield


def test_serve_without_the_extra(no_server: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["serve", "--port", "8000"]) == 2
    assert "install llamax[server]" in capsys.readouterr().err


def test_serve_forwards_its_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []
    server = types.ModuleType("llamax.server")
    server.main = lambda argv: seen.append(argv) or 0  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "llamax.server", server)
    assert cli.main(["serve", "--port", "8000", "--help"]) == 0
    assert seen == [["--port", "8000", "--help"]]


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main([])
    assert info.value.code == 2
    with pytest.raises(SystemExit) as info:
        cli.main(["run", "--max-tokens", "many"])
    assert info.value.code == 2
    assert cli.main(["bench", "--n", "0"]) == 2
