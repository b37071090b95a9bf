"""JSON-safe string rules for the schema converter (issue 56).

llama-cpp-python 0.3.36's converter writes three things that let a grammar-forced reply
be text ``json.loads`` rejects, so a forced tool call came back as raw markup:

- its ``char`` rule is ``[^"\\]``, which lets raw control characters (a newline, a tab)
  into strings; JSON forbids ``\\x00-\\x1F`` there. llama.cpp's own converter excludes
  them (and ``\\x7F``), as :data:`JSON_CHAR` does;
- its literals escape ``"`` and line breaks but not the backslash, so an ``enum``/``const``
  value or property name whose JSON holds an escape (``"a\\\\b"``, ``"\\t"``, ``"\\""``)
  is read by the GBNF parser as another string, or as a broken grammar;
  :func:`gbnf_literal` escapes the backslash too, as llama.cpp does;
- its ``number`` takes exponents of up to 16 digits: ``1e999`` loads as infinity, which
  no JSON reply can hold; :data:`JSON_NUMBER` takes at most two (``9.99e99``);
- a ``pattern``'s ``.`` is ``[^\\x0A\\x0D]``, which lets ``"``, ``\\`` and control
  characters into the string; :data:`JSON_DOT` keeps ``.`` to characters a JSON string
  may hold unescaped.

``\\u`` escapes name no lone surrogate (``"\\ud800"`` loads in Python, then fails to encode
as UTF-8 when the reply is written): a high surrogate must be followed by a low one.
"""

from __future__ import annotations

__all__ = [
    "CONVERTER_CHAR",
    "CONVERTER_DOT",
    "CONVERTER_NUMBER",
    "JSON_CHAR",
    "JSON_DOT",
    "JSON_NUMBER",
    "JSON_SAFE_RULES",
    "gbnf_literal",
]

CONVERTER_CHAR = (
    r'[^"\\] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F])'
)
"""The converter's own ``char`` rule, replaced by :data:`JSON_CHAR`."""

CONVERTER_DOT = "[^\\x0A\\x0D]"
"""The converter's own ``dot`` rule (``dotall=False``), replaced by :data:`JSON_DOT`."""

CONVERTER_NUMBER = '("-"? integral-part) ("." decimal-part)? ([eE] [-+]? integral-part)? space'
"""The converter's own ``number`` rule, replaced by :data:`JSON_NUMBER`."""

JSON_NUMBER = '("-"? integral-part) ("." decimal-part)? ([eE] [-+]? [0-9] [0-9]?)? space'
"""A JSON number that stays finite as a double: at most 16 integral digits, 2 exponent
digits."""

_HEX = "[0-9a-fA-F]"
_UNICODE_ESCAPE = (
    f'"u" ( [0-9a-cA-Ce-fE-F] {_HEX} {_HEX} {_HEX} | [dD] [0-7] {_HEX} {_HEX}'
    f' | [dD] [89abAB] {_HEX} {_HEX} "\\\\u" [dD] [c-fC-F] {_HEX} {_HEX} )'
)

JSON_DOT = r'[^"\\\x7F\x00-\x1F]'
"""One character a JSON string holds as itself (no escape needed)."""

JSON_CHAR = f'{JSON_DOT} | "\\\\" ( ["\\\\/bfnrt] | {_UNICODE_ESCAPE} )'
"""One character of a JSON string: itself, a short escape, or a ``\\u`` escape (a
surrogate only as a high-low pair)."""

_LITERAL_ESCAPES = str.maketrans({"\\": "\\\\", '"': '\\"', "\r": "\\r", "\n": "\\n"})


def gbnf_literal(text: str) -> str:
    """``text`` as a GBNF string literal, quoted, every backslash escaped."""
    return '"' + text.translate(_LITERAL_ESCAPES) + '"'


JSON_SAFE_RULES = {
    CONVERTER_CHAR: JSON_CHAR,
    CONVERTER_DOT: JSON_DOT,
    CONVERTER_NUMBER: JSON_NUMBER,
}
"""The converter's rule bodies that can write invalid JSON, and what replaces each."""
