#!/usr/bin/env bash
# Install the system Chromium and its driver (Debian packages `chromium`, `chromium-driver`) for the
# `ui` test tier. No browser is ever downloaded by the tests themselves.
#
# Idempotent: does nothing when the browser and the driver are already there and run. Otherwise it
# installs both with apt-get (as root, or through passwordless sudo), running `apt-get update` once
# when the package lists are missing or the first install attempt fails. Exits non-zero, naming
# what is missing, when it cannot install them: .ci/run fails then (and under CI=true the ui tests
# fail rather than skip).
set -uo pipefail

CHROMIUM=${LM_PIPELINE_CHROMIUM:-/usr/bin/chromium}
DRIVER=${LM_PIPELINE_CHROMEDRIVER:-/usr/bin/chromedriver}

ready() { [ -x "$CHROMIUM" ] && [ -x "$DRIVER" ] && "$DRIVER" --version >/dev/null 2>&1; }
fail() { echo "install_browser: $*" >&2; exit 1; }

if ready; then
  echo "install_browser: $("$CHROMIUM" --version 2>/dev/null || echo chromium), $("$DRIVER" --version 2>/dev/null | head -1) already installed"
  exit 0
fi

if [ "$(id -u)" = 0 ]; then
  SUDO=()
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
  SUDO=(sudo -n)
else
  fail "$CHROMIUM or $DRIVER missing, and not root and no passwordless sudo; install them with: sudo apt-get install -y chromium chromium-driver"
fi
command -v apt-get >/dev/null 2>&1 \
  || fail "$CHROMIUM or $DRIVER missing and no apt-get on this machine; install Chromium and chromedriver by hand"

export DEBIAN_FRONTEND=noninteractive
apt_install() { "${SUDO[@]}" apt-get install -y -q --no-install-recommends chromium chromium-driver; }
updated=0
if ! compgen -G "/var/lib/apt/lists/*_Packages*" >/dev/null; then  # a fresh image: no package lists yet
  "${SUDO[@]}" apt-get update -q || fail "apt-get update failed"
  updated=1
fi
if ! apt_install; then
  [ "$updated" = 1 ] && fail "apt-get install chromium chromium-driver failed"
  "${SUDO[@]}" apt-get update -q || fail "apt-get update failed"
  apt_install || fail "apt-get install chromium chromium-driver failed (after apt-get update)"
fi
ready || fail "installed, but $CHROMIUM / $DRIVER still missing or not runnable (set LM_PIPELINE_CHROMIUM / LM_PIPELINE_CHROMEDRIVER?)"
echo "install_browser: $("$CHROMIUM" --version 2>/dev/null || echo chromium), $("$DRIVER" --version | head -1) installed"
