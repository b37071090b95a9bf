"""What a loaded model and its context are: :class:`ModelFacts`, computed once at load."""

from __future__ import annotations

from dataclasses import dataclass, field

from .tokens import FimTokens

__all__ = ["ModelFacts"]


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """The facts of a loaded model and the context made for it, known at load and never
    changing: ``ctx.facts`` (and ``Embedder.facts``).

    The backend computes them once, where it creates the model and the context, and every
    layer above holds this one object instead of asking again. What changes at run time is
    not here: ``ctx.kv_layout`` (``kv_layout="auto"`` moves between layouts) and the cells
    the current layout holds (``stats().kv_cells_total``). :class:`~llamax.ModelInfo` is
    the file's side (read without a context); these are the context's.
    """

    model_name: str
    """``general.name`` from the GGUF metadata, else the file name."""
    n_vocab: int
    """The vocabulary size: token ids are in ``[0, n_vocab)``."""
    n_embd: int
    """The width of the model's embeddings."""
    n_ctx_train: int
    """The context length the model was trained with."""
    n_ctx: int
    """KV cells granted (``n_ctx`` padded to a multiple of 256, as llama.cpp pads it): the
    unified cache's cells, in every layout."""
    n_ctx_seq: int
    """The most tokens one sequence (prompt plus reply) may hold."""
    n_seq_max: int
    """How many sequences may hold KV cells at once."""
    fim_tokens: FimTokens = field(default_factory=FimTokens)
    """The vocabulary's fill-in-the-middle tokens (``fim_tokens.can_infill``: whether code
    infill can be prompted)."""
    sees_images: bool = False
    """Whether prompts may hold images: a projector (``mmproj``) that encodes them is
    loaded."""
    bos_token_id: int | None = None
    """The BOS token when the vocabulary adds one to prompts, else None."""
    eos_token_id: int | None = None
    """The EOS token, if the vocabulary has one."""
