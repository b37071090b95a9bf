"""SamplingParams and ContextConfig validation."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

import llamax
from llamax.params import MAX_STOP_CHARS, MAX_STOP_STRINGS


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_k", -1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("min_p", 2.0),
        ("typical_p", 0.0),
        ("repeat_penalty", 0.0),
        ("presence_penalty", 3.0),
        ("frequency_penalty", -3.0),
        ("penalty_last_n", -2),
        ("seed", -1),
        ("seed", 2**32),
        ("stop", [""]),
        ("stop_token_ids", [-1]),
        ("logit_bias", {-1: 1.0}),
    ],
)
def test_bad_sampling_value_names_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field) as info:
        llamax.SamplingParams(**{field: value})  # type: ignore[arg-type]
    assert isinstance(info.value, llamax.InvalidParameterError)


def test_sampling_params_are_frozen_and_normalised() -> None:
    params = llamax.SamplingParams(stop="END", logit_bias={5: -1}, stop_token_ids=[7])
    assert params.stop == ("END",)
    assert params.stop_token_ids == (7,)
    assert dict(params.logit_bias) == {5: -1.0}
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.temperature = 1.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        params.logit_bias[6] = 1.0  # type: ignore[index]


@pytest.mark.parametrize(
    ("stop", "message"),
    [
        (["x"] * (MAX_STOP_STRINGS + 1), "at most 1024 strings, got 1025"),
        (["x"] * 700_000, "at most 1024 strings, got 700000"),
        (["x" * (MAX_STOP_CHARS + 1)], "at most 65536 characters in all, got 65537"),
        (["y" * 65] * MAX_STOP_STRINGS, "at most 65536 characters in all, got 66560"),
        (["ok", ""], "non-empty"),
    ],
)
def test_stop_list_is_capped(stop: list[str], message: str) -> None:
    with pytest.raises(llamax.InvalidParameterError, match=message):
        llamax.SamplingParams(stop=stop)


def test_stop_list_at_the_caps_is_accepted() -> None:
    stops = [f"{i:04d}" + "z" * 60 for i in range(MAX_STOP_STRINGS)]
    assert sum(map(len, stops)) == MAX_STOP_CHARS
    assert llamax.SamplingParams(stop=stops).stop == tuple(stops)
    assert llamax.SamplingParams(stop="é" * MAX_STOP_CHARS).stop == ("é" * MAX_STOP_CHARS,)


def test_greedy_and_penalty_flags() -> None:
    assert llamax.SamplingParams(temperature=0).is_greedy
    assert not llamax.SamplingParams().has_penalties
    assert llamax.SamplingParams(repeat_penalty=1.1).has_penalties
    assert not llamax.SamplingParams(repeat_penalty=1.1, penalty_last_n=0).has_penalties


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n_ctx", 8),
        ("n_seq_max", 0),
        ("n_seq_max", 1000),
        ("n_batch", 0),
        ("n_threads", 0),
        ("prefix_ram_share", 0),
        ("prefix_ram_share", 1.5),
        ("prefix_ram_share", True),
        ("prefix_disk_share", "half"),
        ("prefix_disk_share", float("nan")),
    ],
)
def test_bad_context_config_names_the_field(field: str, value: int) -> None:
    with pytest.raises(llamax.InvalidParameterError, match=field):
        llamax.ContextConfig(model_path="m.gguf", **{field: value})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"n_batch": 4, "n_seq_max": 8}, r"n_batch \(4\) must be >= n_seq_max \(8\)"),
        ({"n_ctx": 32, "n_seq_max": 64}, r"n_ctx \(32\) must be >= n_seq_max \(64\)"),
    ],
)
def test_fewer_batch_rows_than_sequences_names_both(options: dict[str, int], message: str) -> None:
    """llama.cpp aborts the process on these (see test_model_lifecycle.py)."""
    with pytest.raises(llamax.InvalidParameterError, match=message):
        llamax.ContextConfig(model_path="m.gguf", **options)  # type: ignore[arg-type]
    with pytest.raises(llamax.InvalidParameterError, match="n_seq_max"):
        llamax.Embedder("missing.gguf", n_ctx=16, n_seq_max=64)
    assert llamax.ContextConfig(model_path="m.gguf", n_batch=8, n_seq_max=8).n_batch == 8


HUGE = [10**400, -(10**400), 10**5000, 2**63]  # float() overflows; repr fails past 4,300 digits
NUMBER_FIELDS = [
    "max_tokens", "temperature", "top_p", "min_p", "typical_p", "repeat_penalty",
    "presence_penalty", "frequency_penalty", "top_k", "penalty_last_n", "seed", "n", "logprobs",
]  # fmt: skip


@pytest.mark.parametrize("value", HUGE, ids=["1e400", "-1e400", "1e5000", "2**63"])
@pytest.mark.parametrize("field", NUMBER_FIELDS)
def test_a_huge_int_is_a_typed_error_naming_the_field(field: str, value: int) -> None:
    with pytest.raises(llamax.InvalidParameterError, match=f"^{field} "):
        llamax.SamplingParams(**{field: value})  # type: ignore[arg-type]


@pytest.mark.parametrize("value", HUGE, ids=["1e400", "-1e400", "1e5000", "2**63"])
@pytest.mark.parametrize(
    ("field", "wrap"),
    [
        ("logit_bias", lambda v: {1: v}),
        ("logit_bias", lambda v: {v: 1.0}),
        ("stop_token_ids", lambda v: [7, v]),
        ("lora", lambda v: {"a": v}),
    ],
)
def test_a_huge_int_inside_a_field_is_a_typed_error(
    field: str, wrap: Callable[[int], object], value: int
) -> None:
    with pytest.raises(llamax.InvalidParameterError, match=f"^{field} "):
        llamax.SamplingParams(**{field: wrap(value)})  # type: ignore[arg-type]


@pytest.mark.parametrize("value", HUGE, ids=["1e400", "-1e400", "1e5000", "2**63"])
@pytest.mark.parametrize(
    "field",
    ["n_ctx", "n_seq_max", "n_ctx_seq", "max_step_ms", "n_batch", "n_ubatch", "n_threads",
     "n_threads_batch", "n_gpu_layers", "prefix_ram_bytes", "prefix_disk_bytes",
     "prefix_ram_share", "prefix_disk_share"],
)  # fmt: skip
def test_a_huge_int_in_the_context_config_is_a_typed_error(field: str, value: int) -> None:
    """Regression (issue 39): the shares were missing from the list of number fields, and
    ``repr`` of a 5,000-digit int raised ValueError from the share's own check."""
    with pytest.raises(llamax.InvalidParameterError, match=f"^{field} "):
        llamax.ContextConfig(model_path="m.gguf", **{field: value})  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [10**400, 10**5000], ids=["1e400", "1e5000"])
def test_a_huge_int_in_prompt_lookup_is_a_typed_error(value: int) -> None:
    with pytest.raises(llamax.InvalidParameterError, match="max_draft"):
        llamax.PromptLookup(max_draft=value)


def test_the_largest_ints_that_mean_something_are_still_taken() -> None:
    assert llamax.SamplingParams(max_tokens=2**63 - 1).max_tokens == 2**63 - 1
    assert llamax.SamplingParams(seed=2**32 - 1, logit_bias={2**31: -1}).seed == 2**32 - 1
