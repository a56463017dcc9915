"""Byte-level BPE tokenizer for the reference target, trained here with ``tokenizers``.

Special tokens: ``<s>`` (id 0, BOS), ``</s>`` (id 1, EOS), ``<pad>`` (id 2). A template
post-processor prepends ``<s>`` to every encoded text, so HF ``tokenizer(text)`` and SGLang's
tokenization of a text prompt give the same ids (``<s>`` + BPE ids).
"""
from __future__ import annotations

from pathlib import Path

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2


def train_tokenizer(texts: list[str], out_dir: Path, vocab_size: int = 4096):
    """Train a byte-level BPE on ``texts`` and save a ``PreTrainedTokenizerFast`` to ``out_dir``.

    Deterministic for the same input order (``tokenizers`` BPE training is single-pass and
    tie-broken lexicographically). Returns the fast tokenizer.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS, PAD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  min_frequency=2, show_progress=True)
    tok.train_from_iterator(texts, trainer, length=len(texts))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, BOS_ID)])
    assert tok.token_to_id(BOS) == BOS_ID and tok.token_to_id(EOS) == EOS_ID
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS,
                                   pad_token=PAD, model_max_length=512)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out_dir)
    return fast
