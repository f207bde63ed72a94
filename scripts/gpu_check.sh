#!/usr/bin/env bash
# The GPU check, in one call of a lent GPU machine: tests/gpu, then benchmarks/gpu.py, then
# benchmarks/vision_tower.py (the patch embedding as cuDNN's Conv3d and as the engine's GEMM),
# then benchmarks/rerank.py (the tiny reranker's pairs/s batched and one pair at a time).
#
# The machine has torch, transformers, pytest and httpx but not vlmserve's other core needs.
# Before the call, download them here as py3.12 wheels into .whl/ (ignored by git, named
# in the call's carry):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#     -d .whl pydantic pydantic_core pydantic-settings annotated-types typing-inspection \
#     python-dotenv av typing_extensions pytest-asyncio blake3   # the versions pip list shows
# Then run `bash scripts/gpu_check.sh` there. Logs and gpu.json go to $OUT (else gpu-out/).
# Arguments go to benchmarks/gpu.py; none: --quick (contexts short and 4k, levels 1, 8, 64),
# so the whole check fits in 5 minutes, compilation included. Each stage prints its time.
set -uo pipefail
out=${OUT:-gpu-out}
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/device.txt"
python3 -c 'import torch, transformers, pytest; print("torch", torch.__version__,
    "transformers", transformers.__version__, "pytest", pytest.__version__)' | tee -a "$out/device.txt"
timeout "${GPU_TESTS_S:-240}" python3 -m pytest tests/gpu --confcutdir tests/gpu -o addopts="" \
    -p no:cacheprovider -W default -q -rA 2>&1 | tee "$out/pytest.log"
tests=$?
echo "tests took ${SECONDS}s"
[ $# -gt 0 ] || set -- --quick
bench_start=$SECONDS
timeout "${GPU_BENCH_S:-420}" python3 benchmarks/gpu.py --json "$out/gpu.json" "$@" 2>&1 \
    | grep --line-buffered -v -e 'Loading weights' -e 'Writing model' | tee "$out/bench.log"
bench=$?
echo "benchmark took $((SECONDS - bench_start))s"
timeout "${GPU_TOWER_S:-120}" python3 benchmarks/vision_tower.py --device cuda \
    --json "$out/vision_tower.json" 2>&1 | grep -v -e 'Loading weights' -e 'Writing model' \
    | tee "$out/vision_tower.log"
timeout "${GPU_RERANK_S:-90}" python3 benchmarks/rerank.py --device cuda \
    --json "$out/rerank.json" 2>&1 | grep -v -e 'Loading weights' -e 'Writing model' \
    | tee "$out/rerank.log"
echo "the check ${SECONDS}s"
echo "tests exit $tests, benchmark exit $bench"
[ "$tests" = 0 ] && [ "$bench" = 0 ]
