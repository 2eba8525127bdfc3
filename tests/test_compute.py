"""The compute plan: its choices per platform, dtype and device count, and the forms it picks
(CPU matmul with a transposed weight gradient, the padded LM head, the attention kernels, the
remat policy) against plain autodiff and the reference plan."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lm_pipeline.compute import (
    ACCELERATOR_UNROLL_MAX_LAYERS,
    ATTENTION_ENV,
    CPU_UNROLL_MAX_LAYERS,
    REFERENCE,
    ComputePlan,
    mesh_platform,
    plan_for,
)
from lm_pipeline.kernels.cpu import native_attention
from lm_pipeline.kernels.cpu.matmul import DENSE_OUT, dense, matmuls_and_attention_saveable
from lm_pipeline.models import Gpt2Config, LlamaConfig


def _arrays(*shapes, seed=0):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.standard_normal(s, np.float32)) for s in shapes]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_cpu_dense_values_and_gradients_equal_the_einsum(dtype):
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


@pytest.mark.parametrize("matmul", ["xla", "cpu"])
@pytest.mark.parametrize("pad", [1, 64], ids=["unpadded", "vocab_padded"])
def test_lm_head_values_and_gradients_equal_autodiff(pad, matmul):
    """Padding the vocabulary (50 -> 64 here, as accelerators do to 128) and the CPU matmul
    change nothing: same logits shape and values, same gradients, the weight gradient in its
    unpadded shape."""
    plan = ComputePlan(vocab_pad_multiple=pad, matmul=matmul)
    x, w, c = _arrays((2, 8, 16), (50, 16), (2, 8, 50))
    got_logits = plan.lm_logits(x, w)
    assert got_logits.shape == (2, 8, 50)
    np.testing.assert_allclose(got_logits, jnp.einsum("btd,vd->btv", x, w), rtol=1e-5, atol=1e-5)
    got = jax.jit(jax.grad(lambda x, w: jnp.sum(plan.lm_logits(x, w) * c), argnums=(0, 1)))(x, w)
    ref = jax.grad(lambda x, w: jnp.sum(jnp.einsum("btd,vd->btv", x, w) * c), argnums=(0, 1))(x, w)
    assert got[1].shape == w.shape
    for a, b in zip(got, ref, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5 * float(jnp.max(jnp.abs(b))), rtol=0)


def test_cpu_plans_per_dtype_devices_and_loss_scaling():
    f32 = plan_for("cpu", jnp.float32, num_devices=1)
    expected = "cpu_native" if native_attention.available() else "cpu_blocked"
    assert (f32.attention, f32.matmul, f32.loss, f32.remat) == (expected, "cpu", "cpu_fused_head", "cpu_dots")
    assert f32.vocab_pad_multiple == 1 and not f32.unroll(4)  # f32 keeps the scan (remat policy instead)
    # several devices: the SPMD partitioner cannot shard the native kernel's custom call
    assert plan_for("cpu", jnp.float32, num_devices=8).attention == "cpu_blocked"
    bf16 = plan_for("cpu", jnp.bfloat16)
    assert bf16.attention == expected and bf16.remat == "none" and bf16.remat_policy() is None  # the kernel computes in f32
    assert bf16.unroll(4) and bf16.unroll(CPU_UNROLL_MAX_LAYERS) and not bf16.unroll(CPU_UNROLL_MAX_LAYERS + 1)
    # f16 loss scaling keeps the logits path (the fused head's cotangent would be cast before scaling)
    assert plan_for("cpu", jnp.float16, loss_scaling=True).loss == "logits"


def test_accelerator_plans_read_like_plain_xla():
    gpu = plan_for("gpu", jnp.bfloat16, num_devices=8)
    assert (gpu.attention, gpu.matmul, gpu.loss, gpu.remat) == ("cudnn", "xla", "logits", "none")
    assert gpu.vocab_pad_multiple == 128 and gpu.unroll(ACCELERATOR_UNROLL_MAX_LAYERS)
    assert not gpu.unroll(ACCELERATOR_UNROLL_MAX_LAYERS + 1) and not gpu.f16_attention_in_f32
    assert plan_for("gpu", jnp.float32).attention == "xla"  # cuDNN's fused kernels are bf16/f16
    assert plan_for("tpu", jnp.bfloat16).attention == "xla"


def test_attention_choice_from_the_environment(monkeypatch):
    monkeypatch.setenv(ATTENTION_ENV, "xla")
    assert plan_for("gpu", jnp.bfloat16).attention == "xla"
    assert plan_for("cpu", jnp.float32).attention == "xla"
    monkeypatch.setenv(ATTENTION_ENV, "blocked")
    assert plan_for("cpu", jnp.float32).attention == "cpu_blocked"
    monkeypatch.setenv(ATTENTION_ENV, "cudnn")
    assert plan_for("gpu", jnp.float32).attention == "cudnn" and plan_for("gpu", jnp.float32).strict_attention
    with pytest.raises(ValueError, match="needs a GPU"):
        plan_for("cpu", jnp.float32)
    monkeypatch.setenv(ATTENTION_ENV, "native")
    with pytest.raises(ValueError, match="CPU kernel"):
        plan_for("gpu", jnp.bfloat16)
    with pytest.raises(ValueError, match="single CPU device"):
        plan_for("cpu", jnp.float32, num_devices=2)
    monkeypatch.setenv(ATTENTION_ENV, "bogus")
    with pytest.raises(ValueError, match=ATTENTION_ENV):
        plan_for("cpu", jnp.float32)
    with pytest.raises(ValueError, match="attention must be one of"):
        plan_for("cpu", jnp.float32, attention="flash")


def test_a_cudnn_plan_off_a_gpu_falls_back_to_xla_values():
    """Not strict (``auto``): where cuDNN refuses (here: no GPU), XLA's attention, same values;
    strict (``cudnn`` by name): the refusal surfaces."""
    q, k, v = (x.astype(jnp.bfloat16) for x in _arrays((2, 16, 4, 16), (2, 16, 4, 16), (2, 16, 4, 16)))
    got = ComputePlan(attention="cudnn").causal_attention(q, k, v, None, 0.25)
    ref = jax.nn.dot_product_attention(q, k, v, is_causal=True, scale=0.25)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(ref, np.float32))
    with pytest.raises((NotImplementedError, RuntimeError, ValueError)):
        ComputePlan(attention="cudnn", strict_attention=True).causal_attention(q, k, v, None, 0.25)


def test_mesh_platform():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    assert mesh_platform(mesh) == "cpu"


PLANS = {
    "reference": REFERENCE,
    "cpu_f32": plan_for("cpu", jnp.float32, num_devices=1),
    "cpu_blocked": plan_for("cpu", jnp.float32, num_devices=1, attention="blocked"),
    "gpu_shaped": dataclasses.replace(plan_for("gpu", jnp.float32), platform="cpu"),  # padded head, unrolled layers
}


@pytest.mark.parametrize(("family", "name"), [("gpt2", "cpu_f32"), ("gpt2", "cpu_blocked"), ("gpt2", "gpu_shaped"),
                                              ("llama", "cpu_f32")])
def test_every_plan_computes_the_reference_logits_and_gradients(family, name):
    """A model's logits and parameter gradients are the same whichever plan computes them,
    packed rows (segment ids) included."""
    import equinox as eqx

    cfg = (Gpt2Config(seq_len=128, hidden_dim=32, num_layers=2, num_heads=4, gradient_checkpointing=False)
           if family == "gpt2" else
           LlamaConfig(seq_len=128, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4, num_kv_heads=2,
                       gradient_checkpointing=False))
    model = cfg.build(100, key=jax.random.key(0))
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, 100, (2, 128)), jnp.int32)
    seg = jnp.asarray(np.repeat([[1, 2, 3, 0]], 32, axis=1).reshape(1, 128).repeat(2, 0), jnp.int32)
    c = jnp.asarray(rng.standard_normal((2, 128, 100)), jnp.float32)

    def run(plan, segments):
        def loss(m):
            return jnp.sum(m(tokens, segments, plan=plan) * c)

        return eqx.filter_jit(eqx.filter_value_and_grad(loss))(model)

    for segments in (None, seg):
        (l_ref, g_ref), (l_new, g_new) = run(REFERENCE, segments), run(PLANS[name], segments)
        np.testing.assert_allclose(l_new, l_ref, rtol=1e-4)
        for a, b in zip(jax.tree.leaves(g_new), jax.tree.leaves(g_ref), strict=True):
            np.testing.assert_allclose(a, b, atol=2e-4 * float(jnp.max(jnp.abs(b))) + 1e-7, rtol=0)


def test_remat_policy_saves_dense_outputs(capsys):
    """The CPU matmul is a custom VJP, not a dot_general, so only its name keeps its output
    from being recomputed under the CPU plan's policy."""
    x, w1, w2 = _arrays((2, 8, 16), (16, 32), (32, 16))

    def layer(x, w1, w2):
        return jnp.sum(dense(jnp.tanh(dense(x, w1)), w2))

    def saved(policy):
        capsys.readouterr()
        jax.ad_checkpoint.print_saved_residuals(jax.checkpoint(layer, policy=policy), x, w1, w2)
        return capsys.readouterr().out

    assert DENSE_OUT in saved(matmuls_and_attention_saveable())
    assert DENSE_OUT not in saved(jax.checkpoint_policies.dots_saveable)
    assert plan_for("cpu", jnp.float32).remat_policy() is not None


