"""Activation memory of one micro-batch: the tensors autodiff saves for the backward pass,
traced rather than hand-counted, plus the backward pass's working buffers.

:func:`saved_activations` runs ``jax.vjp`` of the trainer's own loss (compute-dtype parameters
-> model -> :func:`~lm_pipeline.train.loss.next_token_loss_sums`, custom VJPs included) under
``jax.eval_shape`` for a 1-layer and a 2-layer copy of the model. The difference is one layer's
saved tensors (without checkpointing: norms, q/k/v, MLP intermediates, and the ``[B, N, T, T]``
attention scores/probabilities whenever the attention implementation materialises them; with
checkpointing: the block input ``[B, T, D]`` only); the rest (x 1) is what does not repeat per
layer: the embeddings, final norm and the logits / cross-entropy residuals ``[B, T, V]``. The
backward pass adds working buffers; two phases are modelled and the larger is the peak:

- *loss/head backward*: all saved tensors + ``HEAD_GRAD_BUFFERS`` x ``[B, T, V]`` f32 (the
  logits' cotangent, ``softmax - onehot``);
- *layer backward*: all saved tensors but the logits residuals + (with checkpointing) one
  layer's full saved set, recomputed + ``ATTN_BWD_FACTOR`` x that layer's ``[.., T, T]``
  attention tensors (their f32 cotangents).

With tensor parallelism, saved tensors with a heads / MLP / vocab dimension (recognised by
shape: 5+ dims, or a dimension equal to the MLP width or the vocabulary) are divided by
``model_axis_size``. The constants, the CPU's and the accelerators' differences and the
measurements they were fitted to are in ``docs/benchmarks.md`` (Estimator calibration).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import equinox as eqx
import jax
import jax.numpy as jnp

from lm_pipeline.compute import REFERENCE, ComputePlan, hints_from, plan_for
from lm_pipeline.estimate.parameters import abstract_model, is_array_like
from lm_pipeline.estimate.result import Activations

if TYPE_CHECKING:
    from lm_pipeline.models import LmConfig

# --- calibrated constants (docs/benchmarks.md, Estimator calibration) -------------------------

HEAD_GRAD_BUFFERS = 1.0
"""[B, T, V] f32 buffers of the loss/head backward on top of the saved logits residuals."""

ATTN_BWD_FACTOR = 0.5
"""Working set of one layer's attention backward (the f32 score / probability cotangents), as
a multiple of that layer's saved [.., T, T] attention tensors."""

CPU_ACTIVATION_BYTES = 4
"""Bytes per element of sub-f32 saved tensors on XLA:CPU, which performs bf16 elementwise work
in f32 (``docs/benchmarks.md``, Estimator calibration)."""

ACCELERATOR_SAVED_FACTOR = 0.47
"""On GPU/TPU, the share of the layers' traced saved tensors (without checkpointing) that XLA
keeps: its fusions recompute cheap elementwise results in the backward pass instead of storing
them (fitted on an H100, ``docs/benchmarks.md``, Estimator calibration)."""


