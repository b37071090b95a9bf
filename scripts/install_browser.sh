#!/usr/bin/env bash
# Install Debian's chromium for the chat page's browser test (tests/test_server_browser.py).
# Idempotent: does nothing when /usr/bin/chromium exists. Needs root and apt (no browser is
# downloaded from the web; Playwright drives this system browser).
set -euo pipefail
if [ -x /usr/bin/chromium ]; then
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "install_browser: need root and apt-get to install chromium (or set LLAMAX_CHROMIUM)" >&2
  exit 1
fi
echo "[install_browser] apt-get install chromium" >&2
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
