"""The native CPU attention kernel (XLA FFI, built at first use) against jax.nn.dot_product_attention."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_blocked_attention import _inputs, _value_and_grads  # same random q/k/v and cotangent weights

from lm_pipeline.compute import plan_for
from lm_pipeline.kernels.cpu import native_attention
from lm_pipeline.kernels.cpu.blocked_attention import ATTENTION_RESIDUALS
from lm_pipeline.kernels.cpu.matmul import matmuls_and_attention_saveable
from lm_pipeline.kernels.cpu.native_attention import NativeAttentionUnavailable, native_causal_attention
from lm_pipeline.models.layers import attention, segment_mask

pytestmark = pytest.mark.skipif(
    not native_attention.available(), reason="native attention needs a C++ compiler (the XLA path is tested elsewhere)"
)


@pytest.mark.parametrize(
    ("b", "t", "n", "kh", "h"),
    [
        (2, 256, 4, 4, 64),  # 4 full query blocks, head size a multiple of 16
        (3, 200, 4, 2, 24),  # last block short; GQA; head size 16 + 8
        (2, 130, 4, 1, 20),  # multi-query; head size with a scalar tail
        (1, 5, 2, 2, 8),  # fewer rows than the 6-row kernel
        (2, 1, 3, 3, 16),  # a single position
    ],
)
def test_values_and_gradients_match_dot_product_attention(b, t, n, kh, h):
    q, k, v, w = _inputs(b, t, n, kh, h)
    ref = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, scale=0.3)  # noqa: E731
    new = lambda q, k, v: native_causal_attention(q, k, v, 0.3)  # noqa: E731
    np.testing.assert_allclose(jax.jit(new)(q, k, v), jax.jit(ref)(q, k, v), atol=2e-6, rtol=1e-5)
    (l_ref, g_ref), (l_new, g_new) = _value_and_grads(ref, q, k, v, w), _value_and_grads(new, q, k, v, w)
    np.testing.assert_allclose(l_new, l_ref, rtol=1e-5)
    for a, b_ in zip(g_new, g_ref, strict=True):
        np.testing.assert_allclose(a, b_, atol=1e-5 * float(jnp.max(jnp.abs(b_))), rtol=0)


def test_large_scores_stay_finite_and_exact():
    """Logits in the hundreds: the kernel's exp and its max-subtraction keep the softmax exact."""
    q, k, v, w = _inputs(1, 96, 2, 2, 16)
    q = q * 40.0
    ref = jax.nn.dot_product_attention(q, k, v, is_causal=True, scale=1.0)
    out = jax.jit(lambda q, k, v: native_causal_attention(q, k, v, 1.0))(q, k, v)
    assert bool(jnp.all(jnp.isfinite(out)))
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)


def test_traced_scale_gets_no_gradient_and_vmap_runs_per_example():
    q, k, v, w = _inputs(2, 70, 2, 2, 8)
    ds = jax.grad(lambda s: jnp.sum(native_causal_attention(q, k, v, s) * w))(jnp.float32(0.5))
    assert float(ds) == 0.0
    batched = jax.vmap(lambda q, k, v: native_causal_attention(q[None], k[None], v[None], 0.5)[0])(q, k, v)
    np.testing.assert_allclose(batched, native_causal_attention(q, k, v, 0.5), atol=1e-6)


def test_attention_takes_the_native_kernel_on_cpu_float32_only():
    q, k, v, _ = _inputs(2, 64, 4, 2, 16)
    plan = plan_for("cpu", jnp.float32, num_devices=1)
    assert plan.attention == "cpu_native"

    def lowered(fn, *args):
        return jax.jit(fn).lower(*args).as_text()

    plain = lowered(lambda q, k, v: attention(q, k, v, None, scale=0.25, causal=True, plan=plan), q, k, v)
    assert "lm_pipeline_causal_attention_fwd" in plain
    # a packing mask, bf16 inputs, several devices or LM_PIPELINE_ATTENTION=blocked/xla keep XLA ops
    mask = segment_mask(jnp.ones((2, 64), jnp.int32))
    masked = lowered(lambda q, k, v: attention(q, k, v, mask, scale=0.25, causal=True, plan=plan), q, k, v)
    bf16 = lowered(lambda q, k, v: attention(q, k, v, None, scale=0.25, plan=plan),
                   *(x.astype(jnp.bfloat16) for x in (q, k, v)))
    others = [
        lowered(lambda q, k, v, p=p: attention(q, k, v, None, scale=0.25, plan=p), q, k, v)
        for p in (plan_for("cpu", jnp.float32, num_devices=2), plan_for("cpu", jnp.float32, attention="blocked"),
                  plan_for("cpu", jnp.float32, attention="xla"))
    ]
    for text in (masked, bf16, *others):
        assert "lm_pipeline_causal_attention" not in text
    strict = plan_for("cpu", jnp.float32, attention="native")
    with pytest.raises(ValueError, match="takes float32 inputs"):
        attention(*(x.astype(jnp.bfloat16) for x in (q, k, v)), None, scale=0.25, plan=strict)


