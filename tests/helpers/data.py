"""Test helpers for the data path: a tiny tokenizer and sample texts."""

from __future__ import annotations

import json
import os
import random

EOS = "<|endoftext|>"


def sample_texts(n: int, seed: int = 0) -> list[str]:
    """``n`` short, varied documents: ASCII, accented and non-Latin text, empty ones, long ones."""
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "naïve", "café", "日本語", "данные", "🙂", "x", "foo_bar", "42"]
    out = []
    for i in range(n):
        k = rng.choice([0, 1, 3, 8, 20, 60, 150]) if i % 13 else 0
        out.append(" ".join(rng.choice(words) for _ in range(k)) + ("\n" if i % 5 == 0 else ""))
    return out


def tiny_tokenizer(out_dir: str, *, vocab_size: int = 300, post: str | None = None,
                   texts: list[str] | None = None) -> str:
    """Train a byte-level BPE on ``texts`` (default: :func:`sample_texts`) and save it to ``out_dir``.

    post: None (no post-processor), ``"bos"`` (prepend EOS-as-BOS on every encoding) or ``"eos"``
    (append EOS on every encoding). Another ``vocab_size`` gives another tokenizer fingerprint.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts or sample_texts(200), trainer=trainer)
    eos_id = tok.token_to_id(EOS)
    if post == "bos":
        tok.post_processor = processors.TemplateProcessing(single=f"{EOS} $A", special_tokens=[(EOS, eos_id)])
    elif post == "eos":
        tok.post_processor = processors.TemplateProcessing(single=f"$A {EOS}", special_tokens=[(EOS, eos_id)])
    elif post is not None:
        raise ValueError(f"post must be None, 'bos' or 'eos', got {post!r}")
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": EOS, "bos_token": EOS, "pad_token": EOS}, f)
    return out_dir
