"""Embeddings: embed texts with the model and rank them by cosine similarity.

``Embedder`` owns its own llama.cpp context in embeddings mode and packs many texts into
each ``llama_decode``. Rows are L2-normalised by default, so a dot product is a cosine.

    python examples/embeddings.py
"""

from __future__ import annotations

from llamax.embeddings import Embedder

DOCUMENTS = [
    "The cat sat on the mat.",
    "Quarterly revenue grew by ten percent.",
    "Preheat the oven before baking the bread.",
    "Dogs and cats are common household pets.",
]


def main() -> None:
    with Embedder(pooling="mean", n_ctx=512, n_seq_max=8) as embedder:
        vectors = embedder.embed(DOCUMENTS)
        print(f"{vectors.shape[0]} vectors of {embedder.n_embd} floats ({embedder.pooling})")
        query = embedder.embed(["Where is the kitten sitting?"])[0]
    scores = vectors @ query
    for score, text in sorted(zip(scores, DOCUMENTS, strict=True), reverse=True):
        print(f"{score:.3f}  {text}")


if __name__ == "__main__":
    main()
