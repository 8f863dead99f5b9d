#!/usr/bin/env bash
# Run HERE (not on the GPU machine) before a GPU session: downloads into .whl/ the wheels that
# the device image lacks or holds in another version (its python3 is 3.12 with torch, peft
# and transformers of its own; nothing can be fetched there). `GPU_WHEELS=.whl
# bench/gpu_run.sh` installs them there: name .whl in the device call's `carry`. Measured on
# 2026-12-04: 29 MB, the image's torch 2.11.0+cu130 kept.
#
#   bench/gpu_wheels.sh && echo /.whl/ >> "$(git rev-parse --git-common-dir)/info/exclude"
set -euo pipefail
cd "$(dirname "$0")/.."
# The versions this checkout is tested with (pyproject.toml; transformers >= 5.24 for the
# model code, its own needs after it), each pinned: two versions of one stop the install.
WHEELS=(
    transformers==5.25.0 huggingface_hub==2.4.0 tokenizers==0.23.3 kernels==0.19.1
    peft==0.21.2 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0
    typing-inspection==0.4.5 typing_extensions==4.16.0 httpx2==2.16.2 httpcore2==2.16.2
    h2==4.4.1 hpack==4.2.0 hyperframe==6.1.0 click==8.5.1 hf-xet==1.8.0 regex==2026.11.19
    truststore==0.10.5 tomlkit==0.15.3 anyio==4.16.0 idna==3.20
)
PLATFORMS=()
for p in manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014 manylinux1; do
    PLATFORMS+=(--platform "${p}_x86_64")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${PLATFORMS[@]}" -d .whl "${WHEELS[@]}"
du -sh .whl
