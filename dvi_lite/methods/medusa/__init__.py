"""Medusa (Cai et al. 2024): heads (the trained module), trees (candidate builders), drafter (the method),
train (distillation), tree_attention (+ tree_attention_check: the mask-free Triton kernel and its check)."""
