"""EAGLE (Li et al. 2024, 2025): a one-layer head drafts from the target's fused features (head.py), trained with
EAGLE-3's training-time test (train.py), drafting chains or EAGLE-2 dynamic trees (drafter.py)."""
