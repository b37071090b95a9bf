#!/usr/bin/env bash
# Set up (idempotent), then lint, type-check and run the tests: the default selection plus
# the `integration` and `browser` markers (docs/testing.md says which marker runs where).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$repo/scripts/bootstrap.sh"
bash "$repo/scripts/install_browser.sh"
py=${LLAMAX_VENV:-$repo/.venv}/bin/python
cd "$repo"
"$py" -m ruff check .
"$py" -m mypy
# The docs site: a broken link or a public name without a docstring fails the build.
# (--quiet would hide the warnings --strict counts: print the log when it fails.)
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
if ! NO_MKDOCS_2_WARNING=1 "$py" -m mkdocs build --strict --site-dir "$site/html" \
    >"$site/mkdocs.log" 2>&1; then
  grep -v '^INFO' "$site/mkdocs.log" >&2 || true
  echo "mkdocs build --strict failed (the warnings above)" >&2
  exit 1
fi
"$py" -m pytest -q --durations=15 -m "not soak and not cluster and not gpu" "$@"
