#!/usr/bin/env bash
# Install the system Chromium and its driver (Debian packages `chromium`, `chromium-driver`) for the
# `ui` test tier. No browser is ever downloaded by the tests themselves.
#
# Idempotent: does nothing when /usr/bin/chromium and /usr/bin/chromedriver exist. When not root
# it uses sudo if that works without a password, else says what to run and exits 0 (the ui tests
# then skip, naming the missing binary).
set -uo pipefail

CHROMIUM=${LM_PIPELINE_CHROMIUM:-/usr/bin/chromium}
DRIVER=${LM_PIPELINE_CHROMEDRIVER:-/usr/bin/chromedriver}

if [ -x "$CHROMIUM" ] && [ -x "$DRIVER" ]; then
  echo "install_browser: $("$CHROMIUM" --version 2>/dev/null || echo chromium) already installed"
  exit 0
fi

if [ "$(id -u)" = 0 ]; then
  SUDO=()
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
  SUDO=(sudo -n)
else
  echo "install_browser: not root and no passwordless sudo; install it with:" >&2
  echo "  sudo apt-get install -y chromium chromium-driver" >&2
  exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
  echo "install_browser: no apt-get on this machine; install Chromium and chromedriver by hand" >&2
  exit 0
fi

export DEBIAN_FRONTEND=noninteractive
if ! "${SUDO[@]}" apt-get install -y --no-install-recommends chromium chromium-driver; then
  "${SUDO[@]}" apt-get update -q && "${SUDO[@]}" apt-get install -y --no-install-recommends chromium chromium-driver \
    || { echo "install_browser: apt-get failed; the ui tests will skip" >&2; exit 0; }
fi
"$CHROMIUM" --version 2>/dev/null || true
