"""llama-server's native fields as ``RequestField`` tables (issue 58): ``/completion``'s and
``/infill``'s parsers are driven by the rows of ``llamax.dialects.llama``, the docs
tables are generated from them, and one function reports ``generation_settings``. The
behaviour pinned here is the one before the tables (the same fields accepted and refused,
the same messages, codes and ``param``s, the same settings)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import llamax
from llamax.dialects import llama_native
from llamax.dialects.fields import FieldError, Support, generated_blocks, honoured
from llamax.dialects.llama import (
    COMPLETION,
    DEFAULT_SETTINGS,
    INFILL,
    NATIVE_TABLES,
    SAMPLING,
    TAKEN_AS_GIVEN,
    generation_settings,
)
from llamax.server.errors import APIError
from llamax.server.llama import infill
from llamax.server.llama.errors import as_llama_error
from llamax.server.schemas import FIELD_TABLES


def parse_native(body: dict[str, Any]) -> Any:
    """``/completion``'s codec, its refusals as the route answers them (an ``APIError``)."""
    try:
        return llama_native.parse_native(body)
    except FieldError as exc:
        raise as_llama_error(exc) from exc


DOCS = Path(__file__).parent.parent / "docs"

OFF = {
    "mirostat": 0, "dry_multiplier": 0, "xtc_probability": 0, "dynatemp_range": 0,
    "top_n_sigma": -1, "adaptive_target": -1, "n_indent": 0, "n_discard": 0,
    "t_max_predict_ms": 0, "t_max_prompt_ms": -1, "min_keep": 0, "grammar_lazy": False,
}  # fmt: skip
"""``/completion``'s fields accepted only at the value that turns them off."""
MOOT = {
    "dynatemp_exponent", "dry_base", "dry_allowed_length", "dry_penalty_last_n",
    "dry_sequence_breakers", "mirostat_tau", "mirostat_eta", "xtc_threshold",
    "adaptive_decay", "n_keep", "n_cache_reuse", "sse_ping_interval", "verbose",
    "backend_sampling", "stream_options",
}  # fmt: skip
"""``/completion``'s fields accepted with any value and never read."""
INFILL_REFUSED = {
    "mirostat": 0, "dynatemp_range": 0.0, "xtc_probability": 0.0, "dry_multiplier": 0.0,
    "top_n_sigma": -1.0, "n_probs": 0, "n_cmpl": 1, "samplers": None, "lora": None,
    "logit_bias": None, "n_keep": 0,
}  # fmt: skip
"""``/infill``'s fields refused unless absent, null or at llama-server's default."""
SETTINGS_JSON = (
    '{"seed": 4294967295, "temperature": 0.8, "dynatemp_range": 0.0, "dynatemp_exponent": 1.0, '
    '"top_k": 40, "top_p": 0.95, "min_p": 0.05, "top_n_sigma": -1.0, "xtc_probability": 0.0, '
    '"xtc_threshold": 0.1, "typical_p": 1.0, "repeat_last_n": 64, "repeat_penalty": 1.0, '
    '"presence_penalty": 0.0, "frequency_penalty": 0.0, "dry_multiplier": 0.0, "dry_base": '
    '1.75, "dry_allowed_length": 2, "dry_penalty_last_n": 64, "dry_sequence_breakers": ["\\n", '
    '":", "\\"", "*"], "mirostat": 0, "mirostat_tau": 5.0, "mirostat_eta": 0.1, '
    '"adaptive_target": -1.0, "adaptive_decay": 0.9, "stop": [], "max_tokens": -1, '
    '"n_predict": -1, "n_keep": 0, "n_discard": 0, "ignore_eos": false, "stream": false, '
    '"logit_bias": [], "n_probs": 0, "min_keep": 0, "grammar": "", "grammar_lazy": false, '
    '"samplers": ["top_k", "typ_p", "top_p", "min_p", "temperature"], "timings_per_token": '
    'false, "post_sampling_probs": false, "backend_sampling": false, "lora": []}'
)
"""``/props``' and ``/completion``'s default ``generation_settings``, byte for byte."""


