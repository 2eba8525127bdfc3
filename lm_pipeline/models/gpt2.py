"""GPT-2 (Radford et al. 2019), with Levanter's config keys.

Pre-norm transformer: learned token and position embeddings, LayerNorm, GELU MLP, tied LM head.

Parameter layout (L = num_layers, D = hidden_dim, N = num_heads, H = D // N, M = mlp_scale * D,
V = vocab, S = seq_len) and the matching Hugging Face ``GPT2LMHeadModel`` tensors (HF's Conv1D
stores ``[in, out]``; the fused ``c_attn`` concatenates q, k, v along its output dimension, each
flattened as ``n * H + h``)::

    token_embeddings             [V, D]        transformer.wte.weight   (also lm_head.weight: tied)
    position_embeddings          [S, D]        transformer.wpe.weight
    blocks.ln_1.weight/bias      [L, D]        transformer.h.{i}.ln_1.weight/bias
    blocks.attn.q_proj           [L, D, N, H]  transformer.h.{i}.attn.c_attn.weight[:, 0:D]
    blocks.attn.k_proj           [L, D, N, H]  transformer.h.{i}.attn.c_attn.weight[:, D:2D]
    blocks.attn.v_proj           [L, D, N, H]  transformer.h.{i}.attn.c_attn.weight[:, 2D:3D]
    blocks.attn.{q,k,v}_bias     [L, N, H]     transformer.h.{i}.attn.c_attn.bias (same split)
    blocks.attn.o_proj           [L, N, H, D]  transformer.h.{i}.attn.c_proj.weight  ([D, D])
    blocks.attn.o_bias           [L, D]        transformer.h.{i}.attn.c_proj.bias
    blocks.ln_2.weight/bias      [L, D]        transformer.h.{i}.ln_2.weight/bias
    blocks.mlp.up_proj/up_bias   [L, D, M]/[L, M]  transformer.h.{i}.mlp.c_fc.weight/bias
    blocks.mlp.down_proj/down_bias [L, M, D]/[L, D] transformer.h.{i}.mlp.c_proj.weight/bias
    ln_f.weight/bias             [D]           transformer.ln_f.weight/bias

With ``use_bias: false`` the linear and LayerNorm biases are absent (HF export writes zeros).
See :mod:`lm_pipeline.models.hf_mapping` for the conversion. The config, :class:`Gpt2Config`, is in the
light :mod:`lm_pipeline.models.config` (no JAX).

Packed rows: with segment ids, position embeddings restart at 0 at the start of each segment
(segments are contiguous runs), so a packed document sees exactly what it would see alone.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp

from lm_pipeline.compute import REFERENCE, ComputePlan
from lm_pipeline.models.base import LmModel
from lm_pipeline.models.layers import (
    F32,
    Attention,
    KVCache,
    LayerNorm,
    Mlp,
    PerLayer,
    decode_mask,
    dropout,
    logical_axes,
    normal,
    scan_blocks,
    segment_mask,
    segment_positions,
    stack_blocks,
)

if TYPE_CHECKING:  # the config module builds this model: no import back at run time
    from lm_pipeline.models.config import Gpt2Config


class Gpt2Block(eqx.Module):
    ln_1: LayerNorm
    attn: Attention
    ln_2: LayerNorm
    mlp: Mlp

    def __init__(self, cfg: Gpt2Config, *, key: jax.Array):
        k_attn, k_mlp = jax.random.split(key)
        std = cfg.initializer_range
        out_std = std / math.sqrt(2 * cfg.num_layers)
        d, n = cfg.hidden_dim, cfg.num_heads
        self.ln_1 = LayerNorm(d, cfg.layer_norm_epsilon, cfg.use_bias)
        self.attn = Attention(d, n, n, cfg.head_dim, use_bias=cfg.use_bias, std=std, out_std=out_std, key=k_attn)
        self.ln_2 = LayerNorm(d, cfg.layer_norm_epsilon, cfg.use_bias)
        self.mlp = Mlp(
            d, cfg.mlp_dim, activation=cfg.activation_function, gated=False, use_bias=cfg.use_bias,
            std=std, out_std=out_std, key=k_mlp,
        )

    def __call__(self, x, cfg: Gpt2Config, mask, layer_idx, key, kv, position, plan: ComputePlan):
        k_attn, k_res1, k_res2 = jax.random.split(key, 3) if key is not None else (None, None, None)
        scale: Any = 1.0 / math.sqrt(cfg.head_dim)
        if cfg.scale_attn_by_inverse_layer_idx:
            scale = scale / (layer_idx + 1).astype(F32)
        y, kv = self.attn(
            self.ln_1(x), mask, scale=scale, upcast=cfg.upcast_attn, kv=kv, position=position,
            dropout_rate=cfg.attn_pdrop if key is not None else 0.0, key=k_attn, plan=plan,
        )
        x = x + dropout(y, cfg.resid_pdrop, k_res1)
        x = x + dropout(self.mlp(self.ln_2(x), plan), cfg.resid_pdrop, k_res2)
        return x, kv


class Gpt2Model(LmModel):
    token_embeddings: jax.Array  # [V, D]
    position_embeddings: jax.Array  # [S, D]
    blocks: Gpt2Block  # stacked: every array has a leading [L] axis
    ln_f: LayerNorm
    config: Gpt2Config = eqx.field(static=True)
    AXES: ClassVar[dict[str, tuple]] = {
        "token_embeddings": ("vocab", "embed"),
        "position_embeddings": (None, "embed"),
    }

    def __init__(self, config: Gpt2Config, vocab_size: int, *, key: jax.Array):
        k_tok, k_pos, k_blocks = jax.random.split(key, 3)
        std = config.initializer_range
        self.token_embeddings = normal(k_tok, (vocab_size, config.hidden_dim), std)
        self.position_embeddings = normal(k_pos, (config.seq_len, config.hidden_dim), std)
        self.blocks = stack_blocks(lambda k: Gpt2Block(config, key=k), config.num_layers, k_blocks)
        self.ln_f = LayerNorm(config.hidden_dim, config.layer_norm_epsilon, config.use_bias)
        self.config = config

    def features(self, tokens, segment_ids=None, *, key=None, inference=True, plan: ComputePlan = REFERENCE):
        cfg = self.config
        t = tokens.shape[1]
        if t > cfg.seq_len:
            raise ValueError(f"sequence length {t} exceeds the model's seq_len {cfg.seq_len}")
        training = not inference and max(cfg.embed_pdrop, cfg.resid_pdrop, cfg.attn_pdrop) > 0
        if training and key is None:
            raise ValueError("dropout is enabled (inference=False): pass a PRNG key")
        k_emb, k_layers = jax.random.split(key) if training else (None, None)
        if segment_ids is None:
            positions, mask = jnp.arange(t)[None], None
        else:
            positions, mask = segment_positions(segment_ids), segment_mask(segment_ids)
        x = self.token_embeddings[tokens] + self.position_embeddings[positions]
        x = dropout(x, cfg.embed_pdrop, k_emb)
        layer_keys = jax.random.split(k_layers, cfg.num_layers) if training else None
        x, _ = self._trunk(x, mask, plan, keys=layer_keys)
        return self.output_head(x)

    def _trunk(self, x, mask, plan: ComputePlan, *, keys=None, cache: KVCache | None = None, position: Any = 0):
        cfg = self.config

        def apply(block, h, inputs):
            idx, key, kv = inputs
            return block(h, cfg, mask, idx, key, kv, position, plan)

        kv = None if cache is None else (cache.k, cache.v)
        xs = (jnp.arange(cfg.num_layers), keys, kv)
        return scan_blocks(apply, self.blocks, x, xs, checkpoint=cfg.gradient_checkpointing and cache is None, plan=plan)

    def output_head(self, x):
        return self.ln_f(x), self.token_embeddings

    def param_axes(self):
        return logical_axes(self)

    def init_cache(self, batch: int, max_len: int | None = None, dtype: Any = None) -> KVCache:
        cfg = self.config
        max_len = cfg.seq_len if max_len is None else max_len
        if max_len > cfg.seq_len:
            raise ValueError(f"max_len {max_len} exceeds the model's seq_len {cfg.seq_len}")
        dtype = self.token_embeddings.dtype if dtype is None else dtype
        return KVCache.zeros(cfg.num_layers, batch, max_len, cfg.num_heads, cfg.head_dim, dtype,
                            per_layer=isinstance(self.blocks, PerLayer))

    def decode(self, tokens, cache: KVCache, position, *, plan: ComputePlan = REFERENCE):
        """See :meth:`LmModel.decode`. Positions must stay below ``min(seq_len, cache.max_len)``
        (beyond, position embeddings and cache writes are clamped, not checked, inside jit)."""
        s = tokens.shape[1]
        pos_emb = jax.lax.dynamic_slice_in_dim(self.position_embeddings, position, s)
        x = self.token_embeddings[tokens] + pos_emb[None]
        x, (k, v) = self._trunk(x, decode_mask(position, s, cache.max_len), plan, cache=cache, position=position)
        return plan.lm_logits(*self.output_head(x)), KVCache(k, v)
