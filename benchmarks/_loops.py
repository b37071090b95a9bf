"""Raw batched ``llama_decode`` loops on llama-cpp-python's ctypes bindings: the limit.

``RawLoop`` holds one model and one llama.cpp context with either KV layout:

* ``kv_unified=True``: one KV buffer for every sequence; each decode attends over the
  whole used span of that buffer (what llamax uses today);
* ``kv_unified=False``: one KV stream per sequence (``n_ctx / n_seq_max`` cells each),
  as llama-server does with an explicit ``-np``.

Every sequence samples with its own native chain (logit-bias ban of the end-of-generation
ids, as llamax does for ``ignore_eos``, then greedy). ``generate`` prefills every prompt
(all in one batch when they fit), then decodes one token per sequence per step.
``generate_shared`` is the prefix-cache floor: the shared prefix once on seq 0, copied to
the others with ``llama_memory_seq_cp`` (unified layout only), then every suffix in one batch.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp.llama_cpp as C
from _common import N_THREADS, common_prefix_len, cpu_advertises_amx

try:
    from llamax.backend.openmp import release_threads
except ImportError:  # an older llamax, run for an A/B comparison

    def release_threads() -> bool:
        return False


__all__ = ["RawLoop", "RawOutput", "eog_token_ids", "tokenize"]

Item = tuple[int, int, int, bool]  # token, position, seq_id, wants logits


def eog_token_ids(vocab: Any) -> list[int]:
    """Every end-of-generation token id of a vocabulary (0, 2 and 4 for SmolLM2)."""
    return [t for t in range(C.llama_vocab_n_tokens(vocab)) if C.llama_vocab_is_eog(vocab, t)]


def tokenize(vocab: Any, text: str) -> list[int]:
    """Tokenize as a prompt (special tokens parsed, BOS added if the model wants it)."""
    data = text.encode()
    buf = (ctypes.c_int32 * (len(data) + 8))()
    n = C.llama_tokenize(vocab, data, len(data), buf, len(buf), True, True)
    if n < 0:
        raise RuntimeError(f"could not tokenize {text[:40]!r}")
    return list(buf[:n])


@C.llama_log_callback  # type: ignore[untyped-decorator]
def _quiet_log(_level: int, _text: bytes, _user: ctypes.c_void_p) -> None:
    """Drops llama.cpp's load-time chatter (llamax installs its own hook on its contexts)."""


def load_model(path: Path, *, vocab_only: bool = False) -> Any:
    """Load a model with the parameters llamax chooses (no extra buffer types with AMX)."""
    C.llama_log_set(_quiet_log, ctypes.c_void_p(0))
    mparams = C.llama_model_default_params()
    mparams.use_extra_bufts = not cpu_advertises_amx()
    mparams.vocab_only = vocab_only
    model = C.llama_model_load_from_file(str(path).encode(), mparams)
    if not model:
        raise RuntimeError(f"could not load {path}")
    return model


@dataclass(frozen=True)
class RawOutput:
    """What one raw run produced."""

    token_ids: tuple[tuple[int, ...], ...]
    ttft_s: tuple[float, ...]  # from the run's start to each sequence's first token
    prefill_tokens: int


