"""What a newcomer meets first on the command line (issue 57): a model file given where the
prompt goes, the thread flag's two spellings, ``run --help``'s order, ``~`` in model paths,
size messages that say what is true, and the chat page's address in ``serve``'s log.

In process, on the fake backend where the model does not matter (``llamax.Context`` is
replaced by one that records its model path)."""

from __future__ import annotations

import io
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_server_fake import SPECIALS, TEMPLATE

import llamax
from llamax import cli, demo
from llamax.templates.truncation import drop_oldest_turns
from llamax.testing import FakeBackend

LONG = "word " * 300


class NoStdin(io.StringIO):
    def read(self, *args: Any) -> str:
        raise AssertionError("stdin was read")

    def isatty(self) -> bool:
        return False


@pytest.fixture
def loaded(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str | None]]:
    """``llamax.Context`` as the CLI calls it: a fake context; the model paths it was given."""
    paths: list[str | None] = []
    real = llamax.Context

    def fake(model_path: str | None = None, **options: Any) -> llamax.Context:
        paths.append(model_path)
        backend = FakeBackend(
            n_ctx=options.get("n_ctx", 1024),
            metadata={"tokenizer.chat_template": TEMPLATE},
            special_tokens=SPECIALS,
        )
        return real(backend=backend, n_seq_max=options.get("n_seq_max", 1))

    monkeypatch.setattr(llamax, "Context", fake)
    monkeypatch.setattr(sys, "stdin", NoStdin())
    yield paths


def test_run_with_a_missing_gguf_says_model_file_not_found(
    loaded: list[str | None], capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["run", "nope.gguf"]) == 1
    err = capsys.readouterr().err
    assert "model file not found: nope.gguf" in err, err
    assert loaded == []  # nothing loaded, no prompt read


def test_run_takes_a_gguf_first_word_as_the_model(
    loaded: list[str | None], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    assert cli.main(["run", str(model), "Hi", "there", "--max-tokens", "3"]) == 0
    assert loaded == [str(model)]
    ns = cli._parser().parse_args(["chat", str(model)])
    assert ns.model_file == str(model)
    with pytest.raises(llamax.ModelLoadError, match="two models"):
        cli._model_path(cli._parser().parse_args(["bench", str(model), "--model", "x.gguf"]))


def test_both_thread_spellings_work_in_the_cli_and_the_demo() -> None:
    for flag in ("--n-threads", "--threads"):
        assert cli._parser().parse_args(["run", flag, "3"]).n_threads == 3
        assert demo.parse_args([flag, "3"]).threads == 3


def test_run_help_lists_its_own_flags_before_the_engine_flags(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    text = capsys.readouterr().out
    usage = text.split("\n\n")[0]
    assert "--n-ctx" not in usage  # the usage line is short
    sampling, engine = text.index("\nsampling ("), text.index("\nmodel and engine (")
    assert text.index("--raw") < sampling < text.index("--temperature") < engine
    assert engine < text.index("--n-ctx")


def test_a_tilde_in_a_model_path_is_the_home_folder(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    ctx = llamax.Context("~/models/m.gguf", backend=FakeBackend())
    try:
        assert ctx.config.model_path == str(tmp_path / "models" / "m.gguf")
    finally:
        ctx.close()
    with pytest.raises(llamax.ModelLoadError, match=str(tmp_path / "nope.gguf")):
        llamax.Context("~/nope.gguf")  # the message names the expanded path


def test_a_prompt_too_long_says_its_size_n_ctx_and_the_reply_reserve() -> None:
    """``llamax run --n-ctx 256`` with a long prompt: no "system messages" that are not
    there, and not "0 available" without saying why."""
    ctx = llamax.Context(
        backend=FakeBackend(
            n_ctx=256, metadata={"tokenizer.chat_template": TEMPLATE}, special_tokens=SPECIALS
        )
    )
    try:
        with ctx.chat() as chat, pytest.raises(llamax.ContextLengthError) as info:
            chat.send(LONG, llamax.SamplingParams(max_tokens=256))
    finally:
        ctx.close()
    text = str(info.value)
    assert "system" not in text, text
    size = info.value.num_prompt_tokens
    assert f"needs {size} tokens" in text and "holds 256 (n_ctx)" in text
    assert "256 of them kept for the reply (max_tokens)" in text
    assert f"raise n_ctx to at least {size + 256}" in text


def test_the_size_message_offers_a_smaller_max_tokens_when_that_would_fit() -> None:
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    with pytest.raises(llamax.ContextLengthError) as info:
        drop_oldest_turns(messages, lambda m: 100, 56, reserve=200)
    text = str(info.value)
    assert "1 system message" in text and "lower max_tokens to 156 or less" in text
    assert info.value.n_ctx == 256


def test_llama_cpp_rounding_line_is_debug_not_a_warning() -> None:
    from llamax.backend.native import native_log_level

    line = b"llama_context: n_ctx is not divisible by n_seq_max - rounding down to 3072\n"
    assert native_log_level(3, line) == logging.DEBUG
    assert native_log_level(3, b"llama_context: something else\n") == logging.WARNING


def test_serve_logs_the_chat_page_url(caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    pytest.importorskip("uvicorn")
    from llamax.server import cli as server_cli

    assert server_cli.chat_page_url("0.0.0.0", 8000) == "http://localhost:8000/"
    assert server_cli.chat_page_url("::1", 8000) == "http://[::1]:8000/"
    assert server_cli.chat_page_url("127.0.0.1", 9) == "http://127.0.0.1:9/"
    with caplog.at_level(logging.INFO, logger="llamax.server"):
        status = server_cli.main([str(tmp_path / "nope.gguf"), "--port", "0"])
    assert status == 1  # the model did not load
    assert "chat page: http://127.0.0.1:0/" in caplog.text


@pytest.mark.model
def test_a_context_below_256_cells_says_so(
    model_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG, logger="llamax.llama_cpp"):
        with llamax.Context(model_path, n_ctx=128, n_seq_max=1, n_threads=1) as ctx:
            assert ctx.n_ctx == 256
        with llamax.Context(model_path, n_ctx=2048, n_seq_max=6, n_threads=1) as ctx:
            assert ctx.n_ctx == 2048
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("n_ctx=128" in w and "256" in w for w in warnings), warnings
    assert not any("rounding down" in w for w in warnings), warnings