@functools.lru_cache(maxsize=256)
def saved_activations(
    model_cfg, vocab_size: int, batch: int, compute_dtype: str, segments: bool, plan: ComputePlan = REFERENCE
) -> tuple[jax.ShapeDtypeStruct, ...]:
    """Shapes of the tensors ``jax.vjp`` of the loss (from the logits) saves for the backward pass
    (``batch`` sequences, the model computing as ``plan`` says, its remat policy included),
    excluding the (compute-dtype) parameters themselves."""
    from lm_pipeline.train.loss import next_token_loss_sums

    abstract = abstract_model(model_cfg, vocab_size)
    params, static = eqx.partition(abstract, is_array_like)
    compute = jnp.dtype(compute_dtype)

    def cast(x):
        return jax.ShapeDtypeStruct(x.shape, compute) if jnp.issubdtype(x.dtype, jnp.floating) else x

    params_c = jax.tree.map(cast, params)
    dropout_active = any(getattr(model_cfg, n, 0.0) > 0 for n in ("embed_pdrop", "resid_pdrop", "attn_pdrop"))
    tokens = jax.ShapeDtypeStruct((batch, model_cfg.seq_len), jnp.int32)
    seg = tokens if segments else None

    def residuals(p, tokens, seg, key_data):
        key = jax.random.wrap_key_data(key_data) if dropout_active else None

        def loss(p):
            model = eqx.combine(p, static)
            logits = model(tokens, seg, key=key, inference=not dropout_active, plan=plan)
            return next_token_loss_sums(logits, tokens, seg)[0]

        _, vjp_fn = jax.vjp(loss, p)
        inputs = {id(x) for x in jax.tree.leaves(p)}
        return [x for x in jax.tree.leaves(vjp_fn) if id(x) not in inputs and hasattr(x, "shape")]

    out = jax.eval_shape(residuals, params_c, tokens, seg, jax.ShapeDtypeStruct((2,), jnp.uint32))
    return tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in out)


@dataclass(frozen=True)
class _Saved:
    total: int
    attention: int
    logits: int


