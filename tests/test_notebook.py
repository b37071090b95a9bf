"""examples/quickstart.ipynb runs top to bottom in a real Jupyter kernel (nbclient)."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.model, pytest.mark.integration]

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOK = Path(__file__).resolve().parent.parent / "examples" / "quickstart.ipynb"


def text_of(cell: Any, name: str = "stdout") -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.get("name") == name)


@pytest.fixture(scope="module")
def cells() -> dict[str, Any]:
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        notebook,
        kernel_name="python3",
        timeout=600,
        resources={"metadata": {"path": str(NOTEBOOK.parent)}},
    )
    client.execute()
    by_tag = {}
    for cell in notebook.cells:
        if cell.cell_type == "code":
            assert not [o for o in cell.outputs if o.output_type == "error"]
            by_tag[cell.metadata["tags"][0]] = cell
    return by_tag


def test_await_and_async_for_in_the_running_loop(cells: dict[str, Any]) -> None:
    assert "finish_reason: " in text_of(cells["await"])
    events = re.search(r"\[(\d+) events\]", text_of(cells["stream"]))
    assert events is not None and int(events.group(1)) > 1


def test_generate_with_progress(cells: dict[str, Any]) -> None:
    cell = cells["generate"]
    assert len(text_of(cell).strip().splitlines()) == 4  # one line per question, in order
    widget = any(
        "application/vnd.jupyter.widget-view+json" in o.get("data", {}) for o in cell.outputs
    )
    assert widget or "generate" in text_of(cell, "stderr")  # the tqdm.auto bar
    assert re.search(r"\['(stop|length)', '(stop|length)'\]", text_of(cells["agenerate"]))


def test_chat_json_and_embeddings(cells: dict[str, Any]) -> None:
    chat = text_of(cells["chat"])
    assert chat.count("assistant: ") == 2 and "turn cost: TurnStats(" in chat
    person = ast.literal_eval(text_of(cells["json"]).removeprefix("person: ").strip())
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)
    assert "shape: (3, 576)" in text_of(cells["embeddings"])
