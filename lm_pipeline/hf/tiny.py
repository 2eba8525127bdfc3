"""A tiny random Hugging Face model directory to try continued pretraining on (needs ``torch``
and ``transformers``)::

    python -m lm_pipeline.hf.tiny --family llama --out hf/tiny-llama

Writes what ``save_pretrained`` writes (``config.json``, ``model.safetensors``) plus a byte-level
BPE tokenizer trained on a few sentences (``tokenizer.json``, ``tokenizer_config.json``), with
the model's vocabulary equal to the tokenizer's. The Llama has grouped-query attention, an untied
LM head and rope_theta 5e5; the GPT-2's MLP width (n_inner) is no multiple of its width.
"""

from __future__ import annotations

import argparse
import json
import os

__all__ = ["make_tiny_hf_model"]

_TEXT = ("The quick brown fox jumps over the lazy dog. def main(): return 0\n"
         "import os, sys\nclass Model: pass\nfor i in range(10): print(i)\n")


def make_tiny_hf_model(out: str, family: str = "llama", *, seq_len: int = 64, vocab_size: int = 512,
                       seed: int = 0) -> str:
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    eos = "<|endoftext|>"
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([_TEXT] * 4, trainer=trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[eos], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    os.makedirs(out, exist_ok=True)
    tok.save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": eos, "bos_token": eos, "pad_token": eos}, f)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    torch.manual_seed(seed)
    if family == "llama":
        cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                                       num_attention_heads=6, num_key_value_heads=3, head_dim=16, rope_theta=5e5,
                                       tie_word_embeddings=False, max_position_embeddings=seq_len,
                                       eos_token_id=tok.token_to_id(eos), bos_token_id=tok.token_to_id(eos))
        model = transformers.LlamaForCausalLM(cfg)
    elif family == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=vocab, n_embd=64, n_inner=96, n_layer=2, n_head=4, n_positions=seq_len,
                                      eos_token_id=tok.token_to_id(eos), bos_token_id=tok.token_to_id(eos))
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        raise ValueError(f"family must be 'llama' or 'gpt2', got {family!r}")
    model.save_pretrained(out)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", choices=("llama", "gpt2"), default="llama")
    p.add_argument("--out", required=True)
    p.add_argument("--seq_len", type=int, default=64)
    args = p.parse_args()
    print(make_tiny_hf_model(args.out, args.family, seq_len=args.seq_len))


if __name__ == "__main__":
    main()