@pytest.mark.parametrize("bias_shape", [(8,), (4, 2)])
def test_low_precision_bias_gradient_is_the_float64_sum_rounded_once(bias_shape):
    """A bf16 activation's bias gradient on the CPU plan: the cotangent summed over every leading
    axis in float64 (NumPy), then rounded once to bf16. A sum accumulated in bf16, a missing axis
    or a gradient of the wrong shape fails; the forward is ``y + b`` in bf16."""
    cpu = plan_for("cpu", jnp.bfloat16)
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    y = jax.random.normal(k1, (6, 64, *bias_shape)).astype(jnp.bfloat16)
    b = jax.random.normal(k2, bias_shape).astype(jnp.bfloat16)
    w = (1.0 + jax.random.uniform(k3, y.shape)).astype(jnp.bfloat16)  # cotangent of y + b: w

    out, vjp = jax.vjp(cpu.add_bias, y, b)
    gy, gb = vjp(w)

    np.testing.assert_array_equal(np.asarray(out), np.asarray(y + b))
    np.testing.assert_array_equal(np.asarray(gy), np.asarray(w))
    want = np.asarray(w, np.float64).sum(axis=(0, 1))
    assert gb.dtype == jnp.bfloat16 and gb.shape == bias_shape
    np.testing.assert_array_equal(np.asarray(gb, np.float32), want.astype(np.float32).astype(jnp.bfloat16).astype(np.float32))
    assert cpu.add_bias(y, None) is y


