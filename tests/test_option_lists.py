"""One source per option list: the fields of SamplingParams and ContextConfig, with their docs.

The server's request model, the OpenAI mapping, the command-line flags and the docs tables
are derived from the fields. These tests pin that the derived artefacts equal what was
written by hand before, and that a new option is one field plus its doc.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pydantic
import pytest

import llamax
from llamax import cli, flags
from llamax.chat import options as openai_options
from llamax.chat.options import CompletionOptions, sampling_params
from llamax.config import OPTION_LISTS, ContextConfig, ContextOptions
from llamax.dialects.json_types import FieldError, read_fields
from llamax.dialects.openai_parse import (
    CHAT_TYPES,
    TEXT_TYPES,
    StreamOptions,
    parse_chat,
    parse_text,
    sampling_types,
)
from llamax.drafting import Drafter, DraftMethod
from llamax.optionspec import generated_blocks, markdown_table, openai_defaults, spec
from llamax.params import SamplingParams

DOCS = Path(__file__).resolve().parents[1] / "docs"


@dataclass(frozen=True, slots=True)
class WithTailFree(SamplingParams):
    """SamplingParams plus one new option: the whole change a new option needs."""

    tfs_z: float = field(
        default=1.0,
        metadata=spec(doc="tail-free sampling; `1` disables it", flag=True, openai=1.0),
    )


# --- a new option is one field plus its doc -------------------------------------------------


def test_a_new_sampling_option_reaches_the_server_schema() -> None:
    fields = sampling_types(WithTailFree)
    assert fields["tfs_z"] == float | None
    assert "tfs_z" not in sampling_types()
    assert read_fields({"tfs_z": 0.5}, fields) == {"tfs_z": 0.5}
    with pytest.raises(FieldError, match="valid number"):
        read_fields({"tfs_z": "0.5"}, fields)  # strict, as every other number
    with pytest.raises(FieldError, match="unknown field 'tfs'"):
        read_fields({"tfs": 0.5}, fields)


def test_a_new_sampling_option_reaches_the_openai_mapping(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(openai_options, "SamplingParams", WithTailFree)
    params = sampling_params(typing.cast(CompletionOptions, {"tfs_z": 0.5}), chat=True)
    assert isinstance(params, WithTailFree)
    assert params.tfs_z == 0.5
    assert typing.cast(WithTailFree, sampling_params({}, chat=False)).tfs_z == 1.0


def test_a_new_sampling_option_reaches_the_command_line() -> None:
    parser = argparse.ArgumentParser()
    flags.add_option_flags(parser, WithTailFree)
    help_text = " ".join(parser.format_help().split())
    assert "--tfs-z TFS_Z tail-free sampling; 1 disables it (default: 1.0)" in help_text
    ns = parser.parse_args(["--tfs-z", "0.25", "--top-k", "5"])
    values = flags.option_values(ns, WithTailFree)
    assert values == {"tfs_z": 0.25, "top_k": 5}
    assert WithTailFree(**values).tfs_z == 0.25
    assert flags.option_values(parser.parse_args([]), WithTailFree) == {}


def test_a_new_sampling_option_reaches_the_docs_tables() -> None:
    row = "| `tfs_z` | `1.0` | tail-free sampling; `1` disables it |"
    assert row in markdown_table(WithTailFree, "fields")
    assert row in markdown_table(WithTailFree, "openai")
    assert "| `--tfs-z` | `1.0` |" in markdown_table(WithTailFree, "flags")
    assert "tfs_z" not in markdown_table(SamplingParams, "fields")


# --- the docs tables are current, and every option has a doc -------------------------------


def test_the_docs_option_tables_are_current() -> None:
    found = 0
    for path in sorted(DOCS.glob("*.md")):
        text = path.read_text(encoding="utf-8")
        for current, wanted in generated_blocks(text, OPTION_LISTS):
            found += 1
            assert current == wanted, (
                f"{path.name}: an options table is stale; run python scripts/option_tables.py"
            )
    assert found >= 5  # api.md (2), server.md, chat.md, cli.md


@pytest.mark.parametrize("cls", [SamplingParams, ContextConfig])
def test_every_option_has_a_doc(cls: type) -> None:
    for f in dataclasses.fields(cls):
        if f.name == "model_path":
            continue
        assert f.metadata["llamax"].doc.strip(), f"{cls.__name__}.{f.name} has no doc"


# --- the static mirrors equal the source -----------------------------------------------------


def test_completion_options_keys_are_the_sources() -> None:
    own = {"model", "user", "stream_options", "logprobs", "top_logprobs", "response_format"}
    assert set(CompletionOptions.__annotations__) == set(openai_defaults(SamplingParams)) | own
    assert set(CompletionOptions.__annotations__) | {"stream"} == openai_options.COMPLETION_OPTIONS


def test_context_options_equal_the_config_fields() -> None:
    config = typing.get_type_hints(ContextConfig)
    del config["model_path"]
    assert typing.get_type_hints(ContextOptions) == config


# --- the derived artefacts equal the hand-written ones they replace -------------------------


OLD_SAMPLING_FIELDS: dict[str, Any] = {  # the hand-written model, in its order
    "model": str | None,
    "max_tokens": int | None,
    "temperature": float | None,
    "top_p": float | None,
    "stop": str | list[str] | None,
    "n": int | None,
    "seed": int | None,
    "logit_bias": dict[str, float] | None,
    "presence_penalty": float | None,
    "frequency_penalty": float | None,
    "stream": bool | None,
    "stream_options": StreamOptions | None,
    "response_format": dict[str, Any] | None,
    "user": str | None,
    "top_k": int | None,
    "min_p": float | None,
    "repeat_penalty": float | None,
    "grammar": str | None,
    "speculative": bool | dict[str, int] | None,
    "lora": list[dict[str, str | int | float]] | dict[str, float] | None,
}


def test_the_server_schema_equals_the_hand_written_one() -> None:
    expected = OLD_SAMPLING_FIELDS
    for fields, own in (
        (
            CHAT_TYPES,
            {
                "messages",
                "max_completion_tokens",
                "logprobs",
                "top_logprobs",
                "truncate",
                "tools",
                "tool_choice",
                "parallel_tool_calls",
                "reasoning_format",
                "enable_thinking",
                "chat_template_kwargs",
                "reasoning_effort",
                "timings_per_token",  # llama-server's chat extensions (issue 41)
                "verbose",
                "return_progress",
                "prompt_cache_key",  # hints that keep the prefix longer (issue 56)
                "prompt_cache_retention",
            },
        ),
        (TEXT_TYPES, {"prompt", "logprobs", "echo", "suffix"}),
    ):
        assert set(fields) == set(expected) | own
        for name, annotation in expected.items():
            assert fields[name] == annotation, name


BAD_BODIES = [
    {"temperature": "hot"},
    {"temperature": True},
    {"top_p": "1"},
    {"n": 1.5},
    {"seed": "7"},
    {"stop": 3},
    {"stop": ["a", 3]},
    {"logit_bias": {"5": "x"}},
    {"logit_bias": [1]},
    {"speculative": "yes"},
    {"speculative": {"max_draft": "8"}},
    {"grammar": 1},
    {"stream": "true"},
    {"stream_options": {"include_usage": 1}},
    {"tempreature": 1.0},
    {"max_tokens": None, "top_k": 1.0},
    {"temperature": "x", "top_k": "y"},  # two bad fields: the same one is named
    {"response_format": "json"},
]


@pytest.mark.parametrize("extra", BAD_BODIES, ids=str)
def test_bad_bodies_get_todays_400(extra: dict[str, Any]) -> None:
    expected = {
        parse_chat: _old_message(extra, chat=True),
        parse_text: _old_message(extra, chat=False),
    }
    for parse, (param, message) in expected.items():
        body = {"messages": [{"role": "user", "content": "hi"}], "prompt": "hi", **extra}
        body.pop("prompt" if parse is parse_chat else "messages")
        with pytest.raises(FieldError) as caught:
            parse(body)
        assert caught.value.code in ("unknown_field", "invalid_type")
        assert (caught.value.param, str(caught.value)) == (param, message)


class _OldStreamOptions(pydantic.BaseModel):
    """The hand-written ``stream_options`` model."""

    model_config = pydantic.ConfigDict(extra="forbid", strict=True, title="StreamOptions")
    include_usage: bool = False
    include_obfuscation: bool = False


def _old_message(extra: dict[str, Any], *, chat: bool) -> tuple[str | None, str]:
    """What the hand-written model answered (same types, same strictness)."""
    from pydantic import ConfigDict, create_model

    fields: dict[str, Any] = {
        name: (annotation, None) for name, annotation in OLD_SAMPLING_FIELDS.items()
    }
    fields["stream_options"] = (_OldStreamOptions | None, None)
    fields["messages" if chat else "prompt"] = (list[dict[str, Any]] if chat else str, ...)
    old = create_model("Old", __config__=ConfigDict(extra="forbid", strict=True), **fields)
    body = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    try:
        old.model_validate({**body, **extra})
    except pydantic.ValidationError as exc:
        errors = exc.errors()
        first = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
        location = ".".join(str(part) for part in first["loc"])
        param = str(first["loc"][0])
        if first["type"] == "extra_forbidden":
            return param, f"unknown field {location!r}"
        return param, f"{location}: {first['msg']}"
    raise AssertionError(f"{extra} was valid")


def _old_sampling_params(options: dict[str, Any], *, chat: bool) -> SamplingParams:
    """The hand-written mapper the derived one replaces."""
    stop = options.get("stop")
    return SamplingParams(
        max_tokens=options.get("max_tokens"),
        temperature=options.get("temperature", 1.0),
        top_p=options.get("top_p", 1.0),
        top_k=options.get("top_k", 0),
        min_p=options.get("min_p", 0.0),
        repeat_penalty=options.get("repeat_penalty", 1.0),
        stop=() if stop is None else stop,
        n=options.get("n", 1),
        seed=options.get("seed"),
        logit_bias=openai_options._logit_bias(options.get("logit_bias")),
        presence_penalty=options.get("presence_penalty", 0.0),
        frequency_penalty=options.get("frequency_penalty", 0.0),
        logprobs=openai_options._logprobs(typing.cast(CompletionOptions, options), chat=chat),
        grammar=options.get("grammar"),
        json_schema=openai_options._response_schema(options.get("response_format")),
        speculative=openai_options._speculative(options.get("speculative")),
    )


MAPPED = [
    {},
    {"max_tokens": 7, "temperature": 0, "top_p": 0.5, "top_k": 3, "min_p": 0.1},
    {"repeat_penalty": 1.2, "presence_penalty": 1, "frequency_penalty": -1, "n": 2, "seed": 4},
    {"stop": "x", "logit_bias": {"5": -100, 6: 2}, "grammar": 'root ::= "a"'},
    {"stop": ["a", "b"], "logprobs": True, "top_logprobs": 3},
    {"logprobs": 2},
    {"response_format": {"type": "json_object"}, "speculative": {"max_draft": 4}},
    {"speculative": True},
]


@pytest.mark.parametrize("options", MAPPED, ids=str)
@pytest.mark.parametrize("chat", [True, False])
def test_the_openai_mapping_equals_the_hand_written_one(
    options: dict[str, Any], chat: bool
) -> None:
    got = sampling_params(typing.cast(CompletionOptions, options), chat=chat)
    assert got == _old_sampling_params(options, chat=chat)


BAD_OPTIONS = [
    {"temperature": None},
    {"top_p": 7},
    {"logit_bias": {"x": 1}, "top_logprobs": 2},  # the first bad one is named first
    {"top_logprobs": 2, "response_format": 3},
    {"response_format": {"type": "xml"}, "speculative": "on"},
    {"speculative": {"max_drafts": 1}},
    {"n": 0, "speculative": 5},
]


@pytest.mark.parametrize("options", BAD_OPTIONS, ids=str)
def test_the_openai_mapping_refuses_as_before(options: dict[str, Any]) -> None:
    with pytest.raises(llamax.InvalidParameterError) as old:
        _old_sampling_params(options, chat=True)
    with pytest.raises(llamax.InvalidParameterError) as new:
        sampling_params(typing.cast(CompletionOptions, options), chat=True)
    assert str(new.value) == str(old.value)


# --- command-line flags -----------------------------------------------------------------------


def _serve_parser() -> argparse.ArgumentParser:
    pytest.importorskip("uvicorn")
    from llamax.server.cli import build_parser

    return build_parser()


def test_serve_flags_keep_their_names_and_defaults() -> None:
    parser = _serve_parser()
    old = {
        "n_ctx": 4096,
        "n_seq_max": 16,
        "n_batch": 512,
        "n_gpu_layers": -1,
        "n_ctx_seq": None,
        "kv_layout": "auto",
        "max_step_ms": 250.0,
    }
    given = flags.option_values(parser.parse_args([]), ContextConfig)
    assert ContextConfig("m.gguf", **given) == ContextConfig("m.gguf", **old)
    argv = "--n-ctx 8192 --n-seq-max 4 --n-ctx-seq 1024 --kv-layout streams --max-step-ms 0"
    argv += " --speculative 6 --n-batch 64 --n-threads 3 --n-gpu-layers 0"
    ns = parser.parse_args(argv.split())
    assert flags.option_values(ns, ContextConfig) == {
        "n_ctx": 8192,
        "n_seq_max": 4,
        "n_ctx_seq": 1024,
        "kv_layout": "streams",
        "max_step_ms": None,
        "speculative": llamax.PromptLookup(max_draft=6),
        "n_batch": 64,
        "n_threads": 3,
        "n_gpu_layers": 0,
    }
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-layout", "diagonal"])


def test_serve_reads_the_chat_template_file(tmp_path: Path) -> None:
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages }}", encoding="utf-8")
    ns = _serve_parser().parse_args(["--chat-template", str(template), "--no-prefix-cache"])
    assert flags.option_values(ns, ContextConfig) == {
        "chat_template": "{{ messages }}",
        "prefix_cache": False,
    }
    missing = _serve_parser().parse_args(["--chat-template", str(tmp_path / "none")])
    with pytest.raises(OSError):
        flags.option_values(missing, ContextConfig)


@pytest.mark.parametrize("flag", ["--threads", "--n-threads"])
def test_every_command_line_takes_both_thread_spellings(flag: str) -> None:
    ns = cli._parser().parse_args(["run", flag, "2", "hi"])
    assert flags.option_values(ns, ContextConfig) == {"n_threads": 2}
    assert flags.option_values(_serve_parser().parse_args([flag, "2"]), ContextConfig) == {
        "n_threads": 2
    }
    assert "threads" not in vars(cli._parser().parse_args(["bench"]))
    help_text = _serve_parser().format_help()
    assert "--n-threads" in help_text and "--threads" not in help_text


def test_run_keeps_its_sampling_defaults() -> None:
    ns = cli._parser().parse_args(["run", "hi"])
    assert cli._params(ns) == SamplingParams(max_tokens=256, temperature=0.7, seed=None)
    ns = cli._parser().parse_args(["chat", "--temperature", "0", "--top-k", "1", "--seed", "3"])
    assert cli._params(ns) == SamplingParams(max_tokens=256, temperature=0, top_k=1, seed=3)
    ns = cli._parser().parse_args(["run", "--speculative", "5", "--n-ctx", "1024", "hi"])
    assert flags.option_values(ns, ContextConfig) == {
        "n_ctx": 1024,
        "speculative": llamax.PromptLookup(max_draft=5),
    }
    with pytest.raises(SystemExit):
        cli._parser().parse_args(["run", "--n-seq-max", "2", "hi"])  # each command sets it


def test_flags_need_a_parseable_type() -> None:
    @dataclass(frozen=True, slots=True)
    class WithMapping(SamplingParams):
        table: Literal["a", "b"] = field(default="a", metadata=spec(doc="choice", flag=True))
        extra: dict[str, int] | None = field(default=None, metadata=spec(doc="map", flag=True))

    with pytest.raises(TypeError, match="needs a flag_type"):
        flags.add_option_flags(argparse.ArgumentParser(), WithMapping)


# --- the drafter seam -------------------------------------------------------------------------


class _OtherMethod:
    """A drafting method that is not a PromptLookup: the protocol, not the class, admits it."""

    def new_drafter(self) -> Drafter:
        return llamax.PromptLookup().new_drafter()


def test_params_accept_any_draft_method() -> None:
    assert isinstance(_OtherMethod(), DraftMethod)
    assert isinstance(llamax.PromptLookup(), DraftMethod)
    method: Any = _OtherMethod()
    assert SamplingParams(speculative=method).speculative is method
    assert ContextConfig("m.gguf", speculative=method).speculative is method
    with pytest.raises(llamax.InvalidParameterError, match="speculative must be None, a bool"):
        SamplingParams(speculative=typing.cast(Any, "lookup"))
    with pytest.raises(llamax.InvalidParameterError, match="speculative must be None or"):
        ContextConfig("m.gguf", speculative=typing.cast(Any, True))