def test_remat_policy_keeps_the_kernels_output_and_lse():
    """Under the layer remat policy the backward pass reuses the forward's residuals: the
    forward kernel runs once per layer, not again inside the backward pass."""
    q, k, v, w = _inputs(1, 64, 2, 2, 16)

    def layer(q, k, v):
        return attention(q, k, v, None, scale=0.25, causal=True, plan=plan_for("cpu", jnp.float32))

    policy = matmuls_and_attention_saveable()
    body = jax.checkpoint(layer, policy=policy)
    hlo = jax.jit(jax.grad(lambda q, k, v: jnp.sum(body(q, k, v) * w), argnums=(0, 1, 2))).lower(q, k, v).as_text()
    assert hlo.count("lm_pipeline_causal_attention_fwd") == 1
    assert hlo.count("lm_pipeline_causal_attention_bwd") == 1
    fwd_jaxpr = jax.make_jaxpr(lambda q, k, v: native_attention._attend_fwd(q, k, v, jnp.float32(0.25)))(q, k, v)
    names = {str(e.params.get("name")) for e in fwd_jaxpr.eqns if e.primitive.name == "name"}
    assert set(ATTENTION_RESIDUALS) <= names


def test_a_missing_compiler_falls_back_to_the_blocked_attention_with_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(native_attention, "_state", {})
    monkeypatch.setattr(native_attention, "_compiler", lambda: None)
    q, k, v, _ = _inputs(1, 32, 2, 2, 8)
    with caplog.at_level(logging.WARNING, logger="lm_pipeline.kernels.cpu.native_attention"):
        plan = plan_for("cpu", jnp.float32, num_devices=1)
        text = jax.jit(lambda q, k, v: attention(q, k, v, None, scale=0.25, plan=plan)).lower(q, k, v).as_text()
    assert plan.attention == "cpu_blocked"
    assert "lm_pipeline_causal_attention" not in text
    assert "no C++ compiler found" in caplog.text
    with pytest.raises(NativeAttentionUnavailable, match="no C\\+\\+ compiler"):
        native_causal_attention(q, k, v, 0.25)


def test_a_failing_build_names_the_command_and_leaves_no_library(monkeypatch, tmp_path):
    """A compiler that fails: the error carries its output, nothing half-written is left in the
    cache directory, and the next process can still build."""
    fake = tmp_path / "fake-cxx"
    fake.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo fake 1.0; exit 0; fi\necho 'boom: bad flag' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv(native_attention.DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(native_attention, "_compiler", lambda: str(fake))
    with pytest.raises(NativeAttentionUnavailable, match="boom: bad flag"):
        native_attention.build()
    assert list((tmp_path / "cache").iterdir()) == []


def test_the_build_is_cached_per_source_and_written_atomically(monkeypatch, tmp_path):
    monkeypatch.setenv(native_attention.DIR_ENV, str(tmp_path))
    path = native_attention.build()
    assert path.parent == tmp_path and path.name.startswith("cpu_attention-") and path.suffix == ".so"
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary files left
    mtime = path.stat().st_mtime_ns
    assert native_attention.build() == path and path.stat().st_mtime_ns == mtime  # reused, not rebuilt


def test_negative_scale_matches_too():
    q, k, v, _ = _inputs(1, 40, 2, 2, 8)
    ref = jax.nn.dot_product_attention(q, k, v, is_causal=True, scale=-0.7)
    np.testing.assert_allclose(native_causal_attention(q, k, v, -0.7), ref, atol=2e-6, rtol=1e-5)
