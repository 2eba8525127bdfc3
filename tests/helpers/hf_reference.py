"""References for models loaded from Hugging Face directories: ``transformers``' own loss and
logits, and our model's mean next-token loss computed in float64 NumPy from its logits."""

from __future__ import annotations

import jax
import numpy as np


def torch_loss_and_logits(hf_dir: str, tokens: np.ndarray) -> tuple[float, np.ndarray]:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        x = torch.tensor(np.asarray(tokens, np.int64))
        out = model(x, labels=x)
    return float(out.loss), out.logits.numpy()


def our_loss(model, tokens: np.ndarray) -> tuple[float, np.ndarray]:
    logits = np.asarray(jax.jit(lambda m, x: m(x))(model, np.asarray(tokens, np.int32)), np.float64)
    z = logits[:, :-1]
    lse = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)) + z.max(-1, keepdims=True)
    nll = -np.take_along_axis(z - lse, np.asarray(tokens)[:, 1:, None], -1)
    return float(nll.mean()), logits
