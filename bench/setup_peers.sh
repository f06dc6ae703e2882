#!/usr/bin/env bash
# Virtual environments for the peer systems the benchmark compares against. Run from the repo root:
#
#     bash bench/setup_peers.sh            # all four environments
#     bash bench/setup_peers.sh genai      # only .venv-genai
#     bash bench/setup_peers.sh hf         # only .venv-hf
#     bash bench/setup_peers.sh optimum    # only .venv-optimum (optimum-onnx pins an older transformers)
#     bash bench/setup_peers.sh llamacpp   # only .venv-llamacpp + llama.cpp built from source (~25 min, 2 cores)
#
# .venv-genai  ONNX Runtime GenAI + what its model builder needs (onnx, onnx-ir, torch, transformers,
#              numpy, onnxruntime), for bench/peers/genai_runner.py
# .venv-hf     torch + transformers (+ psutil), for bench/peers/hf_runner.py
# .venv-optimum  torch + optimum-onnx + onnxruntime, for bench/peers/optimum_runner.py
# .venv-llamacpp llama-cpp-python (its PyPI sdist, whose vendor/llama.cpp is built here with cmake: llama-server,
#              llama-quantize, llama-speculative(-simple), llama-lookup, llama-completion, llama-tokenize and the
#              shared libraries the Python binding loads) + gguf + what convert_hf_to_gguf.py needs, for
#              bench/peers/llamacpp_runner.py. The build lives in .cache/llamacpp/ (LLAMACPP_DIR); the venv's
#              llamacpp.json names it.
#
# bench/bench_peers.py runs every runner from these environments (GenAI with its default threading and
# with edgespec's, k / n-gram sweeps, HF assisted and prompt lookup sweeps) in one run.
#
# Idempotent: an environment whose stamp matches the pinned requirements and whose checks pass is
# left alone; otherwise it is (re)installed in place. Each step prints "ERROR: ..." and exits
# non-zero on failure. torch is always pinned to 2.13.0 (this machine's CPU wheel; an unpinned torch
# resolves to a multi-GB CUDA build). Versions can be overridden with the environment variables
# below (PYTHON, GENAI_VERSION, ORT_VERSION, ONNX_VERSION, ONNX_IR_VERSION, TRANSFORMERS_VERSION,
# TORCH_VERSION, LLAMA_CPP_PYTHON_VERSION, GGUF_VERSION, LLAMACPP_DIR, LLAMACPP_JOBS); the runners were
# verified with the defaults.
set -uo pipefail

PYTHON=${PYTHON:-python3}
GENAI_VERSION=${GENAI_VERSION:-0.18.0}
ORT_VERSION=${ORT_VERSION:-1.32.0}
ONNX_VERSION=${ONNX_VERSION:-1.23.2}
ONNX_IR_VERSION=${ONNX_IR_VERSION:-1.1.0}
TRANSFORMERS_VERSION=${TRANSFORMERS_VERSION:-5.24.0}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}

GENAI_REQS=("onnxruntime-genai==${GENAI_VERSION}" "onnxruntime==${ORT_VERSION}" "onnx==${ONNX_VERSION}"
            "onnx-ir==${ONNX_IR_VERSION}" "torch==${TORCH_VERSION}" "transformers==${TRANSFORMERS_VERSION}"
            "numpy" "safetensors")
HF_REQS=("torch==${TORCH_VERSION}" "transformers==${TRANSFORMERS_VERSION}" "psutil" "numpy" "safetensors")

die() { echo "ERROR: $*" >&2; exit 1; }

step() {  # step "description" command...
    local what=$1; shift
    echo "==> ${what}"
    "$@"
    local rc=$?
    [ $rc -eq 0 ] || die "${what} failed (exit ${rc}): $*"
}

[ -f pyproject.toml ] && [ -d bench ] || die "run this from the repository root: bash bench/setup_peers.sh"
command -v "$PYTHON" >/dev/null 2>&1 || die "python interpreter '$PYTHON' not found (set PYTHON=...)"
"$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' \
    || die "$PYTHON is $("$PYTHON" -V 2>&1); Python >= 3.10 is needed"
