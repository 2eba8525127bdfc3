"""The CPU attention path (query blocks, flash-style backward) against jax.nn.dot_product_attention."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lm_pipeline.compute import plan_for
from lm_pipeline.kernels.cpu.blocked_attention import (
    ATTENTION_RESIDUALS,
    blocked_causal_attention,
    num_query_blocks,
)
from lm_pipeline.kernels.cpu.matmul import matmuls_and_attention_saveable
from lm_pipeline.models.layers import attention, segment_mask


def _inputs(b, t, n, kh, h, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, t, n, h), np.float32)
    k, v = rng.standard_normal((2, b, t, kh, h), np.float32)
    w = rng.standard_normal((b, t, n, h), np.float32)  # cotangent weights
    return map(jnp.asarray, (q, k, v, w))


def _value_and_grads(fn, q, k, v, w):
    return jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(fn(q, k, v) * w), argnums=(0, 1, 2)))(q, k, v)


@pytest.mark.parametrize(
    ("t", "n", "kh", "segments"),
    [
        (256, 4, 4, False),  # 4 even blocks
        (200, 4, 2, True),  # 3 blocks, the last one short; GQA; packed documents
        (130, 4, 1, True),  # 2 blocks; multi-query
        (48, 2, 2, False),  # one block: no splitting
    ],
)
def test_values_and_gradients_match_dot_product_attention(t, n, kh, segments):
    q, k, v, w = _inputs(2, t, n, kh, 16)
    mask = None
    if segments:
        ids = np.sort(np.random.default_rng(1).integers(0, 4, (2, t)), axis=1)  # 0 = padding at the front
        mask = segment_mask(jnp.asarray(ids))
    ref = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=mask is None, scale=0.3)  # noqa: E731
    new = lambda q, k, v: blocked_causal_attention(q, k, v, mask, 0.3)  # noqa: E731
    assert num_query_blocks(t) == max(1, min(8, t // 64))
    np.testing.assert_allclose(jax.jit(new)(q, k, v), jax.jit(ref)(q, k, v), atol=2e-5, rtol=1e-5)
    (l_ref, g_ref), (l_new, g_new) = _value_and_grads(ref, q, k, v, w), _value_and_grads(new, q, k, v, w)
    np.testing.assert_allclose(l_new, l_ref, rtol=1e-5)
    for a, b in zip(g_new, g_ref, strict=True):
        np.testing.assert_allclose(a, b, atol=2e-5 * float(jnp.max(jnp.abs(b))), rtol=0)


def test_traced_scale_gets_no_gradient_and_matches():
    q, k, v, w = _inputs(1, 128, 2, 2, 8)

    def loss(scale, fn):
        return jnp.sum(fn(q, k, v, scale) * w)

    ref = lambda q, k, v, s: jax.nn.dot_product_attention(q, k, v, is_causal=True, scale=s)  # noqa: E731
    for s in (0.25, 0.5):
        got = jax.jit(lambda s: loss(s, blocked_causal_attention_mask_none))(jnp.float32(s))
        np.testing.assert_allclose(got, loss(s, ref), rtol=1e-5)
    assert float(jax.grad(lambda s: loss(s, blocked_causal_attention_mask_none))(jnp.float32(0.3))) == 0.0


def blocked_causal_attention_mask_none(q, k, v, scale):
    return blocked_causal_attention(q, k, v, None, scale)


def test_a_blocked_plan_routes_causal_self_attention_to_the_blocked_path():
    q, k, v, _ = _inputs(1, 128, 2, 2, 8)
    plan = plan_for("cpu", jnp.float32, attention="blocked")
    jaxpr = str(jax.make_jaxpr(lambda q, k, v: attention(q, k, v, None, scale=0.3, plan=plan))(q, k, v))
    assert "custom_vjp_call" in jaxpr
    # Decoding against a KV cache (queries != keys) keeps jax.nn.dot_product_attention.
    jaxpr = str(jax.make_jaxpr(lambda q, k, v: attention(q[:, :1], k, v, None, scale=0.3, plan=plan))(q, k, v))
    assert "custom_vjp_call" not in jaxpr
    # So does the reference plan, whatever the backend.
    jaxpr = str(jax.make_jaxpr(lambda q, k, v: attention(q, k, v, None, scale=0.3))(q, k, v))
    assert "custom_vjp_call" not in jaxpr


def test_remat_policy_keeps_the_attention_residuals(capsys):
    """Under the trainer's CPU f32 policy the attention's output and log-sum-exp are saved, so
    its forward pass is not run again in the backward pass."""
    q, k, v, w = _inputs(1, 128, 2, 2, 8)

    def layer(q, k, v):
        return jnp.sum(blocked_causal_attention(q, k, v, None, 0.3) * w)

    def saved(policy):
        capsys.readouterr()
        jax.ad_checkpoint.print_saved_residuals(jax.checkpoint(layer, policy=policy), q, k, v)
        return capsys.readouterr().out.splitlines()

    with_names = saved(matmuls_and_attention_saveable())
    without = saved(jax.checkpoint_policies.dots_saveable)
    for name in ATTENTION_RESIDUALS:
        assert any(name in r for r in with_names), with_names
        assert not any(name in r for r in without)
