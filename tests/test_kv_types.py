"""Quantized KV (issue 61) without a model: the options and their refusals, the flags
(llama-server's ``-ctk``/``-ctv`` too), the fake backend's cell sizes per type, what
moves KV between contexts (a session file, the disk tier) refusing cells of other types,
and every path that moves KV (a disk restore in the next context, checkpoints, a history
shift, forks, rewinds, session files, adapters, drafts, images) giving at a quantized type
what it gives at f16; on SmolLM2: tests/test_model_kv_types.py."""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from vision_files import pixels, png

import llamax
from llamax import cli, flags
from llamax.backend.base import BatchItem
from llamax.config import KV_TYPES, ContextConfig, is_quantized, kv_row_bytes
from llamax.testing import FakeBackend, assert_idle

GREEDY = llamax.SamplingParams(max_tokens=6, temperature=0)
MB = 1 << 20
QUANTIZED = [t for t in KV_TYPES if is_quantized(t)]


def system(i: int) -> str:
    """A ~90-token system prompt (one fake token per byte) sharing not even its first
    token with another's."""
    polite = "Answer briefly and politely. " * 2
    return f"{'ABCDEFGHIJ'[i]}) You are assistant number {i}. " + polite


Make = Callable[..., llamax.Context]


@pytest.fixture
def make() -> Iterator[Make]:
    """Manual contexts on a fake built with the keyword options given to the fake, and
    ``context`` for the context; each is leak-checked and closed after the test."""
    made: list[llamax.Context] = []

    def build(context: dict[str, Any] | None = None, **backend: Any) -> llamax.Context:
        options = {"n_ctx": 512, "n_seq_max": 1, **backend}
        ctx = llamax.Context(backend=FakeBackend(**options), autostart=False, **(context or {}))
        made.append(ctx)
        return ctx

    yield build
    for ctx in made:
        if not ctx.closed:
            assert_idle(ctx)
        ctx.close()


def complete(ctx: llamax.Context, prompt: str) -> llamax.Completion:
    handle = ctx.add_request(prompt, GREEDY)
    while ctx.has_work():
        ctx.process()
    return handle.result(0)


