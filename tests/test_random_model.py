"""scripts/make_random_model.py: a random llama GGUF with SmolLM2's tokenizer loads in
llama.cpp and generates; the weightless tokenizer file stands in for SmolLM2."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from script_modules import load_script

import llamax

pytest.importorskip("gguf")
pytestmark = pytest.mark.model


def _script() -> Any:
    return load_script("make_random_model")


@pytest.mark.integration
def test_tiny_random_model_generates_with_smollm2_tokens(tmp_path: Path, model_path: Path) -> None:
    script = _script()
    tokenizer = script.write_tokenizer(tmp_path / "tok.gguf", source=model_path)
    assert tokenizer.stat().st_size < 4_000_000
    tiny = script.write_random_model(tmp_path / "tiny.gguf", shape="tiny", tokenizer_from=tokenizer)
    again = script.write_random_model(
        tmp_path / "again.gguf", shape="tiny", tokenizer_from=tokenizer
    )
    assert tiny.read_bytes() == again.read_bytes()  # seeded
    params = llamax.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
    with llamax.Context(model_path, n_ctx=256, n_seq_max=1, n_threads=1) as smol:
        expected = smol.tokenize("Once upon a time")
        template = smol.chat_template
    with llamax.Context(tiny, n_ctx=256, n_seq_max=2, n_threads=1) as ctx:
        assert ctx.tokenize("Once upon a time") == expected
        assert ctx.n_vocab == 49152
        assert ctx.chat_template == template  # source, BOS and EOS texts
        done = ctx.add_request("Once upon a time", params).result(timeout=60)
    assert len(done.token_ids) == 8 and len(set(done.token_ids)) > 1
    logprobs = [t.logprob for t in done.choices[0].logprobs or ()]
    assert len(logprobs) == 8 and np.isfinite(logprobs).all()


def test_the_vocabulary_pads_to_llama_3s_width(tmp_path: Path, model_path: Path) -> None:
    """``n_vocab=128256``: rows as wide as Llama 3's (the GPU benchmark's 8B shape with
    ``--n-vocab 128256``, here on the tiny shape); text tokenizes as before."""
    script = _script()
    tokenizer = script.write_tokenizer(tmp_path / "tok.gguf", source=model_path)
    wide = script.write_random_model(
        tmp_path / "wide.gguf", shape="tiny", tokenizer_from=tokenizer, n_vocab=128_256
    )
    params = llamax.SamplingParams(max_tokens=6, temperature=0.8, seed=1, ignore_eos=True)
    with llamax.Context(model_path, n_ctx=256, n_seq_max=1, n_threads=1) as smol:
        expected = smol.tokenize("Once upon a time")
    with llamax.Context(wide, n_ctx=256, n_seq_max=2, n_threads=1) as ctx:
        assert ctx.n_vocab == 128_256
        assert ctx.tokenize("Once upon a time") == expected
        done = ctx.add_request("Once upon a time", params).result(timeout=60)
    assert len(done.token_ids) == 6
    with pytest.raises(ValueError, match="n_vocab must be at least"):
        script.write_random_model(tmp_path / "x.gguf", tokenizer_from=tokenizer, n_vocab=100)


def test_q8_0_blocks_match_ggml_layout() -> None:
    script = _script()
    rng = np.random.default_rng(0)
    blocks = script.random_matrix(rng, 4, 64, "q8_0")
    assert blocks.shape == (4, 2 * 34) and blocks.dtype == np.uint8
    scale = blocks[:, :2].copy().view(np.float16)
    values = blocks[:, 2:34].copy().view(np.int8).astype(np.float32)
    weights = values * scale.astype(np.float32)
    assert 0.5 / 8 < weights.std() < 2 / 8  # ~ 1 / sqrt(n_in)
    with pytest.raises(ValueError, match="shape must be one of"):
        script.write_random_model(Path("unused.gguf"), shape="70b")
