#!/usr/bin/env bash
# Install the PostgreSQL server binaries (initdb, pg_ctl, postgres; Debian package `postgresql`)
# that the tests of the production instance (tests/test_postgres_instance.py) start a throwaway
# server from. The tests run this script themselves under CI=true when the binaries are missing;
# nothing else needs it (the project's own Dagster instance is SQLite by default).
#
# Idempotent: does nothing when the binaries are there ($LM_PIPELINE_PG_BIN, else the directory of
# pg_ctl on PATH, else /usr/lib/postgresql/*/bin, as tests/helpers/postgres.py looks). Otherwise it
# installs them with apt-get (as root, or through passwordless sudo), running `apt-get update` when
# the package lists are missing or the first attempt fails. No database cluster is created or
# started (create_main_cluster = false): the tests make their own. Exits non-zero, saying what
# is missing, when it cannot install them.
set -uo pipefail

fail() { echo "install_postgres: $*" >&2; exit 1; }

bin_dir() {  # the directory with all three binaries, or nothing
  local d cands=()
  if [ -n "${LM_PIPELINE_PG_BIN:-}" ]; then
    cands=("$LM_PIPELINE_PG_BIN")
  else
    if command -v pg_ctl >/dev/null 2>&1; then cands+=("$(dirname "$(readlink -f "$(command -v pg_ctl)")")"); fi
    while IFS= read -r d; do cands+=("$d"); done < <(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -t/ -k5,5Vr)
  fi
  for d in "${cands[@]}"; do
    if [ -x "$d/initdb" ] && [ -x "$d/pg_ctl" ] && [ -x "$d/postgres" ] && "$d/postgres" --version >/dev/null 2>&1; then
      echo "$d"; return 0
    fi
  done
  return 1
}

if d=$(bin_dir); then
  echo "install_postgres: $("$d/postgres" --version) already installed in $d"
  exit 0
fi
[ -z "${LM_PIPELINE_PG_BIN:-}" ] \
  || fail "\$LM_PIPELINE_PG_BIN=$LM_PIPELINE_PG_BIN has no runnable initdb, pg_ctl and postgres (unset it to install the system packages)"

if [ "$(id -u)" = 0 ]; then
  SUDO=()
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
  SUDO=(sudo -n)
else
  fail "initdb / pg_ctl / postgres missing, and not root and no passwordless sudo; install them with: sudo apt-get install -y postgresql"
fi
command -v apt-get >/dev/null 2>&1 \
  || fail "initdb / pg_ctl / postgres missing and no apt-get on this machine; install the PostgreSQL server by hand (or set LM_PIPELINE_PG_BIN to its bin directory)"

export DEBIAN_FRONTEND=noninteractive
updated=0
apt_install() {  # packages...; apt-get update once when the lists are missing or the install fails
  if [ "$updated" = 0 ] && ! compgen -G "/var/lib/apt/lists/*_Packages*" >/dev/null; then  # a fresh image
    "${SUDO[@]}" apt-get update -q || fail "apt-get update failed"
    updated=1
  fi
  "${SUDO[@]}" apt-get install -y -q --no-install-recommends "$@" && return 0
  [ "$updated" = 1 ] && fail "apt-get install $* failed"
  "${SUDO[@]}" apt-get update -q || fail "apt-get update failed"
  updated=1
  "${SUDO[@]}" apt-get install -y -q --no-install-recommends "$@" || fail "apt-get install $* failed (after apt-get update)"
}

# postgresql-common first, so that installing the server creates (and starts) no `main` cluster:
# what the official postgres container image does too.
apt_install postgresql-common
conf=/etc/postgresql-common/createcluster.conf
if [ -f "$conf" ] && ! grep -Eq '^\s*create_main_cluster\s*=\s*false' "$conf"; then
  if grep -Eq '^\s*#?\s*create_main_cluster\s*=' "$conf"; then
    "${SUDO[@]}" sed -ri 's/^\s*#?\s*create_main_cluster\s*=.*/create_main_cluster = false/' "$conf"
  else
    echo "create_main_cluster = false" | "${SUDO[@]}" tee -a "$conf" >/dev/null
  fi || echo "install_postgres: could not set create_main_cluster = false in $conf; a main cluster may be created" >&2
fi
apt_install postgresql

d=$(bin_dir) || fail "installed the postgresql package, but no initdb / pg_ctl / postgres found on PATH or in /usr/lib/postgresql/*/bin"
echo "install_postgres: $("$d/postgres" --version) installed in $d"