class RawLoop:
    """One model and one context; run with ``generate`` or ``generate_shared``."""

    def __init__(
        self,
        model_path: Path,
        *,
        n_ctx: int,
        n_seq_max: int,
        n_batch: int,
        kv_unified: bool = True,
        n_ubatch: int | None = None,
    ) -> None:
        self.model = load_model(model_path)
        cparams = C.llama_context_default_params()
        cparams.n_ctx, cparams.n_seq_max = n_ctx, n_seq_max
        cparams.n_batch, cparams.n_ubatch = n_batch, n_ubatch or min(n_batch, 512)
        cparams.n_threads = cparams.n_threads_batch = N_THREADS
        cparams.kv_unified = kv_unified
        self.ctx = C.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise RuntimeError("could not create a llama.cpp context")
        self.n_batch = n_batch
        self.memory = C.llama_get_memory(self.ctx)
        self.vocab = C.llama_model_get_vocab(self.model)
        self.n_vocab = C.llama_vocab_n_tokens(self.vocab)
        self.batch = C.llama_batch_init(n_batch, 0, 1)
        eog = eog_token_ids(self.vocab)
        self.eog_bias = (C.llama_logit_bias * len(eog))(
            *(C.llama_logit_bias(t, float("-inf")) for t in eog)
        )

    def new_chain(self) -> Any:
        """Per-sequence sampler chain: ban EOG (ignore_eos), then greedy."""
        chain = C.llama_sampler_chain_init(C.llama_sampler_chain_default_params())
        bias = C.llama_sampler_init_logit_bias(self.n_vocab, len(self.eog_bias), self.eog_bias)
        C.llama_sampler_chain_add(chain, bias)
        C.llama_sampler_chain_add(chain, C.llama_sampler_init_greedy())
        return chain

    def decode(self, items: Sequence[Item]) -> None:
        """One ``llama_decode`` of (token, pos, seq_id, wants_logits) items."""
        batch = self.batch
        for i, (token, pos, seq_id, logits) in enumerate(items):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq_id, logits
        batch.n_tokens = len(items)
        status = C.llama_decode(self.ctx, batch)
        if status != 0:
            raise RuntimeError(f"llama_decode failed with status {status}")

    def decode_rows(self, items: Sequence[Item]) -> dict[int, int]:
        """Decode ``items`` in chunks of ``n_batch``; return seq_id -> logits row of the last
        chunk holding that sequence's final item (rows are per decode call)."""
        rows: dict[int, int] = {}
        for begin in range(0, len(items), self.n_batch):
            chunk = items[begin : begin + self.n_batch]
            self.decode(chunk)
            for i, (_token, _pos, seq_id, logits) in enumerate(chunk):
                if logits:
                    rows[seq_id] = i
        return rows

    def generate(self, prompts: Sequence[str], max_tokens: int) -> RawOutput:
        """Prefill every prompt, then decode the sequences together (fresh memory)."""
        start = time.perf_counter()
        token_lists = [tokenize(self.vocab, p) for p in prompts]
        C.llama_memory_clear(self.memory, True)
        items = [
            (t, pos, seq, pos == len(tokens) - 1)
            for seq, tokens in enumerate(token_lists)
            for pos, t in enumerate(tokens)
        ]
        if len(items) > self.n_batch:
            raise RuntimeError(f"{len(items)} prompt tokens do not fit one batch of {self.n_batch}")
        rows = self.decode_rows(items)
        return self._sample_loop(
            token_lists, [rows[s] for s in range(len(prompts))], start, max_tokens, len(items)
        )

    def generate_shared(self, prompts: Sequence[str], max_tokens: int) -> RawOutput:
        """The prefix once on seq 0, ``seq_cp`` to the others, the suffixes in one batch."""
        start = time.perf_counter()
        token_lists = [tokenize(self.vocab, p) for p in prompts]
        C.llama_memory_clear(self.memory, True)
        prefix_len = min(
            min(common_prefix_len(token_lists[0], t) for t in token_lists),
            min(len(t) for t in token_lists) - 1,
        )
        self.decode_rows([(t, pos, 0, False) for pos, t in enumerate(token_lists[0][:prefix_len])])
        for seq_id in range(1, len(prompts)):
            C.llama_memory_seq_cp(self.memory, 0, seq_id, 0, prefix_len)
        items = [
            (tokens[pos], pos, seq, pos == len(tokens) - 1)
            for seq, tokens in enumerate(token_lists)
            for pos in range(prefix_len, len(tokens))
        ]
        if len(items) > self.n_batch:
            raise RuntimeError(f"{len(items)} suffix tokens do not fit one batch of {self.n_batch}")
        rows = self.decode_rows(items)
        computed = prefix_len + len(items)
        return self._sample_loop(
            token_lists, [rows[s] for s in range(len(prompts))], start, max_tokens, computed
        )

    def _sample_loop(
        self,
        prompts: Sequence[list[int]],
        rows: list[int],
        start: float,
        max_tokens: int,
        computed: int,
    ) -> RawOutput:
        """Sample one token per sequence, then decode them all, ``max_tokens`` times."""
        chains = [self.new_chain() for _ in prompts]
        ttfts: list[float] = []
        outputs: list[list[int]] = [[] for _ in prompts]
        try:
            for step in range(max_tokens):
                for seq_id, (chain, row) in enumerate(zip(chains, rows, strict=True)):
                    outputs[seq_id].append(C.llama_sampler_sample(chain, self.ctx, row))
                    if step == 0:
                        ttfts.append(time.perf_counter() - start)
                if step == max_tokens - 1:
                    break
                self.decode(
                    [
                        (out[-1], len(p) + step, s, True)
                        for s, (p, out) in enumerate(zip(prompts, outputs, strict=True))
                    ]
                )
                rows = list(range(len(prompts)))
        finally:
            for chain in chains:
                C.llama_sampler_free(chain)
            # this thread's OpenMP workers would throttle every other thread's compute
            # (llamax's engine among them) for as long as it lives: llamax.backend.openmp
            release_threads()
        return RawOutput(tuple(tuple(o) for o in outputs), tuple(ttfts), computed)

    def close(self) -> None:
        """Free the batch, context and model."""
        C.llama_batch_free(self.batch)
        C.llama_free(self.ctx)
        C.llama_model_free(self.model)