export HF_HUB_OFFLINE=1 PIP_DISABLE_PIP_VERSION_CHECK=1

GENAI_CHECK=$(cat <<'EOF'
import sys, torch, onnx, onnx_ir, onnxruntime, transformers, numpy, onnxruntime_genai as og
want = sys.argv[1]
assert og.__version__ == want, f"onnxruntime-genai {og.__version__} installed, {want} wanted"
assert torch.version.cuda is None, f"torch {torch.__version__} is a CUDA build; a CPU build is needed"
for name in ("set_speculative_options", "get_speculative_options"):
    assert hasattr(og.GeneratorParams, name), f"GeneratorParams.{name} missing"
assert hasattr(og.Generator, "get_speculative_stats"), "Generator.get_speculative_stats missing"
assert hasattr(og.Config, "overlay"), "Config.overlay missing"
print(f"onnxruntime-genai {og.__version__}, onnxruntime {onnxruntime.__version__}, onnx {onnx.__version__}, "
      f"onnx-ir {onnx_ir.__version__}, torch {torch.__version__}, transformers {transformers.__version__}, "
      f"numpy {numpy.__version__}")
EOF
)

HF_CHECK=$(cat <<'EOF'
import torch, transformers, psutil
from transformers import LlamaConfig, LlamaForCausalLM
assert torch.version.cuda is None, f"torch {torch.__version__} is a CUDA build; a CPU build is needed"
torch.manual_seed(0)
torch.set_num_threads(1)
cfg = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
           num_key_value_heads=1, head_dim=16, max_position_embeddings=128, bos_token_id=0, eos_token_id=0)
t, d = LlamaForCausalLM(LlamaConfig(**cfg)).eval(), LlamaForCausalLM(LlamaConfig(**cfg)).eval()
x = torch.tensor([[5, 6, 7, 5, 6, 7, 5, 6]])
kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
plain = t.generate(x, **kw)
assisted = t.generate(x, assistant_model=d, **kw)
lookup = t.generate(x, prompt_lookup_num_tokens=3, **kw)
assert plain.tolist() == assisted.tolist() == lookup.tolist(), "assisted/prompt-lookup greedy output differs from plain"
print(f"torch {torch.__version__}, transformers {transformers.__version__}, psutil {psutil.__version__}: "
      "generate(assistant_model=...) and generate(prompt_lookup_num_tokens=...) work")
EOF
)

