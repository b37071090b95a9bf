"""Object rules that keep the schema's property order (issue 56).

llama-cpp-python's converter (like llama.cpp's) writes an object's required properties
first and its optional ones after, so ``{"zeta": ..., "expression": ...}`` with only
``expression`` required is forced out as ``{"expression": ..., "zeta": ...}``: the order a
tool's author wrote is lost. :func:`ordered_object_rule` writes the properties in schema
order, each optional one free to be left out.

Design: ``first-i`` is "properties ``i..`` when none is written yet" (no comma before the
next; up to the first required one): a required property is written there, an optional
one is written or skipped;
``rest-i`` is "properties ``i..`` after one was written": each with a comma, optional ones
in ``( ... )?``. Two rules per property, so the grammar grows linearly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["ordered_object_rule"]


def ordered_object_rule(
    add_rule: Callable[[str, str], str], name: str, kvs: Sequence[tuple[str, bool]]
) -> str:
    """The body of an object rule whose properties come in the order of ``kvs``.

    Args:
        add_rule: Adds a rule (name, body) to the grammar and returns the name it got.
        name: The object's rule name, the prefix of the helper rules.
        kvs: Each property's key-value rule name and whether it is required, in order.

    Returns:
        ``"{" space <properties> "}" space``.
    """
    prefix = f"{name}-" if name else ""
    rests = [""] * (len(kvs) + 1)  # rests[len(kvs)]: nothing left
    for i in range(len(kvs) - 1, 0, -1):
        kv, required = kvs[i]
        item = f'"," space {kv}' if required else f'( "," space {kv} )?'
        rests[i] = add_rule(f"{prefix}rest-{i}", f"{item} {rests[i + 1]}".strip())
    first = ""
    first_required = next((i for i, (_, required) in enumerate(kvs) if required), len(kvs) - 1)
    for i in range(first_required, -1, -1):
        kv, required = kvs[i]
        written = f"{kv} {rests[i + 1]}".strip()
        if required:
            body = written
        elif first:
            body = f"( {written} ) | {first}"
        else:
            body = f"( {written} )?"
        first = add_rule(f"{prefix}first-{i}", body)
    return f'"{{" space {first} "}}" space' if kvs else '"{" space "}" space'
