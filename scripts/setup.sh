#!/usr/bin/env bash
# Install vlmserve for development with everything its tests need:
#
#   scripts/setup.sh
#
# 1. Debian's redis-server (Redis stream-store tests), chromium and chromium-driver (the
#    browser test) with apt-get, when they are missing and apt-get is there. No PyPI package
#    ships these binaries in a form the tests can use, so they come from the distribution.
# 2. `python -m pip install -e ".[dev,ray]"` into the Python on PATH (a virtualenv if active).
#
# Idempotent: what is installed already is left alone. When the system packages cannot be
# installed (no apt-get, no root or sudo, no network) it says so and goes on; the tests that
# need them are then skipped with that reason. Set VLMSERVE_SETUP_SKIP_APT=1 to skip step 1.
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v chromedriver >/dev/null 2>&1 || missing+=(chromium-driver)

apt_install() {
  local sudo=()
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null 2>&1 || return 1
    sudo=(sudo)
  fi
  "${sudo[@]}" apt-get update -qq >/dev/null &&
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
      --no-install-recommends "$@" >/dev/null
}

if [ "${#missing[@]}" -gt 0 ] && [ "${VLMSERVE_SETUP_SKIP_APT:-0}" != 1 ]; then
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "setup: no apt-get here; install ${missing[*]} with your package manager," \
      "or the tests that need them are skipped" >&2
  else
    echo "setup: installing ${missing[*]} with apt-get" >&2
    apt_install "${missing[@]}" ||
      echo "setup: could not install ${missing[*]} with apt-get (root or sudo and the" \
        "Debian mirrors are needed); the tests that need them are skipped" >&2
  fi
fi

python -m pip install -q -e ".[dev,ray]"

# The openai-node SDK for tests/e2e/test_openai_node.py (npm's registry; skipped without node)
if command -v npm >/dev/null 2>&1; then
  node_dir="${VLMSERVE_NODE_DIR:-$HOME/.cache/vlmserve/node}"
  mkdir -p "$node_dir"
  npm install --silent --no-audit --no-fund --prefix "$node_dir" openai@6 >/dev/null 2>&1 ||
    echo "setup: could not install the openai npm package; its test is skipped" >&2
fi
