"""The course tokenizer: byte-level BPE trained with the `tokenizers` library, saved as an HF tokenizer.

Byte-level means every string round-trips exactly (code indentation included), which the lossless
tests rely on: text in, ids out, the same text back.
"""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from dvi_lite.models.corpus import load_docs

EOS = "<|endoftext|>"


def train_tokenizer(vocab_size: int = 8192, out_dir: Path | None = None) -> PreTrainedTokenizerFast:
    """Train on the train split of both domains; save to out_dir (HF format) if given."""
    if vocab_size < 260:
        raise ValueError(f"vocab_size must be >= 260 (256 bytes + specials), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    tok.train_from_iterator((d.text for d in load_docs("train")), trainer=trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=EOS)
    hf.model_max_length = 512
    if out_dir is not None:
        hf.save_pretrained(str(out_dir))
    return hf