def _classify(
    res, *, seq_len: int, vocab: int, mlp_dims: tuple[int, ...], model_size: int, act_bytes: int | None,
    upcast_only_attention: bool = False, num_heads: int = 0,
) -> _Saved:
    """Bytes of saved tensors: all, the [.., T, T] attention ones and those with a vocab dim."""
    total = attention = logits = 0
    for x in res:
        # [.., T, T] attention tensors: [L, B, K, G, T, T] / [B, K, G, T, T] / [B, 1, T, T] masks /
        # [B, N, T, T] scores (dims >= 5, a 4-d boolean, or 4-d with N heads: a 4-d float
        # [L, B, T, D] may have D == T).
        ndim = len(x.shape)
        is_attn = ndim >= 4 and tuple(x.shape[-2:]) == (seq_len, seq_len) and (
            ndim >= 5 or x.dtype == jnp.bool_ or x.shape[-3] == num_heads)
        is_logit = ndim >= 2 and x.shape[-1] == vocab and not is_attn
        itemsize = x.dtype.itemsize  # also defined for PRNG key dtypes (dropout keys)
        upcast = act_bytes is not None and not is_logit and (is_attn or not upcast_only_attention)
        if upcast and jnp.issubdtype(x.dtype, jnp.floating) and itemsize < act_bytes:
            itemsize = act_bytes  # XLA:CPU upcasts elementwise work; the LM head's dot output stays bf16
        n = math.prod(x.shape) * itemsize
        if model_size > 1 and (ndim >= 5 or is_logit or any(d in mlp_dims for d in x.shape)):
            n = -(-n // model_size)
        total += n
        attention += n if is_attn else 0
        logits += n if is_logit else 0
    return _Saved(total, attention, logits)


def activations(model_cfg: LmConfig, vocab: int, batch: int, compute_dtype: str, segments: bool, *,
                remat: bool, model_size: int, platform: str) -> Activations:
    """Activation bytes per device of one micro-batch of ``batch`` sequences, with gradient
    checkpointing ``remat``, on ``platform`` (``cpu``, ``gpu``, ``tpu``) with tensor parallelism
    over ``model_size`` devices: traced for 1 and 2 layers, extrapolated to all."""
    from lm_pipeline.kernels.cpu.blocked_attention import num_query_blocks

    cfg = dataclasses.replace(model_cfg, gradient_checkpointing=remat)
    plan = plan_for(platform, compute_dtype, num_devices=1, hints=hints_from(model_cfg))
    layers = model_cfg.num_layers
    mlp = tuple(d for d in (getattr(model_cfg, "mlp_dim", None), getattr(model_cfg, "intermediate_dim", None)) if d)
    on_cpu = platform == "cpu"
    classify = functools.partial(
        _classify, seq_len=model_cfg.seq_len, vocab=vocab, mlp_dims=mlp, model_size=model_size,
        act_bytes=CPU_ACTIVATION_BYTES if on_cpu else None, num_heads=getattr(model_cfg, "num_heads", 0),
    )
    # On XLA:CPU, bf16 tensors saved into a scan's stacked buffers go through f32; those of an
    # unrolled stack (``scan_blocks`` unrolls short low-precision stacks without checkpointing)
    # or recomputed inside one layer stay bf16, except attention's -- as long as attention
    # takes the native kernel (its f32 inputs and residuals are counted as they are) or XLA's
    # path (one query block); with the blocked attention they measured f32 too.
    unrolled = (on_cpu and not remat and plan.remat_policy() is None and plan.unroll(layers)
                and (plan.attention == "cpu_native" or num_query_blocks(model_cfg.seq_len, plan.attention_block or None) == 1))

    def saved(num_layers: int, remat_: bool, only_attention: bool, p: ComputePlan) -> _Saved:
        c = dataclasses.replace(cfg, num_layers=num_layers, gradient_checkpointing=remat_)
        return classify(saved_activations(c, vocab, batch, compute_dtype, segments, p), upcast_only_attention=only_attention)

    one, two = saved(1, remat, unrolled, plan), saved(2, remat, unrolled, plan)
    per_layer = _Saved(two.total - one.total, two.attention - one.attention, two.logits - one.logits)
    all_layers = _Saved(*(a + (layers - 1) * d for a, d in zip(dataclasses.astuple(one), dataclasses.astuple(per_layer), strict=True)))
    # The logits' cotangent is computed in f32 (softmax - onehot), then cast; on accelerators
    # that computation is fused into the cast, so one compute-dtype buffer.
    logits_grad = batch * model_cfg.seq_len * vocab * (4 if on_cpu else jnp.dtype(compute_dtype).itemsize)
    logits_grad //= model_size if model_size > 1 and vocab % model_size == 0 else 1
    if not on_cpu:
        return _accelerator_activations(all_layers, per_layer, logits_grad, remat=remat)
    # Without checkpointing a CPU f32 step keeps only matmul and attention outputs per layer.
    dots = not remat and plan.remat_policy() is not None
    # One layer's full saved set (what a checkpointed layer recomputes in its backward pass).
    if remat or dots:
        plain = dataclasses.replace(plan, remat="none")
        one_nr, two_nr = (dataclasses.astuple(saved(n, False, True, plain)) for n in (1, 2))
        full = _Saved(*(b - a for a, b in zip(one_nr, two_nr, strict=True)))
    else:
        full = per_layer
    # Layer backward: everything saved but the logits residuals, the recomputed layer (with
    # checkpointing), and the attention backward's working set.
    # (under the dots policy a layer recomputes only what lies between its saved matmul outputs)
    recomputed = full.total if remat else max(0, full.total - per_layer.total) if dots else 0
    return Activations(
        saved=all_layers.total, saved_per_layer=per_layer.total, attention=all_layers.attention,
        logits=all_layers.logits, head_backward=all_layers.total + int(HEAD_GRAD_BUFFERS * logits_grad),
        layer_backward=all_layers.total - all_layers.logits + recomputed + int(ATTN_BWD_FACTOR * full.attention),
    )


def _accelerator_activations(saved: _Saved, per_layer: _Saved, logits_grad: int, *, remat: bool) -> Activations:
    """On GPU/TPU the head's cotangent is the peak; layers' backward buffers come and go within it."""
    total, per_layer_total = saved.total, per_layer.total
    if not remat:  # XLA's fusions keep about half of what autodiff saves per layer
        total = int(ACCELERATOR_SAVED_FACTOR * (saved.total - saved.logits)) + saved.logits
        per_layer_total = int(ACCELERATOR_SAVED_FACTOR * per_layer.total)
    return Activations(
        saved=total, saved_per_layer=per_layer_total, attention=saved.attention, logits=saved.logits,
        head_backward=total + logits_grad, layer_backward=total - saved.logits,
    )
