#!/usr/bin/env bash
# Virtual environments for the peer systems the benchmark compares against. Run from the repo root:
#
#     bash bench/setup_peers.sh            # all three environments
#     bash bench/setup_peers.sh genai      # only .venv-genai
#     bash bench/setup_peers.sh hf         # only .venv-hf
#     bash bench/setup_peers.sh optimum    # only .venv-optimum (optimum-onnx pins an older transformers)
#
# .venv-genai  ONNX Runtime GenAI + what its model builder needs (onnx, onnx-ir, torch, transformers,
#              numpy, onnxruntime), for bench/peers/genai_runner.py
# .venv-hf     torch + transformers (+ psutil), for bench/peers/hf_runner.py
# .venv-optimum  torch + optimum-onnx + onnxruntime, for bench/peers/optimum_runner.py
#
# bench/bench_peers.py runs every runner from these environments (GenAI with its default threading and
# with edgespec's, k / n-gram sweeps, HF assisted and prompt lookup sweeps) in one run.
#
# Idempotent: an environment whose stamp matches the pinned requirements and whose checks pass is
# left alone; otherwise it is (re)installed in place. Each step prints "ERROR: ..." and exits
# non-zero on failure. torch is always pinned to 2.13.0 (this machine's CPU wheel; an unpinned torch
# resolves to a multi-GB CUDA build). Versions can be overridden with the environment variables
# below (PYTHON, GENAI_VERSION, ORT_VERSION, ONNX_VERSION, ONNX_IR_VERSION, TRANSFORMERS_VERSION,
# TORCH_VERSION); the runners were verified with the defaults.
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

case "${1:-all}" in
    all) setup_genai; setup_hf; setup_optimum ;;
    genai) setup_genai ;;
    hf) setup_hf ;;
    optimum) setup_optimum ;;
    *) die "unknown argument '$1' (expected: all, genai, hf or optimum)" ;;
esac
echo "peer environments ready"
