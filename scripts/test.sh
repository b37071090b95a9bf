#!/usr/bin/env bash
# Set up (idempotent), then lint, type-check and run the whole test suite.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$repo/scripts/bootstrap.sh"
bash "$repo/scripts/install_browser.sh"
py=${LLAMAX_VENV:-$repo/.venv}/bin/python
cd "$repo"
"$py" -m ruff check .
"$py" -m mypy
exec "$py" -m pytest -q --durations=15 "$@"