# ---------------------------------------------------------------------- options
def test_every_type_llama_server_takes_is_an_option() -> None:
    assert KV_TYPES == ("f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "iq4_nl", "q4_0")
    assert ContextConfig("m.gguf").kv_types == ("f16", "f16")
    for kv_type in KV_TYPES:
        assert ContextConfig("m.gguf", kv_type=kv_type).kv_types == (kv_type, kv_type)
    assert ContextConfig("m.gguf", kv_type="q8_0", kv_type_v="q4_0").kv_types == ("q8_0", "q4_0")
    assert ContextConfig("m.gguf", kv_type_k="q4_0").kv_types == ("q4_0", "f16")


@pytest.mark.parametrize("name", ["kv_type", "kv_type_k", "kv_type_v"])
@pytest.mark.parametrize("value", ["q8", "Q8_0", "q4_k", 8, None])
def test_a_type_llama_cpp_does_not_take_is_refused_naming_the_field(
    name: str, value: object
) -> None:
    if value is None and name != "kv_type":
        return  # None: "kv_type's"
    with pytest.raises(llamax.InvalidParameterError, match=f"{name} must be one of") as caught:
        ContextConfig("m.gguf", **{name: value})  # type: ignore[arg-type]
    assert caught.value.param == name


def test_kv_row_bytes_are_ggml_row_sizes() -> None:
    """f16 2 bytes a value; the quantized types in blocks of 32 values."""
    per_value = {t: kv_row_bytes(t, 32) / 32 for t in KV_TYPES}
    assert per_value == {
        "f32": 4, "f16": 2, "bf16": 2, "q8_0": 34 / 32, "q5_1": 24 / 32, "q5_0": 22 / 32,
        "q4_1": 20 / 32, "iq4_nl": 18 / 32, "q4_0": 18 / 32,
    }  # fmt: skip
    assert kv_row_bytes("q8_0", 192) == 6 * 34 and kv_row_bytes("f16", 192) == 384
    assert QUANTIZED == ["q8_0", "q5_1", "q5_0", "q4_1", "iq4_nl", "q4_0"]


@pytest.mark.parametrize("kv_type", QUANTIZED)
def test_a_quantized_v_without_flash_attention_is_refused_before_any_load(kv_type: str) -> None:
    with pytest.raises(llamax.InvalidParameterError, match="only with flash attention") as caught:
        llamax.Context("/no/such/model.gguf", kv_type=kv_type, flash_attn=False)
    assert caught.value.param == "kv_type"
    assert f"kv_type_k={kv_type!r}" in str(caught.value)  # what works instead
    with pytest.raises(llamax.InvalidParameterError, match="flash_attn=False") as caught:
        ContextConfig("m.gguf", kv_type_v=kv_type, flash_attn=False)
    assert caught.value.param == "kv_type_v"
    # flash attention on or left to llama.cpp (which turns it on for a quantized V)
    for flash_attn in (True, None):
        assert ContextConfig("m.gguf", kv_type=kv_type, flash_attn=flash_attn).kv_types[1] == (
            kv_type
        )
    # a quantized K alone computes without flash attention
    assert ContextConfig("m.gguf", kv_type_k=kv_type, flash_attn=False).kv_types == (
        kv_type,
        "f16",
    )
    # a V that is not quantized, whatever kv_type says
    config = ContextConfig("m.gguf", kv_type=kv_type, kv_type_v="bf16", flash_attn=False)
    assert config.kv_types == (kv_type, "bf16")


def test_the_reproducible_mode_takes_a_quantized_v_with_row_by_row_flash_attention(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A quantized V needs flash attention, and over a quantized V ggml's CPU flash attention
    computes each row by itself (no tiled or split kernel): the mode turns it on for one. A
    quantized K alone keeps attention without flash attention (no faster row by row)."""
    for options in ({"kv_type": "q8_0"}, {"kv_type_v": "q4_0"}, {"kv_type_v": "q8_0"}):
        config = ContextConfig("m.gguf", reproducible=True, **options)
        assert config.flash_attn is True and config.kv_layout == "streams", options
    config = ContextConfig("m.gguf", reproducible=True, kv_type_k="q4_0")
    assert (config.kv_types, config.flash_attn) == (("q4_0", "f16"), False)
    config = ContextConfig("m.gguf", reproducible=True, kv_type_v="bf16", flash_attn=True)
    assert config.flash_attn is True  # asked for, and row by row over these types
    assert ContextConfig("m.gguf", reproducible=True, kv_type_v="bf16").flash_attn is False
    for options in ({}, {"kv_type": "f32"}, {"kv_type_k": "f32"}):  # F32 is cast to F16
        with pytest.raises(llamax.InvalidParameterError, match="kv_type_v='q8_0'") as caught:
            ContextConfig("m.gguf", reproducible=True, flash_attn=True, **options)
        assert caught.value.param == "flash_attn"
    with pytest.raises(llamax.InvalidParameterError, match="flash_attn=False") as caught:
        ContextConfig("m.gguf", reproducible=True, kv_type="q8_0", flash_attn=False)
    assert caught.value.param == "kv_type"
    monkeypatch.setenv("LLAMAX_REPRODUCIBLE", "1")  # the mode from the environment too
    assert ContextConfig("m.gguf", kv_type="q4_0").flash_attn is True
    with pytest.raises(llamax.InvalidParameterError, match="reproducible=True"):
        ContextConfig("m.gguf", flash_attn=True)


@pytest.mark.parametrize(
    ("type_k", "type_v", "row_exact"),
    [
        ("f16", "f16", False), ("f32", "f16", False), ("f16", "f32", False),
        ("f32", "f32", False), ("f16", "bf16", True), ("bf16", "bf16", True),
        ("q8_0", "q8_0", True), ("q8_0", "f16", True), ("f16", "q4_0", True),
    ],
)  # fmt: skip
def test_which_kv_types_take_the_row_by_row_flash_attention(
    type_k: str, type_v: str, row_exact: bool
) -> None:
    """ggml's tiled and split flash attention kernels take an F16 K and V only (llama.cpp
    casts an F32 K or V to F16 first)."""
    assert llamax.config.flash_attention_is_row_exact(type_k, type_v) is row_exact


# ---------------------------------------------------------------------- flags
def _serve_parser() -> Any:
    pytest.importorskip("uvicorn")
    from llamax.server.cli import build_parser

    return build_parser()


@pytest.mark.parametrize(
    ("argv", "options"),
    [
        (["--kv-type", "q8_0"], {"kv_type": "q8_0"}),
        (
            ["--kv-type-k", "q4_0", "--kv-type-v", "q5_1"],
            {"kv_type_k": "q4_0", "kv_type_v": "q5_1"},
        ),
        (["-ctk", "q8_0", "-ctv", "q8_0"], {"kv_type_k": "q8_0", "kv_type_v": "q8_0"}),
        (
            ["--cache-type-k", "iq4_nl", "--cache-type-v", "f16"],
            {"kv_type_k": "iq4_nl", "kv_type_v": "f16"},
        ),
    ],
)
def test_serve_and_the_cli_take_the_types_in_llama_servers_spellings_too(
    argv: list[str], options: dict[str, str]
) -> None:
    parser = _serve_parser()
    assert flags.option_values(parser.parse_args(argv), ContextConfig) == options
    ns = cli._parser().parse_args(["run", *argv, "hi"])
    assert flags.option_values(ns, ContextConfig) == options
    help_text = parser.format_help()
    assert "[--kv-type-k" in help_text and "[-ctk" not in help_text  # older spellings hidden


def test_a_type_flag_refuses_what_llama_cpp_does_not_take() -> None:
    parser = _serve_parser()
    for argv in (["--kv-type", "q4_k"], ["-ctv", "Q8_0"]):
        with pytest.raises(SystemExit):
            parser.parse_args(argv)


# ---------------------------------------------------------------------- the fake's sizes
@pytest.mark.parametrize(
    ("kv_type", "kv_type_v", "per_cell"),
    [
        ("f16", None, 1024), ("q8_0", None, 544), ("q4_0", None, 288), ("q5_1", None, 384),
        ("q4_1", None, 320), ("q5_0", None, 352), ("f32", None, 2048),
        ("q8_0", "f16", 544 // 2 + 512),  # K in q8_0, V in f16
    ],
)  # fmt: skip
def test_the_fake_counts_a_cell_at_its_types(
    make: Make, kv_type: str, kv_type_v: str | None, per_cell: int
) -> None:
    ctx = make(kv_type=kv_type, kv_type_v=kv_type_v, sized_states=True)
    backend = ctx._backend
    assert isinstance(backend, FakeBackend)
    assert backend.kv_bytes_per_cell == per_cell
    assert ctx.stats().kv.bytes_total == backend.kv_cells * per_cell
    names = f"{kv_type}/{kv_type_v or kv_type}".upper()
    assert backend.model_identity["kv_cache"] == names
    complete(ctx, system(0))  # its one sequence id keeps the prompt and reply (retained)
    held = len(backend.seq_tokens(0))
    state = backend.state_seq_get(0)
    assert held > 90 and held * per_cell < len(state) < held * per_cell + 4 * held + 200


def test_a_ram_budget_holds_more_prefixes_of_a_smaller_type(make: Make) -> None:
    """What counts bytes sees the type: the same budget keeps two f16 prefixes, and every
    one of them in q4_0 (a cell 3.6x smaller)."""
    entries = {}
    for kv_type in ("f16", "q4_0"):
        ctx = make({"prefix_ram_bytes": 250_000}, kv_type=kv_type, sized_states=True)
        for i in range(6):  # one sequence id: each prompt evicts the one before to RAM
            complete(ctx, system(i) + "x?")
        stats = ctx.stats()
        assert stats.prefix_ram_bytes <= stats.prefix_ram_budget_bytes
        entries[kv_type] = stats.prefix_ram_entries
        ctx.close()
    assert entries == {"f16": 2, "q4_0": 5}


# ---------------------------------------------------------------------- what moves KV
def test_the_fake_refuses_a_state_of_other_types() -> None:
    """As llama.cpp does ("mismatched key type"); one of the same types loads."""
    f16, q8 = FakeBackend(), FakeBackend(kv_type="q8_0")
    for backend in (f16, q8):
        assert backend.decode([BatchItem(0, [1, 2, 3], 0)]) == 0
    assert not q8.state_seq_set(1, f16.state_seq_get(0))
    assert not f16.state_seq_set(1, q8.state_seq_get(0))
    assert q8.state_seq_set(1, q8.state_seq_get(0)) and q8.seq_tokens(1) == [1, 2, 3]
    mixed = FakeBackend(kv_type="q8_0", kv_type_v="f16")  # K alike, V not
    assert not mixed.state_seq_set(0, q8.state_seq_get(0)) and mixed.seq_tokens(0) == []
    with pytest.raises(ValueError, match="kv_type"):
        FakeBackend(kv_type="q4_k")


def _save(ctx: llamax.Context, path: Path) -> None:
    with ctx.session() as session:
        session.add_request(system(0), GREEDY)
        while ctx.has_work():
            ctx.process()
        session.save(path)


@pytest.mark.parametrize(
    ("saved", "loading", "hint"),
    [
        (("f16", None), ("q8_0", None), "kv_type='f16'"),
        (("q8_0", None), ("f16", None), "kv_type='q8_0'"),
        (("q4_0", None), ("q8_0", None), "kv_type='q4_0'"),
        (("q8_0", "f16"), ("q8_0", None), "kv_type_k='q8_0', kv_type_v='f16'"),
    ],
)
def test_a_session_saved_at_other_types_is_refused_saying_which(
    make: Make,
    tmp_path: Path,
    saved: tuple[str, str | None],
    loading: tuple[str, str | None],
    hint: str,
) -> None:
    path = tmp_path / "s.llamax"
    _save(make(n_ctx=1024, kv_type=saved[0], kv_type_v=saved[1]), path)
    other = make(n_ctx=1024, kv_type=loading[0], kv_type_v=loading[1])
    names = "/".join(t.upper() for t in (saved[0], saved[1] or saved[0]))
    with pytest.raises(llamax.SessionLoadError, match=f"KV cache of types {names}") as caught:
        other.load_session(path)
    assert hint in str(caught.value)
    assert other.stats().kv.cells_used == 0  # nothing reached the cache
    complete(other, "still serving")
    same = make(n_ctx=1024, kv_type=saved[0], kv_type_v=saved[1])
    with same.load_session(path) as loaded:
        assert len(loaded.token_ids) > len(system(0))


def test_a_session_of_another_model_and_type_is_refused_as_another_models(
    make: Make, tmp_path: Path
) -> None:
    path = tmp_path / "s.llamax"
    _save(make(n_ctx=1024), path)
    other = make(n_ctx=1024, kv_type="q8_0", weights="w1")
    with pytest.raises(llamax.SessionLoadError, match="was saved with model"):
        other.load_session(path)


def test_the_disk_tier_of_one_type_never_restores_another_types_entries(
    make: Make, tmp_path: Path
) -> None:
    """Its folder is keyed by the model identity, which names the KV types; and a file
    moved into the other type's folder is refused by the backend, then recomputed."""
    disk = {"prefix_ram_bytes": 0, "prefix_disk_dir": str(tmp_path), "prefix_disk_bytes": MB}
    f16 = make(disk)
    complete(f16, system(0) + "A1?")
    complete(f16, system(1) + "B2?")  # takes the only sequence id: system(0) goes to disk
    assert f16.stats().prefix_disk_entries == 1
    f16.close()
    (f16_folder,) = tmp_path.iterdir()

    q8 = make(disk, kv_type="q8_0")
    assert q8.stats().prefix_disk_entries == 0
    done = complete(q8, system(0) + "C3?")
    assert done.usage.cached_tokens == 0
    assert q8._engine.scheduler.prefix.ram.model != f16._engine.scheduler.prefix.ram.model
    assert "Q8_0/Q8_0" in q8._engine.scheduler.prefix.ram.model
    q8.close()
    folders = sorted(p for p in tmp_path.iterdir() if p.is_dir())
    assert len(folders) == 2  # one per type

    # f16's file planted in q8_0's folder: found, refused by the backend, recomputed
    (f16_file,) = f16_folder.glob("*.kv")
    (q8_folder,) = [f for f in folders if f != f16_folder]
    for old in q8_folder.glob("*.kv"):
        old.unlink()
    shutil.copy(f16_file, q8_folder / f16_file.name)
    planted = make(disk, kv_type="q8_0")
    assert planted.stats().prefix_disk_entries == 1
    done = complete(planted, system(0) + "C3?")
    stats = planted.stats()
    assert (stats.num_prefix_disk_restores, done.usage.cached_tokens) == (0, 0)
    assert stats.num_prefix_disk_refused == 1
    assert done.token_ids == complete(make(kv_type="q8_0"), system(0) + "C3?").token_ids

    again = make(disk)  # f16's entry is still there, and restores
    assert again.stats().prefix_disk_entries == 1
    assert complete(again, system(0) + "C3?").usage.cached_tokens == len(system(0))


class _Shape:
    """What :func:`kv_dims` reads of a model."""

    def __init__(self, n_embd: int, n_head: int, n_head_kv: int, meta: dict[str, str]) -> None:
        self._shape, self._meta = (n_embd, n_head, n_head_kv), meta

    def n_embd(self) -> int:
        return self._shape[0]

    def n_head(self) -> int:
        return self._shape[1]

    def n_head_kv(self) -> int:
        return self._shape[2]

    def meta(self, key: str) -> str | None:
        return self._meta.get(key)


def test_a_cell_holds_the_heads_size_the_gguf_gives_not_n_embd_over_n_head() -> None:
    """Gemma 3 270M: 640 wide, 4 heads, 1 KV head, heads of 256 (``key_length``): a cell
    holds 256 K and 256 V values a layer (18 layers, f16: 18,432 bytes, as its saved state
    grows), where ``n_embd / n_head`` counted 160 (11,520 bytes, 0.62x)."""
    from llamax.backend.llama_cpp import kv_dims

    gemma = {"general.architecture": "gemma3", "gemma3.attention.key_length": "256",
             "gemma3.attention.value_length": "256"}  # fmt: skip
    assert kv_dims(_Shape(640, 4, 1, gemma)) == (256, 256)
    assert kv_dims(_Shape(576, 9, 3, {"general.architecture": "llama"})) == (192, 192)
    odd = {"general.architecture": "x", "x.attention.key_length": "192",
           "x.attention.value_length": "128"}  # fmt: skip
    assert kv_dims(_Shape(1024, 8, 2, odd)) == (384, 256)


# ---------------------------------------------------------------------- every path, each type
# The fake's next token is a function of the tokens in KV, whatever their type: each path
# that moves KV (a disk restore in the next context, a checkpoint set back, a history
# shift, a fork, a rewind, a session file, adapters, drafts, images) must give at a
# quantized type exactly what it gives at f16, reusing as much.
TYPE_PAIRS = [("q8_0", None), ("q4_0", None), ("q8_0", "f16")]
PAIR_IDS = ["q8_0", "q4_0", "q8_0-f16"]
Scenario = Callable[[Make, Path, str, str | None], object]


def _at_f16_and(
    scenario: Scenario, make: Make, tmp_path: Path, kv_type: str, kv_type_v: str | None
) -> object:
    """``scenario`` run at ``kv_type``/``kv_type_v`` and at f16 (each in a folder of its
    own): the same result; returns it."""
    quantized = scenario(make, tmp_path / "quantized", kv_type, kv_type_v)
    assert quantized == scenario(make, tmp_path / "f16", "f16", None)
    return quantized


def _types(kv_type: str, kv_type_v: str | None) -> dict[str, Any]:
    return {"kv_type": kv_type, "kv_type_v": kv_type_v, "sized_states": True}


def _disk_restore(make: Make, folder: Path, kv_type: str, kv_type_v: str | None) -> object:
    disk = {"prefix_ram_bytes": 0, "prefix_disk_dir": str(folder), "prefix_disk_bytes": 4 * MB}
    writer = make(disk, **_types(kv_type, kv_type_v))
    first = complete(writer, system(0) + "A1?")
    complete(writer, system(1) + "B2?")  # takes the only sequence id: system(0) to disk
    assert writer.stats().prefix_disk_entries == 1
    writer.close()
    reader = make(disk, **_types(kv_type, kv_type_v))  # the next context on the folder
    done = complete(reader, system(0) + "C3?")
    stats = reader.stats()
    assert (stats.num_prefix_disk_restores, stats.num_prefix_disk_refused) == (1, 0)
    assert done.usage.cached_tokens == len(system(0))
    return first.token_ids, done.token_ids, done.usage.cached_tokens


def _checkpoints(make: Make, folder: Path, kv_type: str, kv_type_v: str | None) -> object:
    ctx = make(n_ctx=1024, recurrent=True, **_types(kv_type, kv_type_v))
    head = system(2) * 2  # ~180 tokens
    outputs = [complete(ctx, head + tail) for tail in ("A1", "B2?", "C3!")]
    assert outputs[2].usage.cached_tokens == len(head)  # where the second one parted
    assert ctx.stats().num_checkpoint_restores >= 1
    return [(o.token_ids, o.usage.cached_tokens) for o in outputs]


def _session_ops(make: Make, folder: Path, kv_type: str, kv_type_v: str | None) -> object:
    """A fork, a rewind, a history shift and a session file loaded in the next context."""
    ctx = make(n_ctx=1024, n_seq_max=2, **_types(kv_type, kv_type_v))
    prompt = system(3) + "Q?"
    seen: list[object] = []
    with ctx.session() as session:
        reply = session.add_request(prompt, GREEDY).result()
        held = session.token_ids
        with session.fork() as fork:
            assert fork.token_ids == held
            branch = fork.add_request(prompt + reply.text + " more?", GREEDY).result()
            assert branch.usage.cached_tokens == len(held)
            seen.append(branch.token_ids)
        session.rewind(len(held) - len(prompt))
        again = session.add_request(prompt, GREEDY).result()
        assert again.usage.cached_tokens == len(prompt) - 1
        assert again.token_ids == reply.token_ids
        assert session.shift(3, 40)  # the head of the system prompt out, the rest moved back
        shortened = (prompt + again.text)[:3] + (prompt + again.text)[40:]
        assert ctx.detokenize(session.token_ids) == shortened[:-1]
        shifted = session.add_request(shortened + " and?", GREEDY).result()
        assert shifted.usage.cached_tokens == len(shortened) - 1
        seen.append(shifted.token_ids)
        folder.mkdir(parents=True)
        session.save(folder / "s.llamax")
        saved = session.token_ids
    loaded_ctx = make(n_ctx=1024, **_types(kv_type, kv_type_v))
    with loaded_ctx.load_session(folder / "s.llamax") as loaded:
        assert loaded.token_ids == saved
        text = loaded_ctx.detokenize(saved)
        resumed = loaded.add_request(text + "!", GREEDY).result()
        assert resumed.usage.cached_tokens == len(saved)
        seen.append(resumed.token_ids)
    return seen


def _adapters(make: Make, folder: Path, kv_type: str, kv_type_v: str | None) -> object:
    folder.mkdir(parents=True)
    files = {}
    for name in ("a", "b"):
        (folder / f"{name}.gguf").write_bytes(b"GGUF fake adapter")
        files[name] = str(folder / f"{name}.gguf")
    lora = {"lora": files}
    ctx = make(lora, n_ctx=1024, n_seq_max=2, **_types(kv_type, kv_type_v))
    under_a = llamax.SamplingParams(max_tokens=6, temperature=0, lora={"a": 1.0})
    prompt = system(4)
    base = complete(ctx, prompt)
    with ctx.session() as session:
        first = session.add_request(prompt, under_a).result()
        assert first.usage.cached_tokens == 0 and first.token_ids != base.token_ids
        session.save(folder / "a.llamax")
        with session.fork() as fork:  # the fork keeps the set its cells were computed under
            assert fork.add_request(prompt, GREEDY).result().usage.cached_tokens == 0
    loaded_ctx = make(lora, n_ctx=1024, **_types(kv_type, kv_type_v))
    with loaded_ctx.load_session(folder / "a.llamax") as loaded:
        resumed = loaded.add_request(prompt, under_a).result()
        assert resumed.usage.cached_tokens == len(prompt) - 1
    assert resumed.token_ids == first.token_ids
    return base.token_ids, first.token_ids


def _drafts(make: Make, folder: Path, kv_type: str, kv_type_v: str | None) -> object:
    context = {"speculative": llamax.PromptLookup()}
    ctx = make(context, n_ctx=1024, n_seq_max=2, **_types(kv_type, kv_type_v))
    ctx._engine.scheduler.drafts.priced = False  # every proposal verified
    prompt = "abcdefghijklmnopqrstuvwxyz " * 3
    params = llamax.SamplingParams(max_tokens=40, temperature=0)
    plain = ctx.add_request(prompt, dataclasses.replace(params, speculative=False)).result()
    ctx.clear_cache()
    spec = ctx.add_request(prompt, params).result()
    assert spec.token_ids == plain.token_ids
    assert spec.usage.accepted_tokens > 0  # rejected cells removed, accepted ones kept
    assert ctx.audit() == []
    return spec.token_ids, spec.usage.accepted_tokens


def _images(make: Make, folder: Path, kv_type: str, kv_type_v: str | None) -> object:
    options = {"image_tokens": 20, "n_ctx": 1024, "n_seq_max": 2, **_types(kv_type, kv_type_v)}
    ctx = make(**options)
    picture = llamax.Image(png(pixels(5, 24, 32)))
    prompt = ["look: ", picture, " what?"]
    cold = ctx.add_request(prompt, GREEDY).result()
    warm = ctx.add_request(prompt, GREEDY).result()
    assert warm.usage.cached_tokens >= 6 + 20 and warm.token_ids == cold.token_ids
    folder.mkdir(parents=True)
    with ctx.session() as session:
        session.add_request(prompt, GREEDY).result()
        session.save(folder / "image.llamax")
        held = session.token_ids
    loaded_ctx = make(**options)
    with loaded_ctx.load_session(folder / "image.llamax") as loaded:
        assert loaded.token_ids == held
        resumed = loaded.add_request([*prompt, " and?"], GREEDY).result()
        assert resumed.usage.cached_tokens >= 6 + 20
    return cold.token_ids, resumed.token_ids


@pytest.mark.parametrize(
    "scenario",
    [_disk_restore, _checkpoints, _session_ops, _adapters, _drafts, _images],
    ids=["disk", "checkpoints", "session-ops", "adapters", "drafts", "images"],
)
@pytest.mark.parametrize(("kv_type", "kv_type_v"), TYPE_PAIRS, ids=PAIR_IDS)
def test_every_path_that_moves_kv_gives_at_a_quantized_type_what_it_gives_at_f16(
    make: Make, tmp_path: Path, scenario: Scenario, kv_type: str, kv_type_v: str | None
) -> None:
    _at_f16_and(scenario, make, tmp_path, kv_type, kv_type_v)