def test_bf16_rounding_is_ml_dtypes_round_to_nearest_even_bit_for_bit():
    """The matmul operands' float32 -> bfloat16 rounding (integer operations) against ml_dtypes'
    conversion: random bit patterns, ties at odd and even mantissas, subnormals, the largest
    finite values (which round to inf), infinities and NaNs of either sign."""
    import ml_dtypes

    from lm_pipeline.kernels.cpu.matmul import bf16_round, round_to

    rng = np.random.default_rng(0)
    patterns = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    ties = (rng.integers(0, 2**16, 20_000).astype(np.uint32) << 16) | 0x8000  # exactly half way
    special = np.array([0, 0x80000000, 0x00000001, 0x007FFFFF, 0x80400000, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F7FFF,
                        0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFFFFFFF, 0x3F808000, 0x3F818000,
                        0x3F80FFFF, 0x3F817FFF], np.uint32)
    bits = np.concatenate([patterns, ties, special])
    x = bits.view(np.float32)
    ours = np.asarray(jax.jit(bf16_round)(jnp.asarray(x))).view(np.uint16)
    with np.errstate(invalid="ignore"):  # NumPy warns on casting NaNs
        ref = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    nan = np.isnan(x)
    assert nan.sum() > 100 and np.isinf(x).sum() == 2
    np.testing.assert_array_equal(ours, ref)  # NaNs too: quiet, of the input's sign, never rounded to inf
    assert set(ours[nan].tolist()) == {0x7FC0, 0xFFC0}
    xla = np.asarray(jax.jit(lambda v: v.astype(jnp.bfloat16))(jnp.asarray(x))).view(np.uint16)
    np.testing.assert_array_equal(ours, xla)  # and XLA's own convert, which it replaces
    small = jnp.asarray(x[:8])
    np.testing.assert_array_equal(np.asarray(round_to(small, jnp.bfloat16)).view(np.uint16), ref[:8])
    assert round_to(small, None) is small
    same = jnp.ones(2, jnp.bfloat16)
    assert round_to(same, jnp.bfloat16) is same
