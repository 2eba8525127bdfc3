"""The projections' CPU matmul (explicitly transposed weight gradient) against plain autodiff."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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


def test_lm_head_gradient_equals_autodiff():
    x, w, c = _arrays((2, 8, 16), (50, 16), (2, 8, 50))
    got = jax.grad(lambda x, w: jnp.sum(lm_logits(x, w) * c), argnums=(0, 1))(x, w)
    ref = jax.grad(lambda x, w: jnp.sum(jnp.einsum("btd,vd->btv", x, w) * c), argnums=(0, 1))(x, w)
    for a, b in zip(got, ref, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5 * float(jnp.max(jnp.abs(b))), rtol=0)


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
