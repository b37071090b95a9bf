"""The native handles (llamax.backend.native) and the order their owners free them in.

The bindings are replaced by a recorder, so these run without a model: what they check is
which llama.cpp functions run, on which handle, in which order.
"""

from __future__ import annotations

import ctypes
import itertools
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import llamax
from llamax.backend import Inspectable, native
from llamax.backend import embedding as embedding_module
from llamax.backend import llama_cpp as llama_cpp_module
from llamax.backend import model_info as model_info_module
from llamax.backend.embedding import EmbeddingBackend, EmbeddingConfig
from llamax.backend.llama_cpp import LlamaCppBackend
from llamax.config import ContextConfig
from llamax.errors import ModelLoadError, RequestFailedError
from llamax.params import SamplingParams
from llamax.testing import FakeBackend

FREES = ("llama_sampler_free", "llama_batch_free", "llama_free", "llama_model_free")


class Bindings:
    """Records every call as ``(name, first argument)``; ``fail`` names calls that raise
    (after recording), ``refuse`` calls that return NULL."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.fail: set[str] = set()
        self.refuse: set[str] = set()
        self._ids = itertools.count(1)
        self._results: dict[str, Any] = {
            "llama_model_default_params": lambda: SimpleNamespace(),
            "llama_context_default_params": lambda: SimpleNamespace(type_k=1, type_v=1),  # F16
            "llama_model_load_from_file": lambda: "model",
            "llama_init_from_model": lambda: f"ctx{next(self._ids)}",
            "llama_batch_init": self._batch,
            "llama_sampler_chain_init": lambda: f"chain{next(self._ids)}",
            "llama_sampler_init_grammar": lambda: f"grammar{next(self._ids)}",
            "llama_n_ctx": lambda: 512,
            "llama_n_ctx_seq": lambda: 256,
            "llama_n_seq_max": lambda: 2,
            "llama_n_batch": lambda: 8,
            "llama_vocab_n_tokens": lambda: 4,
            "llama_model_n_head": lambda: 2,
            "llama_model_n_head_kv": lambda: 2,
            "llama_model_n_embd": lambda: 8,
            "llama_model_n_layer": lambda: 1,
            "llama_model_meta_val_str": lambda: -1,
            "llama_memory_seq_pos_max": lambda: -1,
            "llama_pooling_type": lambda: 1,
        }

    @staticmethod
    def _batch() -> SimpleNamespace:
        def array(n: int = 8) -> Any:
            return ctypes.cast((ctypes.c_int32 * n)(), ctypes.POINTER(ctypes.c_int32))

        return SimpleNamespace(
            token=array(),
            pos=array(),
            logits=ctypes.cast((ctypes.c_int8 * 8)(), ctypes.POINTER(ctypes.c_int8)),
            n_seq_id=array(),
            seq_id=[array(1) for _ in range(8)],
            n_tokens=0,
        )

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("llama_"):
            raise AttributeError(name)

        def call(*args: Any) -> Any:
            self.calls.append((name, args[0] if args else None))
            if name in self.fail:
                raise RuntimeError(f"{name} failed")
            if name in self.refuse:
                return None
            make = self._results.get(name)
            return make() if make is not None else 0

        return call

    def frees(self) -> list[tuple[str, Any]]:
        return [(name, arg) for name, arg in self.calls if name in FREES]


@pytest.fixture
def gguf(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.gguf"
    path.write_bytes(b"GGUF" + bytes(12))
    return path


@pytest.fixture
def C(monkeypatch: pytest.MonkeyPatch) -> Bindings:
    bindings = Bindings()
    for module in (llama_cpp_module, embedding_module, model_info_module):
        monkeypatch.setattr(module, "bindings", lambda: bindings)
    return bindings


def _backend(gguf: Path, **options: Any) -> LlamaCppBackend:
    options = {"n_ctx": 512, "n_seq_max": 2, "n_batch": 8, "n_threads": 1, **options}
    return LlamaCppBackend(ContextConfig(model_path=str(gguf), **options))


def test_close_frees_samplers_batch_context_model_in_that_order_once(
    C: Bindings, gguf: Path
) -> None:
    backend = _backend(gguf)
    backend.new_sampler(SamplingParams(temperature=0), 1, [], grammar='root ::= "a"')
    backend.close()
    backend.close()
    assert [name for name, _ in C.frees()] == [
        "llama_sampler_free",  # the chain
        "llama_sampler_free",  # its grammar
        "llama_batch_free",
        "llama_free",
        "llama_model_free",
    ]
    assert backend.num_live_samplers == 0


@pytest.mark.parametrize("failing", ["llama_sampler_free", "llama_batch_free", "llama_free"])
def test_close_still_frees_the_rest_when_one_free_raises(
    C: Bindings, gguf: Path, failing: str
) -> None:
    backend = _backend(gguf)
    # greedy alone builds no chain; a host chain's sampler holds two (its filters and
    # llama.cpp's whole chain, for steps of few rows)
    backend.new_sampler(SamplingParams(temperature=0.8), 1, [])
    C.fail = {failing}
    with pytest.raises(RuntimeError, match=f"{failing} failed"):
        backend.close()
    assert [name for name, _ in C.frees()] == ["llama_sampler_free", *FREES]
    with pytest.raises(llamax.ContextClosedError):
        backend.tokenize("a")


def test_relayout_makes_the_new_context_before_freeing_the_old(C: Bindings, gguf: Path) -> None:
    backend = _backend(gguf, kv_layout="auto")
    assert backend.can_relayout and not backend.is_unified
    old = [arg for name, arg in C.calls if name == "llama_init_from_model"]
    backend.relayout(True)
    created = [i for i, (name, _) in enumerate(C.calls) if name == "llama_init_from_model"]
    freed = [i for i, (name, _) in enumerate(C.calls) if name == "llama_free"]
    assert len(old) == 1 and len(created) == 2 and len(freed) == 1
    assert created[1] < freed[0]
    assert backend.is_unified
    backend.close()
    # the new context is the one freed at close, once; the old one was freed by relayout
    assert [arg for name, arg in C.frees() if name == "llama_free"] == ["ctx1", "ctx2"]


def test_a_refused_relayout_keeps_the_old_context(C: Bindings, gguf: Path) -> None:
    backend = _backend(gguf, kv_layout="auto")
    C.refuse = {"llama_init_from_model"}
    with pytest.raises(RequestFailedError, match="new KV layout"):
        backend.relayout(True)
    assert not backend.is_unified and not [n for n, _ in C.frees() if n == "llama_free"]
    C.refuse = set()
    backend.close()
    assert [arg for name, arg in C.frees() if name == "llama_free"] == ["ctx1"]


def test_a_refused_context_frees_the_model_it_loaded(C: Bindings, gguf: Path) -> None:
    C.refuse = {"llama_init_from_model"}
    with pytest.raises(ModelLoadError, match="could not create a context"):
        _backend(gguf)
    assert C.frees() == [("llama_model_free", "model")]


def test_the_kv_types_reach_the_context_params_and_a_refusal_names_them(
    C: Bindings, gguf: Path
) -> None:
    """Issue 61: ``type_k``/``type_v`` are ggml's numbers of ``kv_types``; a quantized V
    left to auto gets flash attention (as llama.cpp's auto would); a cell is counted at the
    types (one layer of K and V of 8 values: 16 bytes each in f16, a 34-byte block in
    q8_0)."""
    backend = _backend(gguf)
    cparams = backend._cparams
    assert (cparams.type_k, cparams.type_v, backend.kv_bytes_per_cell) == (1, 1, 32)
    assert not hasattr(cparams, "flash_attn_type")  # llama.cpp's default: auto
    backend.close()
    backend = _backend(gguf, kv_type="q8_0", kv_type_k="q4_0")
    cparams = backend._cparams
    assert (cparams.type_k, cparams.type_v, cparams.flash_attn_type) == (2, 8, 1)
    assert backend.kv_bytes_per_cell == 18 + 34
    assert backend.model_identity["kv_cache"] == "Q4_0/Q8_0"
    backend.close()
    backend = _backend(gguf, kv_type_k="q8_0", flash_attn=False)  # K alone: no flash attention
    cparams = backend._cparams
    assert (cparams.type_k, cparams.type_v, cparams.flash_attn_type) == (8, 1, 0)
    backend.close()
    C.refuse = {"llama_init_from_model"}
    with pytest.raises(ModelLoadError, match="K/V cache types q4_0/q8_0: a quantized type"):
        _backend(gguf, kv_type="q8_0", kv_type_k="q4_0")
    with pytest.raises(ModelLoadError, match="could not create a context") as caught:
        _backend(gguf)
    assert "cache types" not in str(caught.value)


def test_embedding_backend_frees_batch_context_model(C: Bindings, gguf: Path) -> None:
    backend = EmbeddingBackend(
        EmbeddingConfig(model_path=gguf, pooling=1, n_ctx=8, n_seq_max=2, n_threads=1)
    )
    backend.close()
    backend.close()
    assert [name for name, _ in C.frees()] == ["llama_batch_free", "llama_free", "llama_model_free"]


def test_model_facts_free_the_context_then_the_model(C: Bindings, gguf: Path) -> None:
    facts = model_info_module.read_model_facts(gguf)
    assert facts["n_vocab"] == 4 and facts["can_copy"]
    # the batch that measured the memory (issue 57) first, then the context, then the model
    assert [name for name, _ in C.frees()] == ["llama_batch_free", "llama_free", "llama_model_free"]
    assert C.frees()[1:] == [("llama_free", "ctx1"), ("llama_model_free", "model")]


def test_model_facts_free_the_model_when_the_context_is_refused(C: Bindings, gguf: Path) -> None:
    C.refuse = {"llama_init_from_model"}
    with pytest.raises(ModelLoadError):
        model_info_module.read_model_facts(gguf)
    assert C.frees() == [("llama_model_free", "model")]


def test_handles_close_once(C: Bindings, gguf: Path) -> None:
    model = native.NativeModel(C, gguf, n_gpu_layers=0)
    context = native.NativeContext.create(model, native.context_params(C, n_ctx=16))
    assert context is not None
    batch = native.NativeBatch(C, 8)
    for handle in (batch, context, model):
        handle.close()
        handle.close()
    assert [name for name, _ in C.frees()] == ["llama_batch_free", "llama_free", "llama_model_free"]


def test_a_sampler_frees_its_grammar_when_freeing_its_chain_raises(C: Bindings) -> None:
    sampler = native.NativeSampler(C, "chain", "grammar", [], 4)
    C.fail = {"llama_sampler_free"}
    with pytest.raises(RuntimeError):
        sampler.close()
    assert C.frees() == [("llama_sampler_free", "chain"), ("llama_sampler_free", "grammar")]


def test_model_load_checks_the_file_first(C: Bindings, tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE")
    with pytest.raises(ModelLoadError, match="not a GGUF"):
        native.NativeModel(C, bad, n_gpu_layers=0)
    with pytest.raises(ModelLoadError, match="not found"):
        native.NativeModel(C, tmp_path / "missing.gguf", n_gpu_layers=0)
    assert C.calls == []


def test_both_backends_are_inspectable(C: Bindings, gguf: Path) -> None:
    backend = _backend(gguf)
    assert isinstance(FakeBackend(), Inspectable) and isinstance(backend, Inspectable)
    assert backend.num_cells_used is None and backend.seq_tokens(0) is None
    backend.close()


def test_two_threads_setting_up_the_bindings_at_once_install_one_live_log_callback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Regression (issue 38): a model pool loading its first two models at once ran the
    one-time set-up twice; one thread's log callback stayed installed after the other's
    replaced it as the one kept alive, so it was freed, and the next native log line
    segfaulted (``_CallPythonObject`` with a NULL callable under ``llama_log_internal``;
    1 run in 12 of ``test_two_real_models_interleaved``)."""
    import threading
    import time

    import llama_cpp.llama_cpp as raw

    installed: list[Any] = []

    def slow_log_set(callback: Any, user: Any) -> None:
        time.sleep(0.05)  # widens the window two unserialised set-ups meet in
        installed.append(callback)

    monkeypatch.setattr(raw, "llama_log_set", slow_log_set)
    monkeypatch.setattr(raw, "llama_backend_init", lambda: None)
    monkeypatch.setattr(native.bindings, "log_callback", None, raising=False)  # undone after
    barrier = threading.Barrier(2)

    def set_up() -> None:
        barrier.wait()
        native.bindings()

    threads = [threading.Thread(target=set_up) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(installed) == 1, f"the set-up ran {len(installed)} times"
    assert installed[0] is native.bindings.log_callback  # type: ignore[attr-defined]


@pytest.mark.parametrize("use_mmap", [True, False])
def test_use_mmap_false_loads_the_weights_without_a_map(
    C: Bindings, gguf: Path, monkeypatch: pytest.MonkeyPatch, use_mmap: bool
) -> None:
    """llama-cpp-python 0.3.36's model params have ``load_mode`` where ``use_mmap`` was:
    ``use_mmap=False`` sets ``LLAMA_LOAD_MODE_NONE`` (it set a ``use_mmap`` attribute
    that llama.cpp never read); ``True`` leaves llama.cpp's own choice (a map on the CPU)."""
    seen: list[Any] = []
    params = SimpleNamespace(load_mode=-1)
    monkeypatch.setitem(C._results, "llama_model_default_params", lambda: params)
    load = C.__getattr__("llama_model_load_from_file")
    monkeypatch.setattr(C, "llama_model_load_from_file",
                        lambda path, p: (seen.append(p.load_mode), load(path))[1],
                        raising=False)  # fmt: skip
    model = native.NativeModel(C, gguf, n_gpu_layers=0, use_mmap=use_mmap)
    assert seen == [-1 if use_mmap else native.LOAD_MODE_NONE]
    assert not hasattr(params, "use_mmap")
    model.close()
