"""The projections' CPU matmul (explicitly transposed weight gradient), the LM head (with its
accelerator vocabulary padding) and the per-backend choices of attention kernel and layer
unrolling, against plain autodiff and the rules they document."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lm_pipeline.models import layers
from lm_pipeline.models.layers import DENSE_OUT, dense, lm_logits, matmuls_and_attention_saveable


def _arrays(*shapes, seed=0):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.standard_normal(s, np.float32)) for s in shapes]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_dense_values_and_gradients_equal_the_einsum(dtype):
    x, w, c = _arrays((2, 24, 16), (16, 40), (2, 24, 40))
    x, w = x.astype(dtype), w.astype(dtype)

    def loss(f):
        return jax.jit(jax.value_and_grad(lambda x, w: jnp.sum(f(x, w).astype(jnp.float32) * c), argnums=(0, 1)))(x, w)

    (l_new, (dx_new, dw_new)) = loss(dense)
    (l_ref, (dx_ref, dw_ref)) = loss(lambda x, w: jnp.einsum("btk,kn->btn", x, w))
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    assert dx_new.dtype == dtype and dw_new.dtype == dtype
    np.testing.assert_allclose(l_new, l_ref, rtol=tol)
    for a, b in ((dx_new, dx_ref), (dw_new, dw_ref)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_allclose(a, b, atol=tol * np.abs(b).max(), rtol=0)


@pytest.mark.parametrize("pad", [0, 14], ids=["unpadded", "vocab_padded"])
def test_lm_head_values_and_gradients_equal_autodiff(pad):
    """``pad`` zero rows (the accelerators' vocabulary padding: 50 -> 64 here) change nothing:
    same logits shape and values, same gradients, the weight gradient in its unpadded shape."""
    x, w, c = _arrays((2, 8, 16), (50, 16), (2, 8, 50))

    def f(x, w):
        return layers._padded_lm_logits(x, w, pad)

    np.testing.assert_allclose(f(x, w), jnp.einsum("btd,vd->btv", x, w), rtol=1e-5, atol=1e-5)
    got = jax.jit(jax.grad(lambda x, w: jnp.sum(f(x, w) * c), argnums=(0, 1)))(x, w)
    ref = jax.grad(lambda x, w: jnp.sum(jnp.einsum("btd,vd->btv", x, w) * c), argnums=(0, 1))(x, w)
    assert got[1].shape == w.shape
    for a, b in zip(got, ref, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5 * float(jnp.max(jnp.abs(b))), rtol=0)
    if pad == 0:  # the public entry point is the unpadded product on this (CPU) backend
        np.testing.assert_array_equal(lm_logits(x, w), f(x, w))


def test_attention_kernel_choice_per_backend_and_dtype():
    """cuDNN's flash attention only on a GPU, in bf16/f16, with a head size it covers; the
    context and ``$LM_PIPELINE_ATTENTION`` override ``auto``; a bad name is refused."""
    bf16 = jnp.zeros((2, 128, 4, 64), jnp.bfloat16)
    assert layers._use_cudnn(bf16, bf16, "gpu")
    assert not layers._use_cudnn(bf16, bf16, "cpu")
    assert not layers._use_cudnn(bf16.astype(jnp.float32), bf16, "gpu")
    odd_head = jnp.zeros((2, 128, 4, 60), jnp.bfloat16)
    assert not layers._use_cudnn(odd_head, odd_head, "gpu")
    with layers.attention_implementation("xla"):
        assert not layers._use_cudnn(bf16, bf16, "gpu")
    with layers.attention_implementation("cudnn"):
        assert layers._use_cudnn(odd_head, odd_head, "gpu")
    with pytest.raises(ValueError, match="auto"):
        with layers.attention_implementation("flash"):
            pass


def test_attention_env_override(monkeypatch):
    bf16 = jnp.zeros((2, 128, 4, 64), jnp.bfloat16)
    monkeypatch.setenv(layers.ATTENTION_ENV, "xla")
    assert not layers._use_cudnn(bf16, bf16, "gpu")
    monkeypatch.setenv(layers.ATTENTION_ENV, "bogus")
    with pytest.raises(ValueError, match=layers.ATTENTION_ENV):
        layers._use_cudnn(bf16, bf16, "gpu")


def test_layer_stack_unrolling_rule():
    """CPU: only short low-precision stacks; accelerators: any stack up to the limit."""
    assert layers._unroll_plain_stack("cpu", jnp.bfloat16, 4)
    assert not layers._unroll_plain_stack("cpu", jnp.float32, 4)
    assert not layers._unroll_plain_stack("cpu", jnp.bfloat16, layers.UNROLL_MAX_LAYERS + 1)
    assert layers._unroll_plain_stack("gpu", jnp.float32, 24)
    assert not layers._unroll_plain_stack("gpu", jnp.bfloat16, layers.ACCELERATOR_UNROLL_MAX_LAYERS + 1)


def test_remat_policy_saves_dense_outputs(capsys):
    """The CPU matmul is a custom VJP, not a dot_general, so only its name keeps its output
    from being recomputed under the trainer's policy."""
    x, w1, w2 = _arrays((2, 8, 16), (16, 32), (32, 16))

    def layer(x, w1, w2):
        return jnp.sum(dense(jnp.tanh(dense(x, w1)), w2))

    def saved(policy):
        capsys.readouterr()
        jax.ad_checkpoint.print_saved_residuals(jax.checkpoint(layer, policy=policy), x, w1, w2)
        return capsys.readouterr().out

    assert DENSE_OUT in saved(matmuls_and_attention_saveable())
    assert DENSE_OUT not in saved(jax.checkpoint_policies.dots_saveable)