setup_venv() {  # setup_venv DIR CHECK_SCRIPT CHECK_ARG REQS...
    local dir=$1 check=$2 arg=$3; shift 3
    local stamp="${dir}/.edgespec-peers-stamp" want
    want="$("$PYTHON" -V 2>&1) $*"
    if [ -x "${dir}/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ] \
        && "${dir}/bin/python" -c "$check" "$arg" >/dev/null 2>&1; then
        echo "==> ${dir}: up to date ($("${dir}/bin/python" -c "$check" "$arg" 2>/dev/null))"
        return 0
    fi
    if [ ! -x "${dir}/bin/python" ]; then
        step "create ${dir}" "$PYTHON" -m venv "$dir"
    fi
    step "install into ${dir}: $*" "${dir}/bin/python" -m pip install --quiet "$@"
    step "check ${dir}" "${dir}/bin/python" -c "$check" "$arg"
    echo "$want" > "$stamp" || die "cannot write ${stamp}"
}

# `builder --help` itself crashes in onnxruntime-genai 0.18.0 (a bare '%' in an option's help text), so the
# check imports the builder module (with torch, transformers, onnx_ir) instead of asking for help.
builder_import() {
    .venv-genai/bin/python -c 'import onnxruntime_genai.models.builder as b; assert callable(b.create_model)'
}

setup_genai() {
    setup_venv .venv-genai "$GENAI_CHECK" "$GENAI_VERSION" "${GENAI_REQS[@]}"
    step "check the GenAI model builder imports" builder_import
}

setup_hf() {
    setup_venv .venv-hf "$HF_CHECK" "" "${HF_REQS[@]}"
}

# optimum-onnx pins an older transformers (< 4.58), hence its own environment.
OPTIMUM_REQS=("torch==${TORCH_VERSION}" "optimum-onnx" "onnx" "onnxruntime==${ORT_VERSION}" "safetensors")
OPTIMUM_CHECK='import torch, optimum.onnxruntime, transformers; assert torch.version.cuda is None; print("optimum ok, transformers", transformers.__version__)'

setup_optimum() {
    setup_venv .venv-optimum "$OPTIMUM_CHECK" "" "${OPTIMUM_REQS[@]}"
}

# ---- llama.cpp ------------------------------------------------------------------------------------------------
# llama-cpp-python's sdist carries llama.cpp's source (vendor/llama.cpp, the commit its CHANGELOG names). That one
# source is built once with cmake (Release, GGML_NATIVE, shared libraries): the programs the runner uses and the
# libraries llama-cpp-python loads (it is installed with -DLLAMA_BUILD=OFF, so pip does not build llama.cpp a
# second time; LLAMA_CPP_LIB_PATH points it at this build). Nothing is downloaded at build time (no curl, no
# OpenSSL, no web UI assets). The venv's llamacpp.json records where the build is, the versions, the flags and
# how long the build took.
LLAMA_CPP_PYTHON_VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
GGUF_VERSION=${GGUF_VERSION:-0.19.0}
LLAMACPP_DIR=${LLAMACPP_DIR:-.cache/llamacpp}
LLAMACPP_JOBS=${LLAMACPP_JOBS:-$(nproc 2>/dev/null || echo 2)}
LLAMACPP_TARGETS=(llama-server llama-quantize llama-speculative llama-speculative-simple llama-lookup
                  llama-completion llama-tokenize)
LLAMACPP_CMAKE_FLAGS=(-DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=ON -DLLAMA_BUILD_TESTS=OFF
                      -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_APP=OFF
                      -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF)
# what convert_hf_to_gguf.py imports (its requirements file pins torch 2.11 and transformers 4.57; this machine's
# CPU torch and the other peers' transformers convert these Llama checkpoints), and llama-cpp-python's own deps
LLAMACPP_REQS=("torch==${TORCH_VERSION}" "transformers==${TRANSFORMERS_VERSION}" "gguf==${GGUF_VERSION}" "numpy"
               "safetensors" "sentencepiece" "protobuf" "tokenizers" "typing-extensions" "diskcache" "jinja2")

LLAMACPP_CHECK=$(cat <<'EOF'
import json, os, sys, torch, gguf, transformers, tokenizers
from importlib.metadata import version
info = json.load(open(os.path.join(sys.prefix, "llamacpp.json")))
os.environ["LLAMA_CPP_LIB_PATH"] = info["bin"]
import llama_cpp
want = sys.argv[1]
assert llama_cpp.__version__ == want, f"llama-cpp-python {llama_cpp.__version__} installed, {want} wanted"
assert torch.version.cuda is None, f"torch {torch.__version__} is a CUDA build; a CPU build is needed"
for prog in ("llama-server", "llama-quantize", "llama-speculative", "llama-speculative-simple", "llama-lookup",
             "llama-completion", "llama-tokenize"):
    p = os.path.join(info["bin"], prog)
    assert os.access(p, os.X_OK), f"{p} missing"
assert os.path.isfile(os.path.join(info["src"], "convert_hf_to_gguf.py")), "convert_hf_to_gguf.py missing"
llama_cpp.llama_backend_init()
print(f"llama-cpp-python {llama_cpp.__version__} (llama.cpp {info['llama_cpp_commit']}, built in "
      f"{info['build_s']} s), gguf {version('gguf')}, torch {torch.__version__}, transformers "
      f"{transformers.__version__}; programs in {info['bin']}")
EOF
)

# AMX: a CPU that lists amx_tile makes -march=native compile ggml's AMX kernels, which q8_0 / q4_0 weights then
# run on. Whether they run depends on the CPU (a VM may not pass the tile state through) and on the compiler:
# ggml-cpu/amx/mmq.cpp's ggml_tile_config_init fills a local tile configuration and loads it, and GCC 12 (Debian
# 12's cc) drops those stores because it does not take _tile_loadconfig to read them, so the tiles stay
# unconfigured and llama.cpp dies at its first tilezero (SIGILL for q4_0 and q8_0), on a CPU whose AMX works.
# The probe does what that function does, built as llama.cpp is (-O3 -march=native); if it faults, AMX is
# compiled out (-mno-amx-*) and llama.cpp's q4_0 / q8_0 weights run on its repacked AVX-512 kernels instead.
AMX_PROBE=$(cat <<'EOF'
#include <immintrin.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>
typedef struct {  /* ggml-cpu/amx/common.h's tile_config_t */
    uint8_t palette_id, start_row, reserved_0[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config_t;
int main(void) {
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */)) return 2;
    _Alignas(64) tile_config_t tc = {0};  /* as ggml_tile_config_init: a local, filled, then loaded */
    tc.palette_id = 1;
    tc.rows[0] = 16;
    tc.colsb[0] = 64;
    _tile_loadconfig(&tc);
    _tile_zero(0);
    _tile_release();
    return 0;
}
EOF
)

amx_faults() {  # true when -march=native would compile AMX in and this machine faults on AMX instructions
    [ "$(uname -m)" = x86_64 ] || return 1
    cc -march=native -dM -E -x c /dev/null 2>/dev/null | grep __AMX_TILE__ >/dev/null || return 1  # not -q: pipefail
    local d rc
    d=$(mktemp -d) || return 1
    printf '%s\n' "$AMX_PROBE" > "$d/probe.c"
    if ! cc -O3 -march=native "$d/probe.c" -o "$d/probe" >/dev/null 2>&1; then rm -rf "$d"; return 1; fi
    "$d/probe" >/dev/null 2>&1
    rc=$?
    rm -rf "$d"
    [ $rc -ne 0 ]
}

llamacpp_build() {  # llamacpp_build SRC BUILD: cmake configure + build of the vendored llama.cpp (incremental)
    local src=$1 build=$2
    cmake -S "${src}/vendor/llama.cpp" -B "$build" "${LLAMACPP_CMAKE_FLAGS[@]}" > "${build}.configure.log" 2>&1 \
        || { tail -20 "${build}.configure.log" >&2; echo "ERROR: cmake configure failed (log: ${build}.configure.log)" >&2; return 1; }
    cmake --build "$build" --config Release -j "$LLAMACPP_JOBS" --target "${LLAMACPP_TARGETS[@]}" \
        > "${build}.build.log" 2>&1 \
        || { tail -30 "${build}.build.log" >&2; echo "ERROR: cmake build failed (log: ${build}.build.log)" >&2; return 1; }
}

write_llamacpp_info() {  # write_llamacpp_info OUT SRC BUILD VERSION COMMIT SECONDS
    "${dir}/bin/python" -c '
import json, sys
out, src, build, ver, commit, took = sys.argv[1:7]
json.dump({"src": src + "/vendor/llama.cpp", "bin": build + "/bin", "llama_cpp_python": ver,
           "llama_cpp_commit": commit or None, "build_s": int(took), "cmake_flags": sys.argv[7:]},
          open(out, "w"), indent=1)
' "$@" "${LLAMACPP_CMAKE_FLAGS[@]}"
}

setup_llamacpp() {
    local dir=.venv-llamacpp
    local src="${LLAMACPP_DIR}/src-${LLAMA_CPP_PYTHON_VERSION}" build="${LLAMACPP_DIR}/build-${LLAMA_CPP_PYTHON_VERSION}"
    local stamp="${dir}/.edgespec-peers-stamp" want
    local amx_off=""
    if amx_faults; then
        echo "==> AMX code built by this cc faults here (the CPU, or the compiler: see above): llama.cpp is built without AMX (-mno-amx-*)"
        amx_off="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    fi
    # always given, empty or not: CMake keeps CMAKE_C_FLAGS in its cache, so a build configured once with the
    # -mno-amx-* flags would keep them after the probe passes
    LLAMACPP_CMAKE_FLAGS+=("-DCMAKE_C_FLAGS=${amx_off}" "-DCMAKE_CXX_FLAGS=${amx_off}")
    want="$("$PYTHON" -V 2>&1) llama-cpp-python==${LLAMA_CPP_PYTHON_VERSION} ${LLAMACPP_CMAKE_FLAGS[*]} ${LLAMACPP_TARGETS[*]} ${LLAMACPP_REQS[*]}"
    if [ -x "${dir}/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ] \
        && "${dir}/bin/python" -c "$LLAMACPP_CHECK" "$LLAMA_CPP_PYTHON_VERSION" >/dev/null 2>&1; then
        echo "==> ${dir}: up to date ($("${dir}/bin/python" -c "$LLAMACPP_CHECK" "$LLAMA_CPP_PYTHON_VERSION" 2>/dev/null))"
        return 0
    fi
    command -v cmake >/dev/null 2>&1 || die "cmake not found (apt-get install cmake): llama.cpp is built with it"
    command -v c++ >/dev/null 2>&1 || die "no C++ compiler found (apt-get install g++): llama.cpp is built with it"
    mkdir -p "$LLAMACPP_DIR" || die "cannot create ${LLAMACPP_DIR}"
    local sdist="${LLAMACPP_DIR}/llama_cpp_python-${LLAMA_CPP_PYTHON_VERSION}.tar.gz"
    if [ ! -f "${src}/vendor/llama.cpp/CMakeLists.txt" ]; then
        if [ ! -f "$sdist" ]; then
            step "download the llama-cpp-python ${LLAMA_CPP_PYTHON_VERSION} sdist" "$PYTHON" -m pip download \
                --quiet --no-binary :all: --no-deps -d "$LLAMACPP_DIR" "llama-cpp-python==${LLAMA_CPP_PYTHON_VERSION}"
        fi
        [ -f "$sdist" ] || die "no ${sdist} after the download"
        rm -rf "$src" "${src}.partial" && mkdir -p "${src}.partial" || die "cannot create ${src}.partial"
        step "unpack ${sdist}" tar xzf "$sdist" -C "${src}.partial" --strip-components=1
        mv "${src}.partial" "$src" || die "cannot move ${src}.partial to ${src}"
    fi
    local commit
    commit=$(sed -n 's/.*update llama.cpp to ggml-org\/llama.cpp@\([0-9a-f]*\).*/\1/p' "${src}/CHANGELOG.md" | head -1)
    echo "==> build llama.cpp ${commit:-?} (from llama-cpp-python ${LLAMA_CPP_PYTHON_VERSION}) with cmake," \
         "${LLAMACPP_JOBS} jobs, into ${build}: ${LLAMACPP_TARGETS[*]}"
    local t0=$SECONDS
    llamacpp_build "$src" "$build" || die "llama.cpp build failed in ${build}"
    local took=$((SECONDS - t0))
    echo "==> llama.cpp built in ${took} s"
    if [ ! -x "${dir}/bin/python" ]; then
        step "create ${dir}" "$PYTHON" -m venv "$dir"
    fi
    step "install into ${dir}: ${LLAMACPP_REQS[*]}" "${dir}/bin/python" -m pip install --quiet "${LLAMACPP_REQS[@]}"
    step "install llama-cpp-python ${LLAMA_CPP_PYTHON_VERSION} from ${src} (no library build: it loads ${build}/bin)" \
        env CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" "${dir}/bin/python" -m pip install --quiet --no-deps "$src"
    write_llamacpp_info "${dir}/llamacpp.json" "$(cd "$src" && pwd)" "$(cd "$build" && pwd)" \
        "$LLAMA_CPP_PYTHON_VERSION" "$commit" "$took" || die "cannot write ${dir}/llamacpp.json"
    step "check ${dir}" "${dir}/bin/python" -c "$LLAMACPP_CHECK" "$LLAMA_CPP_PYTHON_VERSION"
    echo "$want" > "$stamp" || die "cannot write ${stamp}"
}

case "${1:-all}" in
    all) setup_genai; setup_hf; setup_optimum; setup_llamacpp ;;
    genai) setup_genai ;;
    hf) setup_hf ;;
    optimum) setup_optimum ;;
    llamacpp) setup_llamacpp ;;
    *) die "unknown argument '$1' (expected: all, genai, hf, optimum or llamacpp)" ;;
esac
echo "peer environments ready"
