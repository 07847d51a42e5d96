#!/usr/bin/env bash
# The GPU check in one command, inside an 8-minute limit (see bench/gpu_check.py for what it measures).
#   bash bench/gpu_check.sh [MODEL_DIR] [OUT_DIR]
# MODEL_DIR: the converted default model ($SWIFTWRITE_HOME/models/smollm2-135m) or a folder of GGUF parts;
# missing: a random-weight model of the same shape, labelled as such. OUT_DIR default: bench/results/gpu-DATE.
# Needs torch, triton and transformers already installed; no network.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL_DIR="${1:-}"
OUT="${2:-bench/results/gpu-$(date +%Y-%m-%d)}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "nvidia-smi: not available"
ARGS=(--out "$OUT")
if [ -n "$MODEL_DIR" ]; then ARGS+=(--model-dir "$MODEL_DIR"); fi
timeout 470 python bench/gpu_check.py "${ARGS[@]}" "${@:3}"
