"""A deterministic, pure-Python stand-in for llama.cpp, for tests without a model.

:class:`FakeBackend` implements :class:`llamax.backend.Backend`. Its vocabulary is token 0
(end of generation, renders as nothing), tokens 1..256 for the bytes 0..255, and any extra
multi-byte pieces you pass. Its "model" is a function of the sequence's KV contents, so
greedy output is batch-invariant by construction. It checks what the engine sends: every
decode must continue each sequence at the next position, never exceed ``n_batch`` and
never exceed ``n_ctx`` cells (it answers NO_SLOT, like llama.cpp).

It is no kinder than llama.cpp about KV. With one stream per sequence a ``seq_cp`` updates
the destination's cells at once but copies the source stream's buffer only at the next
decode (or :meth:`FakeBackend.run_queued_copies`), while state reads and writes act at
once; a partial copy between streams aborts. And every cell records its *provenance*: the
history it was computed from (a hash chain over the tokens at positions ``0..p``), the
model's weights and the LoRA adapter set. Every decode checks that each sequence attends
only to cells computed from its own tokens, by this model, under the current adapter set,
and raises ``AssertionError`` naming the first that is not.

    ctx = llamax.Context(backend=FakeBackend(), autostart=False)

The package's modules: :mod:`~llamax.testing.backend` (the backend, its checks and fault
points), :mod:`~llamax.testing.memory` (the KV memory and provenance),
:mod:`~llamax.testing.model` (vocabulary, adapters, logits, sampling) and
:mod:`~llamax.testing.idle` (the leak check).
"""

from .backend import FAULT_POINTS, FakeBackend
from .idle import assert_idle
from .model import FakeGrammar, FakeSampler, alphabet_model

__all__ = [
    "FAULT_POINTS",
    "FakeBackend",
    "FakeGrammar",
    "FakeSampler",
    "alphabet_model",
    "assert_idle",
]
