"""Per-request LoRA on SmolLM2 (issue 26, item 1): a rank-8 adapter written by
scripts/make_lora_adapter.py (random weights, so it teaches nothing but moves the logits).

Scale 0 is the base model; the adapter changes greedy output; requests under two sets and
none, run together, give what each gives alone (up to llama.cpp's near ties, probed under
the same adapters); a bad adapter file is a typed error and the engine goes on; over
HTTP the ``openai`` client picks an adapter with ``extra_body={"lora": [...]}``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from near_tie import assert_greedy_agrees
from script_modules import load_script

import llamax
from llamax.server import BackgroundServer, create_app
from llamax.testing import assert_idle

pytestmark = pytest.mark.model

PROMPT = "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n"


def _writer() -> Any:
    return load_script("make_lora_adapter").write_lora_adapter


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("lora")
    write = _writer()
    return {
        "warm": str(write(folder / "warm.gguf", seed=1)),
        "cold": str(write(folder / "cold.gguf", seed=2)),
    }


@pytest.fixture(scope="module")
def lora_ctx(model_path: Path, adapters: dict[str, str]) -> Iterator[llamax.Context]:
    ctx = llamax.Context(model_path, n_ctx=2048, n_seq_max=8, n_batch=512, lora=adapters)
    yield ctx
    ctx.close()


def greedy(max_tokens: int = 24, **options: Any) -> llamax.SamplingParams:
    return llamax.SamplingParams(max_tokens=max_tokens, temperature=0, **options)


def test_scale_zero_is_the_base_model_and_the_adapter_changes_greedy_output(
    lora_ctx: llamax.Context,
) -> None:
    base = lora_ctx.add_request(PROMPT, greedy()).result()
    zero = lora_ctx.add_request(PROMPT, greedy(lora={"warm": 0.0})).result()
    lora_ctx.clear_cache()
    warm = lora_ctx.add_request(PROMPT, greedy(lora={"warm": 1.0})).result()
    assert zero.choices[0].token_ids == base.choices[0].token_ids
    assert warm.choices[0].token_ids != base.choices[0].token_ids
    assert_idle(lora_ctx)


@pytest.mark.integration
def test_mixed_adapter_sets_together_give_what_each_gives_alone(
    lora_ctx: llamax.Context, make_real: Callable[..., llamax.Context], adapters: dict[str, str]
) -> None:
    sets: list[dict[str, float] | None] = [None, {"warm": 1.0}, {"cold": 1.0}, {"warm": 0.5}]
    prompts = [f"{PROMPT}{i}." for i in range(len(sets))]
    alone = []
    for prompt, lora in zip(prompts, sets, strict=True):
        lora_ctx.clear_cache()
        alone.append(lora_ctx.add_request(prompt, greedy(lora=lora)).result())
    lora_ctx.clear_cache()
    handles = [lora_ctx.add_request(p, greedy(lora=s)) for p, s in zip(prompts, sets, strict=True)]
    together = [h.result() for h in handles]
    probe = make_real(n_ctx=1024, n_seq_max=1, lora=adapters)
    for prompt, lora, solo, mixed in zip(prompts, sets, alone, together, strict=True):
        assert_greedy_agrees(
            probe,
            lora_ctx.tokenize(prompt),
            solo.choices[0].token_ids,
            mixed.choices[0].token_ids,
            lora=lora,
        )
    assert_idle(lora_ctx)


def test_a_bad_adapter_file_is_a_typed_error_and_the_engine_goes_on(
    lora_ctx: llamax.Context, tmp_path: Path, model_path: Path
) -> None:
    lying = tmp_path / "lying.gguf"
    lying.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(llamax.ModelLoadError, match="could not load"):
        lora_ctx.load_adapter("lying", lying)
    with pytest.raises(llamax.ModelLoadError, match="could not load"):
        lora_ctx.load_adapter("a_model", model_path)  # a model, not an adapter
    with pytest.raises(llamax.ModelLoadError, match="no file"):
        lora_ctx.load_adapter("missing", tmp_path / "missing.gguf")
    assert list(lora_ctx.adapters) == ["warm", "cold"]
    assert lora_ctx.add_request(PROMPT, greedy(lora={"cold": 1.0})).result().text


@pytest.mark.integration
def test_the_openai_client_picks_an_adapter(lora_ctx: llamax.Context) -> None:
    """The user's path over a real socket; the default run keeps the seam itself
    (test_scale_zero_is_the_base_model_and_the_adapter_changes_greedy_output)."""
    with BackgroundServer(create_app(lora_ctx)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        (model,) = client.models.list().data
        assert [a["name"] for a in model.model_extra["adapters"]] == ["warm", "cold"]
        messages: Any = [{"role": "user", "content": "Name three colours."}]

        def ask(**extra: Any) -> str:
            reply = client.chat.completions.create(
                model="m", messages=messages, max_tokens=16, temperature=0, extra_body=extra
            )
            return reply.choices[0].message.content or ""

        base = ask()
        assert ask(lora=[{"name": "warm", "scale": 0.0}]) == base
        # the adapter's flat, random logits tie often: a cached prefix may part from a
        # cold one (tests/near_tie.py), so only the base model's reply is compared
        assert ask(lora=[{"id": 0, "scale": 1.0}]) != base
        assert ask(lora={"warm": 1.0}) != base
        with pytest.raises(openai.BadRequestError, match="no adapter named 'nope'"):
            ask(lora=[{"name": "nope"}])
        with pytest.raises(openai.BadRequestError, match="needs one of 'id' or 'name'"):
            ask(lora=[{"scale": 1.0}])
        assert ask() == base
    assert_idle(lora_ctx)


# ---------------------------------------------------------------------- issue 36, item 2
def test_a_fork_or_a_loaded_session_never_gives_its_adapter_kv_to_base_requests(
    lora_ctx: llamax.Context,
    make_real: Callable[..., llamax.Context],
    adapters: dict[str, str],
    tmp_path: Path,
) -> None:
    """Regression: a fork, and a session loaded from a file, lost the adapter set their
    cells were computed under: a base request on them, and another user's plain request
    sharing the prompt, reused the adapter's KV and answered from it. Eight tokens: reused
    KV shows in ``cached_tokens`` (asserted 0), whatever the length."""
    lora_ctx.clear_cache()
    cold = lora_ctx.add_request(PROMPT, greedy(8)).result()
    lora_ctx.clear_cache()
    path = tmp_path / "warm.llamax"
    with lora_ctx.session() as session:
        session.add_request(PROMPT, greedy(8, lora={"warm": 1.0})).result()
        session.save(path)
        with session.fork() as fork:
            plain = lora_ctx.add_request(PROMPT, greedy(8)).result()
            on_fork = fork.add_request(PROMPT, greedy(8)).result()
    lora_ctx.clear_cache()
    with lora_ctx.load_session(path) as loaded:
        plain_after_load = lora_ctx.add_request(PROMPT, greedy(8)).result()
        on_loaded = loaded.add_request(PROMPT, greedy(8)).result()
    lora_ctx.clear_cache()
    probe = make_real(n_ctx=1024, n_seq_max=1, lora=adapters)
    for done in (plain, on_fork, plain_after_load, on_loaded):
        assert done.usage.cached_tokens == 0
        assert_greedy_agrees(
            probe, lora_ctx.tokenize(PROMPT), cold.choices[0].token_ids, done.choices[0].token_ids
        )
    assert_idle(lora_ctx)


# ---------------------------------------------------------------------- issue 36, item 4
@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"dtype": "int8"}, r"'blk.0.attn_q.weight.lora_a' is I8; a LoRA tensor must be"),
        pytest.param(
            {"dtype": "int32"},
            r"'blk.0.attn_q.weight.lora_a' is I32",
            marks=pytest.mark.integration,
        ),
        pytest.param(
            {"dtype": "float64"},
            r"'blk.0.attn_q.weight.lora_a' is F64",
            marks=pytest.mark.integration,
        ),
        ({"strength": float("nan")}, r"'blk.0.attn_q.weight.lora_b' holds NaN"),
        ({"alpha": float("nan")}, r"'adapter.lora.alpha' is nan"),
    ],
    ids=["int8", "int32", "float64", "nan-weights", "nan-alpha"],
)
def test_an_adapter_llama_cpp_would_crash_or_fail_on_is_refused_at_load(
    lora_ctx: llamax.Context, tmp_path: Path, options: dict[str, Any], match: str
) -> None:
    """Regression: these loaded; the first request under an int8, int32 or float64 adapter
    killed the process in llama_decode, and NaN weights or alpha gave empty output.

    The int32 and float64 cases take the same branch as int8 (a tensor type outside
    ``LORA_TENSOR_TYPES``, in backend/lora_file.py): integration. The engine goes on: a few
    tokens under an adapter and without."""
    path = _writer()(tmp_path / "bad.gguf", seed=3, **options)
    with pytest.raises(llamax.ModelLoadError, match=rf"'bad': could not load .*bad.gguf.*{match}"):
        lora_ctx.load_adapter("bad", path)
    assert list(lora_ctx.adapters) == ["warm", "cold"]
    few = llamax.SamplingParams(max_tokens=4, temperature=0)
    assert lora_ctx.add_request(PROMPT, dataclasses.replace(few, lora={"warm": 1.0})).result().text
    assert lora_ctx.add_request(PROMPT, few).result().text
    assert_idle(lora_ctx)
