#!/usr/bin/env bash
# The GPU check in one command, inside an 8-minute limit (see bench/gpu_check.py for what it measures).
#   bash bench/gpu_check.sh [MODEL_DIR] [OUT_DIR]
# MODEL_DIR: the converted default model ($SWIFTWRITE_HOME/models/smollm2-135m) or a folder of GGUF parts
# (bench/gpu_ship.sh makes them, with the `gguf` wheel, installed here from that folder); missing: a
# random-weight model of the same shape, labelled as such. OUT_DIR default: bench/results/gpu-DATE.
# Needs torch, triton and transformers already installed; no network. Cut at 470 s (each speed run at 30 s);
# the report is written after every section, so a cut run keeps what it finished.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL_DIR="${1:-}"
OUT="${2:-bench/results/gpu-$(date +%Y-%m-%d)}"
PY="${PYTHON:-python3}"
export SWIFTWRITE_HOME="${SWIFTWRITE_HOME:-/tmp/swiftwrite-gpu-home}"  # where a GGUF is converted
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # swiftwrite from this checkout: the GPU image does not install it
if [ -n "$MODEL_DIR" ] && compgen -G "$MODEL_DIR/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --target /tmp/swiftwrite-gpu-site "$MODEL_DIR"/*.whl
  export PYTHONPATH="/tmp/swiftwrite-gpu-site${PYTHONPATH:+:$PYTHONPATH}"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "nvidia-smi: not available"
ARGS=(--out "$OUT")
if [ -n "$MODEL_DIR" ]; then ARGS+=(--model-dir "$MODEL_DIR"); fi
timeout 470 "$PY" bench/gpu_check.py "${ARGS[@]}" "${@:3}"
