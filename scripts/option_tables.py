"""Regenerate the options tables of the docs from the option fields (see llamax.optionspec).

Usage: ``python scripts/option_tables.py [FILE.md ...]`` (default: ``docs/*.md``).
"""

from __future__ import annotations

import sys

from llamax.optionspec import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
