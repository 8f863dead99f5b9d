#!/usr/bin/env bash
# The GPU session's one command: bench/gpu_check.py on CUDA under a hard limit of 470 s (the
# session's run must end within 8 minutes), from the repository root whatever the caller's
# directory. gpu_check.py plans its sections to end within a budget 25 s under that limit
# and writes its JSON report after every section, so a run cut short keeps what it measured.
#
#   bench/gpu_run.sh                     # writes into $OUT if set, else ./gpu_check_out
#   PYTHON=.venv/bin/python bench/gpu_run.sh --skip vllm      # extra arguments go to gpu_check
#
# On this workplace's H200 image: run bench/gpu_wheels.sh here first and carry .whl; then
# `GPU_WHEELS=.whl PYTHON=python3 bench/gpu_run.sh`. Its sections took 550 s there on
# 2026-12-04 (more than one call's budget): a second call with `--skip` of what the first
# measured gets the rest.
#
# Writes: gpu_tests.txt (the `-m gpu` tests' output), gpu_check.json (the report),
# gpu_check.txt (the printed summary, the JSON its last line), gpu_check.stderr (warnings,
# tracebacks of failed sections, children's last words), environment.txt (nvidia-smi, torch /
# transformers / peft / vllm versions).
set -uo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python}
OUT_DIR=${OUT:-$PWD/gpu_check_out}
LIMIT_S=${GPU_CHECK_LIMIT_S:-470}
BUDGET_S=${GPU_CHECK_BUDGET_S:-$((LIMIT_S - 25))}
mkdir -p "$OUT_DIR"

# GPU_WHEELS=.whl: the wheels bench/gpu_wheels.sh downloaded (the device image has no
# pydantic and older transformers / peft), installed apart, ahead of the image's packages.
if [ -n "${GPU_WHEELS:-}" ]; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/gpu_site "$GPU_WHEELS"/*.whl || exit 3
    export PYTHONPATH="/tmp/gpu_site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout, not an installed copy
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}

{
    if command -v nvidia-smi >/dev/null; then nvidia-smi 2>&1; else echo "nvidia-smi: not found"; fi
    "$PYTHON" - <<'EOF' 2>&1
import importlib
for name in ("torch", "transformers", "peft", "vllm"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as exc:  # noqa: BLE001
        print(name, "absent:", exc)
import torch
print("cuda", torch.version.cuda, "available", torch.cuda.is_available())
EOF
} >"$OUT_DIR/environment.txt"

# First the `-m gpu` tests (CUDA graph replay equals the eager static passes; the CUDA
# attention kernel equals the matmuls), whose paths are the CUDA defaults; GPU_TESTS=0 skips.
if [ "${GPU_TESTS:-1}" != 0 ]; then
    timeout --kill-after=5 "${GPU_TESTS_LIMIT_S:-90}" "$PYTHON" -m pytest -q -p no:cacheprovider \
        -m gpu tests/unit/engine/test_decode_blocks.py tests/unit/model/test_attention_kernels.py \
        >"$OUT_DIR/gpu_tests.txt" 2>&1
    echo "gpu tests exit $? ($OUT_DIR/gpu_tests.txt): $(tail -n 1 "$OUT_DIR/gpu_tests.txt")"
fi

timeout --kill-after=10 "$LIMIT_S" "$PYTHON" bench/gpu_check.py --device cuda \
    --budget-s "$BUDGET_S" --json "$OUT_DIR/gpu_check.json" "$@" \
    2>"$OUT_DIR/gpu_check.stderr" | tee "$OUT_DIR/gpu_check.txt"
status=${PIPESTATUS[0]}
echo "gpu_check exit $status (124: cut at ${LIMIT_S} s); report in $OUT_DIR/gpu_check.json"
exit "$status"
