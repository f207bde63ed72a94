#!/usr/bin/env bash
# Install `transformers serve` (transformers[serving]) into its own virtual environment:
#   ${VLMSERVE_PEERS_DIR:-$HOME/.cache/vlmserve/peers}/transformers-serve
# The venv sees this machine's site-packages (--system-site-packages) so it reuses the torch
# vlmserve runs on; by default it pins the same transformers version vlmserve uses, so the
# comparison is between servers, not between model implementations. Idempotent.
#
#   bash benchmarks/peers/install_transformers_serve.sh
#   TRANSFORMERS_VERSION=5.23.0 bash benchmarks/peers/install_transformers_serve.sh
set -euo pipefail

PEERS_DIR=${VLMSERVE_PEERS_DIR:-$HOME/.cache/vlmserve/peers}
VENV="$PEERS_DIR/transformers-serve"
VERSION=${TRANSFORMERS_VERSION:-$(python3 -c 'import transformers; print(transformers.__version__)')}

mkdir -p "$PEERS_DIR"
if [[ ! -x "$VENV/bin/python" ]]; then
  python3 -m venv --system-site-packages "$VENV"
fi
PY="$VENV/bin/python"

echo "==> pip install transformers[serving]==$VERSION into $VENV"
if ! "$PY" -m pip install "transformers[serving]==$VERSION"; then
  echo "ERROR: could not install transformers[serving]==$VERSION (see pip's message above)." >&2
  exit 1
fi

# With everything already satisfied from the system site-packages pip writes no `transformers`
# console script into the venv, so the CLI is run as a module.
echo "==> checking the CLI"
HF_HUB_OFFLINE=1 "$PY" -m transformers.cli.transformers serve --help > /dev/null
"$PY" -c 'import torch, transformers; print(f"transformers {transformers.__version__}  torch {torch.__version__}")'
echo "OK: $PY -m transformers.cli.transformers serve --host 127.0.0.1 --port PORT"
