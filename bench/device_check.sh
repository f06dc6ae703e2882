#!/usr/bin/env bash
# One GPU check for a fresh NVIDIA machine that reaches only package registries (PyPI, Debian).
#
#   bash bench/device_check.sh            # results: ${OUT:-bench/results}/device.json (+ a summary on stdout)
#   DEVICE_CHECK_ARGS="--only native" bash bench/device_check.sh
#
# Re-runnable: the venv (.venv-device), exported engines (engines/, engines/device/) and TensorRT plans /
# ORT TensorRT caches are reused when present. torch is installed only when an engine must be exported.
# Package choices (pyproject's gpu / trt extras say why): tensorrt-cu12 10.x (not TensorRT 11, the unpinned default),
# cuda-python 12.x (13.x needs a driver >= 580), onnxruntime-gpu and never the CPU onnxruntime beside it
# (both install the `onnxruntime` module). The pins are the `trt` extra's, installed by name: `pip install
# -e '.[...]'` would also pull edgespec's CPU onnxruntime dependency back in on every re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-bench/results}"
mkdir -p "$OUT_DIR"
VENV=.venv-device
T0=$(date +%s)
log() { echo "[device_check +$(( $(date +%s) - T0 ))s] $*"; }

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || log "nvidia-smi failed"
if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV"
  python3 -m venv "$VENV" || { apt-get install -y -q python3-venv >/dev/null && python3 -m venv "$VENV"; }
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip install -q --disable-pip-version-check)

need_export=0
for f in engines/demo-target/engine.json engines/demo-draft/engine.json engines/vla-reacher/policy.json \
         engines/device/demo-target-fp16/engine.json engines/device/demo-draft-fp16/engine.json \
         engines/device/vla-reacher-fp16/policy.json; do
  [ -f "$f" ] || need_export=1
done

if ! "$PY" -c "import tensorrt, onnxruntime, cuda, tokenizers, edgespec" 2>/dev/null; then
  log "installing runtime packages"
  "${PIP[@]}" --upgrade pip
  "${PIP[@]}" --no-deps -e .                       # edgespec itself; its deps below (not CPU onnxruntime)
  "${PIP[@]}" "numpy>=1.24" "tokenizers>=0.15" "cuda-python>=12.2,<13" "tensorrt-cu12>=10.3,<11" psutil \
    "onnxruntime-gpu[cuda,cudnn]"
fi
if [ "$need_export" = 1 ] && ! "$PY" -c "import torch, transformers, onnx, onnxscript" 2>/dev/null; then
  log "installing the export packages (torch from PyPI: only needed to export the engines once)"
  "${PIP[@]}" torch "onnx>=1.16" "onnxscript>=0.1" "transformers>=4.45" "safetensors>=0.4" "tqdm>=4.60"
fi
if "$PY" -m pip show -q onnxruntime >/dev/null 2>&1; then   # a dependency pulled the CPU build in
  log "removing CPU onnxruntime (it shares the onnxruntime module with onnxruntime-gpu)"
  "$PY" -m pip uninstall -y -q onnxruntime onnxruntime-gpu
  "${PIP[@]}" "onnxruntime-gpu[cuda,cudnn]"
fi

# ORT's TensorRT EP dlopens libnvinfer: point it at the tensorrt-cu12 wheel's libraries
TRT_LIBS=$("$PY" -c "import os, tensorrt_libs; print(os.path.dirname(tensorrt_libs.__file__))" 2>/dev/null || true)
if [ -n "$TRT_LIBS" ]; then export LD_LIBRARY_PATH="$TRT_LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"; fi

log "running bench/device_check.py"
# shellcheck disable=SC2086
"$PY" bench/device_check.py --out "$OUT_DIR/device.json" ${DEVICE_CHECK_ARGS:-}
log "done"
