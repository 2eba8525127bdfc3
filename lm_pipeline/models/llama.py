"""Llama (Touvron et al. 2023), with Levanter's config keys; numerically HF ``LlamaForCausalLM``.

Pre-norm transformer: RMSNorm, rotary position embeddings (HF ``rotate_half`` convention: the
head dimension's two halves are the rotation pairs), grouped-query attention, SwiGLU MLP,
untied LM head by default.

Parameter layout (L = num_layers, D = hidden_dim, N = num_heads, K = num_kv_heads,
H = head_dim, I = intermediate_dim, V = vocab) and the matching Hugging Face tensors (HF's
``nn.Linear`` stores ``[out, in]``; its head outputs are flattened as ``n * H + h``)::

    token_embeddings                 [V, D]        model.embed_tokens.weight
    blocks.input_layernorm.weight    [L, D]        model.layers.{i}.input_layernorm.weight
    blocks.self_attn.q_proj          [L, D, N, H]  model.layers.{i}.self_attn.q_proj.weight  [N*H, D]
    blocks.self_attn.k_proj          [L, D, K, H]  model.layers.{i}.self_attn.k_proj.weight  [K*H, D]
    blocks.self_attn.v_proj          [L, D, K, H]  model.layers.{i}.self_attn.v_proj.weight  [K*H, D]
    blocks.self_attn.o_proj          [L, N, H, D]  model.layers.{i}.self_attn.o_proj.weight  [D, N*H]
    blocks.self_attn.{q,k,v,o}_bias                model.layers.{i}.self_attn.{q,k,v,o}_proj.bias
                                                   (use_bias; HF attention_bias)
    blocks.post_attention_layernorm.weight [L, D]  model.layers.{i}.post_attention_layernorm.weight
    blocks.mlp.gate_proj             [L, D, I]     model.layers.{i}.mlp.gate_proj.weight     [I, D]
    blocks.mlp.up_proj               [L, D, I]     model.layers.{i}.mlp.up_proj.weight       [I, D]
    blocks.mlp.down_proj             [L, I, D]     model.layers.{i}.mlp.down_proj.weight     [D, I]
    blocks.mlp.{gate,up,down}_bias                 model.layers.{i}.mlp.*.bias (use_bias; HF mlp_bias)
    norm.weight                      [D]           model.norm.weight
    lm_head                          [V, D]        lm_head.weight  (None when tie_word_embeddings)

See :mod:`lm_pipeline.models.hf_mapping` for the conversion. The config, :class:`LlamaConfig`, is in the
light :mod:`lm_pipeline.models.config` (no JAX).

Packed rows: with segment ids, rotary positions restart at 0 at the start of each segment.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp

from lm_pipeline.compute import REFERENCE, ComputePlan
from lm_pipeline.models.base import LmModel
from lm_pipeline.models.layers import (
    Attention,
    KVCache,
    Mlp,
    PerLayer,
    RmsNorm,
    decode_mask,
    logical_axes,
    normal,
    rotary_cos_sin,
    scan_blocks,
    segment_mask,
    segment_positions,
    stack_blocks,
)

if TYPE_CHECKING:  # the config module builds this model: no import back at run time
    from lm_pipeline.models.config import LlamaConfig


class LlamaBlock(eqx.Module):
    input_layernorm: RmsNorm
    self_attn: Attention
    post_attention_layernorm: RmsNorm
    mlp: Mlp

    def __init__(self, cfg: LlamaConfig, *, key: jax.Array):
        k_attn, k_mlp = jax.random.split(key)
        std = cfg.initializer_range
        d = cfg.hidden_dim
        self.input_layernorm = RmsNorm(d, cfg.layer_norm_epsilon, cfg.use_layer_norm_weight)
        self.self_attn = Attention(
            d, cfg.num_heads, cfg.num_kv_heads, cfg.head_size, use_bias=cfg.use_bias, std=std, out_std=std, key=k_attn
        )
        self.post_attention_layernorm = RmsNorm(d, cfg.layer_norm_epsilon, cfg.use_layer_norm_weight)
        self.mlp = Mlp(
            d, cfg.intermediate_dim, activation=cfg.activation_function, gated=True, use_bias=cfg.use_bias,
            std=std, out_std=std, key=k_mlp,
        )

    def __call__(self, x, cfg: LlamaConfig, mask, rope, kv, position, plan: ComputePlan):
        y, kv = self.self_attn(
            self.input_layernorm(x), mask, scale=cfg.head_size**-0.5, upcast=cfg.upcast_attn,
            rope=rope, kv=kv, position=position, plan=plan,
        )
        x = x + y
        x = x + self.mlp(self.post_attention_layernorm(x), plan)
        return x, kv


class LlamaModel(LmModel):
    token_embeddings: jax.Array  # [V, D]
    blocks: LlamaBlock  # stacked: every array has a leading [L] axis
    norm: RmsNorm
    lm_head: jax.Array | None  # [V, D]; None when tied to token_embeddings
    config: LlamaConfig = eqx.field(static=True)
    AXES: ClassVar[dict[str, tuple]] = {
        "token_embeddings": ("vocab", "embed"),
        "lm_head": ("vocab", "embed"),
    }

    def __init__(self, config: LlamaConfig, vocab_size: int, *, key: jax.Array):
        k_tok, k_blocks, k_head = jax.random.split(key, 3)
        std, d = config.initializer_range, config.hidden_dim
        self.token_embeddings = normal(k_tok, (vocab_size, d), std)
        self.blocks = stack_blocks(lambda k: LlamaBlock(config, key=k), config.num_layers, k_blocks)
        self.norm = RmsNorm(d, config.layer_norm_epsilon, config.use_layer_norm_weight)
        self.lm_head = None if config.tie_word_embeddings else normal(k_head, (vocab_size, d), std)
        self.config = config

    def features(self, tokens, segment_ids=None, *, key=None, inference=True, plan: ComputePlan = REFERENCE):
        del key, inference  # Llama has no dropout
        t = tokens.shape[1]
        if segment_ids is None:
            positions, mask = jnp.arange(t)[None], None
        else:
            positions, mask = segment_positions(segment_ids), segment_mask(segment_ids)
        x, _ = self._trunk(self.token_embeddings[tokens], mask, positions, plan)
        return self.output_head(x)

    def _trunk(self, x, mask, positions, plan: ComputePlan, *, cache: KVCache | None = None, position: Any = 0):
        cfg = self.config
        rope = rotary_cos_sin(positions, cfg.head_size, cfg.rope_theta, cfg.rope_scaling)

        def apply(block, h, kv):
            return block(h, cfg, mask, rope, kv, position, plan)

        kv = None if cache is None else (cache.k, cache.v)
        return scan_blocks(apply, self.blocks, x, kv, checkpoint=cfg.gradient_checkpointing and cache is None, plan=plan)

    def output_head(self, x):
        return self.norm(x), self.token_embeddings if self.lm_head is None else self.lm_head

    def param_axes(self):
        return logical_axes(self)

    def init_cache(self, batch: int, max_len: int | None = None, dtype: Any = None) -> KVCache:
        cfg = self.config
        max_len = cfg.seq_len if max_len is None else max_len
        dtype = self.token_embeddings.dtype if dtype is None else dtype
        return KVCache.zeros(cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_size, dtype,
                            per_layer=isinstance(self.blocks, PerLayer))

    def decode(self, tokens, cache: KVCache, position, *, plan: ComputePlan = REFERENCE):
        """See :meth:`LmModel.decode`. Positions must stay below ``cache.max_len`` (cache writes
        past the end are clamped, not checked, inside jit)."""
        s = tokens.shape[1]
        positions = (position + jnp.arange(s))[None]
        mask = decode_mask(position, s, cache.max_len)
        x, (k, v) = self._trunk(self.token_embeddings[tokens], mask, positions, plan, cache=cache, position=position)
        return plan.lm_logits(*self.output_head(x)), KVCache(k, v)
