#!/usr/bin/env bash
# One GPU check for a fresh NVIDIA machine.
#
#   bash tools/device/device_check.sh     # results: ${OUT:-bench/results}/device.json (+ a summary on stdout)
#   CUDA_CHECK_ARGS="--models bundled" bash tools/device/device_check.sh     # fewer cuda-native models
#   DEVICE_CHECK_ARGS="--only native" bash tools/device/device_check.sh
#   EDGESPEC_WHEELS=wheels/ bash tools/device/device_check.sh   # no network: install from a wheel folder
#
# tools/device/device_setup.py (standard library only) finds the GPU, creates the venv ($EDGESPEC_DEVICE_VENV, default
# .venv-device, with the system's packages visible), installs what each path lacks, one package group at a time,
# from the wheel folder or the indexes that answer (PyPI; pypi.nvidia.com for TensorRT), and says which paths can
# run. When none of the GPU paths can (no GPU, or their packages cannot be installed here), it writes device.json
# with each path's reason and this script exits 3 within seconds.
# Re-runnable: the venv, exported engines (engines/, engines/device/) and TensorRT plans / ORT TensorRT caches are
# reused when present.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT_DIR="${OUT:-bench/results}"
mkdir -p "$OUT_DIR"
VENV="${EDGESPEC_DEVICE_VENV:-.venv-device}"
T0=$(date +%s)
log() { echo "[device_check +$(( $(date +%s) - T0 ))s] $*"; }

# first, provider cuda-native: it needs nothing but nvcc, a driver and the machine's own python3 with PyTorch
# (its baselines), so it runs wherever there is a GPU, also where no other path can (the H200 image); its record
# is device.json's key cuda_native, which the steps below keep
CUDA_RC=0
if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  log "provider cuda-native: tools/device/cuda_check.py"
  # shellcheck disable=SC2086
  python3 tools/device/cuda_check.py --out "$OUT_DIR/device.json" --key cuda_native ${CUDA_CHECK_ARGS:-} || CUDA_RC=$?
else
  log "provider cuda-native: no nvcc here, skipped"
  CUDA_RC=3
fi

log "setting up $VENV for the ONNX Runtime and TensorRT paths"
rc=0
ONLY=$(python3 tools/device/device_setup.py --venv "$VENV" --out "$OUT_DIR/device.json") || rc=$?
if [ "$rc" != 0 ]; then
  log "no ONNX Runtime or TensorRT path can run here (exit $rc); $OUT_DIR/device.json says why"
  [ "$CUDA_RC" = 0 ] && exit 0
  exit "$rc"
fi
ONLY=$(printf '%s\n' "$ONLY" | tail -n 1)
log "paths that can run: $ONLY"
PY="$VENV/bin/python"

# ORT's TensorRT EP dlopens libnvinfer: point it at the tensorrt wheel's libraries
TRT_LIBS=$("$PY" -c "import os, tensorrt_libs; print(os.path.dirname(tensorrt_libs.__file__))" 2>/dev/null || true)
if [ -n "$TRT_LIBS" ]; then export LD_LIBRARY_PATH="$TRT_LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"; fi

log "running tools/device/device_check.py"
# shellcheck disable=SC2086
"$PY" tools/device/device_check.py --out "$OUT_DIR/device.json" --only "$ONLY" --setup "$VENV/setup.json" \
  ${DEVICE_CHECK_ARGS:-}
log "done"
