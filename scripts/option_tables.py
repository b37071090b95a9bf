"""Regenerate the options tables of the docs from the option fields (see llamax.optionspec),
the request-field tables from the dialects' route tables (llamax.dialects.TABLES: one
FieldTable per route, OpenAI's, Anthropic's and llama-server's native ones) and the stats
tables from the stats fields (see llamax.stats).

Usage: ``python scripts/option_tables.py [FILE.md ...]`` (default: ``docs/*.md``).
"""

from __future__ import annotations

import sys
from pathlib import Path

from llamax.config import OPTION_LISTS
from llamax.dialects import TABLES
from llamax.dialects.fields import regenerate as field_tables
from llamax.optionspec import regenerate
from llamax.server.config import SERVER_OPTION_LISTS
from llamax.stats import regenerate as stats_tables


def main(argv: list[str]) -> int:
    """Rewrite the options, request-field and stats tables of the given Markdown files (default:
    ``docs/*.md``)."""
    paths = [Path(a) for a in argv] or sorted(Path("docs").glob("*.md"))
    for path in paths:
        text = path.read_text(encoding="utf-8")
        new = stats_tables(
            field_tables(regenerate(text, {**OPTION_LISTS, **SERVER_OPTION_LISTS}), TABLES)
        )
        if new != text:
            path.write_text(new, encoding="utf-8")
            print(f"updated {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