class Recorder(dict[str, Any]):
    """A body that records the fields a parser reads by name."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.read: set[str] = set()

    def __getitem__(self, key: str) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)


# --- the tables ------------------------------------------------------------------------------
@pytest.mark.parametrize("table", [COMPLETION, INFILL])
def test_each_row_is_one_field_with_a_doc(table: Any) -> None:
    names = [f.name for f in table]
    assert len(names) == len(set(names))
    assert all(f.doc for f in table)
    assert all(f.refusal for f in table if f.support is Support.REFUSED)
    params = {f.name for f in dataclasses.fields(llamax.SamplingParams)}
    assert {f.option for f in table if f.option is not None} <= params


def test_completion_takes_refuses_and_ignores_what_it_did() -> None:
    assert {f.name for f in COMPLETION} == llama_native.FIELDS
    assert {f.name: f.support for f in COMPLETION if f.support is not Support.HONOURED} == {
        **dict.fromkeys(MOOT, Support.HINT),
        **dict.fromkeys(OFF, Support.REFUSED),
    }
    refused = {f.name: f for f in INFILL if f.support is Support.REFUSED}
    assert set(refused) == set(INFILL_REFUSED)


def test_the_docs_tables_are_current() -> None:
    text = (DOCS / "server.md").read_text(encoding="utf-8")
    for route in NATIVE_TABLES:
        assert text.count(f"<!-- fields: {route} -->") == 1, route
    for current, wanted in generated_blocks(text, FIELD_TABLES | NATIVE_TABLES):
        assert current == wanted, "a fields table is stale; run python scripts/option_tables.py"


# --- the parsers read the honoured fields, never a hint ----------------------------------------
def test_completion_reads_each_honoured_field_and_no_hint() -> None:
    body = Recorder(
        {"prompt": "Hi", "n_predict": 4, "seed": 1, "stop": ["x"], "ignore_eos": False,
         "grammar": "", "json_schema": None, "logit_bias": [], "n_probs": 0,
         "post_sampling_probs": False, "samplers": ["top_k", "temperature"], "n_cmpl": 1,
         "cache_prompt": True, "id_slot": -1, "return_tokens": False,
         "timings_per_token": False, "stream": False, "response_fields": [], "lora": [],
         "return_progress": False, "model": "m", "stream_options": {"include_usage": True}}
        | {f.name: DEFAULT_SETTINGS[f.name] for f in SAMPLING}
        | {name: DEFAULT_SETTINGS.get(name, 1) for name in MOOT - {"stream_options"}}
    )  # fmt: skip
    assert set(body) == honoured(COMPLETION) | MOOT
    parse_native(body)
    assert body.read == honoured(COMPLETION)


def test_infill_reads_each_honoured_field_and_no_other(monkeypatch: pytest.MonkeyPatch) -> None:
    body = Recorder(
        {"input_prefix": "a", "input_suffix": "b", "input_extra": [], "prompt": "", "seed": 1,
         "n_predict": 4, "max_tokens": 4, "stop": "x", "ignore_eos": False, "grammar": None,
         "json_schema": None, "stream": False, "return_tokens": False, "cache_prompt": True,
         "id_slot": -1, "model": "m", "dry_base": 2, "editor_field": 1}
        | {f.name: DEFAULT_SETTINGS[f.name] for f in SAMPLING}
    )  # fmt: skip
    monkeypatch.setattr(infill, "parse_object", lambda raw: body)
    config = SimpleNamespace(default_max_tokens=None, default_seed=None)
    infill._parse(b"", state=SimpleNamespace(config=config))  # type: ignore[arg-type]
    assert body.read == honoured(INFILL)


# --- refusals: the same messages, codes and params ---------------------------------------------
@pytest.mark.parametrize(("name", "value"), OFF.items())
def test_completion_refuses_an_off_field_unless_off(name: str, value: object) -> None:
    with pytest.raises(APIError) as caught:
        parse_native({"prompt": "Hi", name: 7})
    error = caught.value
    assert (error.status, error.code, error.param) == (400, "unsupported_field", name)
    assert error.message == (
        f"{name} is not supported by llamax (only {value!r}, which turns it off); see "
        "docs/server.md"
    )
    for harmless in (value, float(value) if isinstance(value, int) else value):
        parse_native({"prompt": "Hi", name: harmless})
    with pytest.raises(APIError):
        parse_native({"prompt": "Hi", name: None})


def test_completion_refuses_an_unknown_field_before_anything_else() -> None:
    with pytest.raises(APIError) as caught:
        parse_native({"zzz": 1, "nonsense": 1, "mirostat": 2})
    error = caught.value
    assert (error.message, error.param, error.code) == (
        "unknown field 'nonsense'",
        "nonsense",
        "unknown_field",
    )


@pytest.mark.parametrize(("name", "value"), INFILL_REFUSED.items())
def test_infill_refuses_a_field_unless_absent_null_or_its_default(name: str, value: object) -> None:
    with pytest.raises(APIError) as caught:
        infill.sampling_params({name: 7})
    error = caught.value
    assert error.status == 400 and error.param == name
    assert error.message == (
        f"{name} is not supported by llamax on this route (send {value!r} or leave it out)"
    )
    infill.sampling_params({name: value})
    infill.sampling_params({name: None})


def test_infill_ignores_fields_in_no_row() -> None:
    llama_native.check_fields(
        INFILL, {"dry_base": 3, "t_max_prompt_ms": 500, "samplers_x": 1}, unknown="ignore"
    )
    with pytest.raises(FieldError):
        llama_native.check_fields(COMPLETION, {"samplers_x": 1}, unknown="refuse")


# --- one mapping of the sampling names -------------------------------------------------------
def test_the_default_settings_are_byte_for_byte_llama_servers_shape() -> None:
    assert json.dumps(DEFAULT_SETTINGS) == SETTINGS_JSON
    defaults = llamax.SamplingParams()
    for row in SAMPLING:  # derived from SamplingParams' defaults
        assert row.option is not None
        assert DEFAULT_SETTINGS[row.name] == getattr(defaults, row.option)
    assert llama_native.default_settings(64, 42) == DEFAULT_SETTINGS | {
        "n_predict": 64,
        "max_tokens": 64,
        "seed": 42,
    }


@pytest.mark.parametrize("row", SAMPLING, ids=lambda row: row.name)
def test_each_sampling_field_maps_to_its_option_on_both_routes(row: Any) -> None:
    value = {"top_k": 7, "repeat_last_n": 9}.get(row.name, 0.5)
    native = parse_native({"prompt": "Hi", row.name: value})
    assert native.params is not None and getattr(native.params, row.option) == value
    assert native.settings[row.name] == value
    params = infill.sampling_params({row.name: value})
    assert getattr(params, row.option) == value
    assert generation_settings(params)[row.name] == value
    assert row in TAKEN_AS_GIVEN


def test_infill_settings_are_what_runs_in_llama_servers_names() -> None:
    body = {"n_predict": 5, "seed": 3, "temperature": 0.2, "repeat_last_n": 8, "stop": "x",
            "stream": True}  # fmt: skip
    params = infill.sampling_params(body)
    settings = infill._settings(body, params)
    assert json.dumps(settings) == (
        '{"n_predict": 5, "seed": 3, "temperature": 0.2, "top_k": 40, "top_p": 0.95, '
        '"min_p": 0.05, "typical_p": 1.0, "repeat_last_n": 8, "repeat_penalty": 1.0, '
        '"presence_penalty": 0.0, "frequency_penalty": 0.0, "ignore_eos": false, "stop": '
        '["x"], "stream": true, "n_probs": 0, "cache_prompt": true}'
    )


def test_a_refused_sampling_value_is_named_as_the_client_gave_it() -> None:
    with pytest.raises(APIError) as caught:
        parse_native({"prompt": "Hi", "repeat_last_n": -5})
    assert caught.value.param == "repeat_last_n"
    assert caught.value.message.startswith("repeat_last_n ")


def test_the_pure_check_says_what_the_server_refuses() -> None:
    """The policy is in ``llamax.dialects.llama`` (no server error type); the server's
    ``check_fields`` answers its verdict as a 400."""
    from llamax.dialects.llama import FieldRefusal, field_refusal

    assert field_refusal(INFILL, {"dry_base": 3, "samplers_x": 1}, unknown="ignore") is None
    assert field_refusal(COMPLETION, {"samplers_x": 1}, unknown="refuse") == FieldRefusal(
        "samplers_x", "unknown field 'samplers_x'", "unknown_field"
    )
    refused = field_refusal(COMPLETION, {"mirostat": 2}, unknown="refuse")
    assert refused is not None and (refused.param, refused.code) == (
        "mirostat",
        "unsupported_field",
    )
