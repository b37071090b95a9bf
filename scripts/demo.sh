#!/usr/bin/env bash
# Set up (idempotent) and run the llamax demo on the default model.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$repo/scripts/bootstrap.sh"
exec "${LLAMAX_VENV:-$repo/.venv}/bin/python" -m llamax.demo "$@"
