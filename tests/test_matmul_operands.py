"""``trainer.mp``'s ``m=``: projections and the LM head multiply operands rounded to bf16 (float32
accumulation), the rest of the step in the compute dtype; checked against NumPy in float64 on
operands rounded by ml_dtypes."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from lm_pipeline.batch import LmBatch
from lm_pipeline.compute import REFERENCE, ComputePlan
from lm_pipeline.config import load_config
from lm_pipeline.kernels.cpu import fused_head_loss, matmul
from lm_pipeline.schema import ConfigError
from lm_pipeline.train.precision import parse_mp
from lm_pipeline.train.sharding import make_mesh
from lm_pipeline.train.trainer import build_step_functions, put_batch, step_args


def bf(x) -> np.ndarray:
    """``x`` rounded to bfloat16 (round to nearest even, as XLA's convert), as float64."""
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def test_the_policy_spells_the_operand_dtype():
    p = parse_mp("p=f32,c=f32,m=bf16")
    assert (p.param, p.compute, p.output, p.matmul) == (jnp.float32, jnp.float32, jnp.float32, jnp.bfloat16)
    assert parse_mp("p=f32,c=bfloat16,matmul=f32").matmul == jnp.float32  # f32 products in a bf16 model
    assert parse_mp("p=f32,c=f32,m=f32").matmul is None  # the compute dtype itself: nothing to round
    assert parse_mp("p=f32,c=bfloat16").matmul is None
    with pytest.raises(ConfigError, match="m=f16 needs c=f16"):
        parse_mp("p=f32,c=f32,m=f16")
    with pytest.raises(ConfigError, match="use p, c, o, m"):
        parse_mp("p=f32,x=bf16")
    with pytest.raises(ConfigError, match="trainer.mp"):
        load_config(None, {"trainer.mp": "p=f32,m=int8"})


def _xwg(m=48, k=40, n=24, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((3, m // 3, k)).astype(np.float32), rng.standard_normal((k, n)).astype(np.float32),
            rng.standard_normal((3, m // 3, n)).astype(np.float32))


def test_cpu_matmul_rounds_operands_in_the_product_and_both_gradients():
    x, w, g = _xwg()
    y, vjp = jax.vjp(lambda a, b: matmul.matmul(a, b, jnp.bfloat16), jnp.asarray(x), jnp.asarray(w))
    dx, dw = vjp(jnp.asarray(g))
    assert y.dtype == dx.dtype == dw.dtype == jnp.float32
    ref_y = bf(x) @ bf(w)
    ref_dx = bf(g) @ bf(w).T
    ref_dw = bf(x).reshape(-1, x.shape[-1]).T @ bf(g).reshape(-1, g.shape[-1])
    for got, ref in ((y, ref_y), (dx, ref_dx), (dw, ref_dw)):
        np.testing.assert_allclose(np.asarray(got, np.float64), ref, rtol=2e-6, atol=2e-6 * np.abs(ref).max())
    # the float32 product is another one: the rounding above is what this mode does, not noise
    assert np.abs(x.astype(np.float64) @ w - ref_y).max() > 1e-3 * np.abs(ref_y).max()
    plain = matmul.matmul(jnp.asarray(x), jnp.asarray(w))
    np.testing.assert_allclose(np.asarray(plain, np.float64), x.astype(np.float64) @ w, rtol=1e-5, atol=1e-5)


def test_the_plans_dense_and_logits_round_operands_on_the_xla_path_too():
    x, w, _ = _xwg(seed=1)
    plan = ComputePlan(matmul_operands=jnp.bfloat16)  # plain XLA operations, as on GPU/TPU
    np.testing.assert_allclose(np.asarray(plan.dense(jnp.asarray(x), jnp.asarray(w)), np.float64), bf(x) @ bf(w),
                               rtol=2e-6, atol=1e-5)
    head = np.random.default_rng(2).standard_normal((30, x.shape[-1])).astype(np.float32)
    logits = plan.lm_logits(jnp.asarray(x), jnp.asarray(head))
    assert logits.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(logits, np.float64), bf(x) @ bf(head).T, rtol=2e-6, atol=1e-5)
    assert REFERENCE.matmul_operands is None
    # gradients: the cotangent rounded too, float32 sums returned (as the CPU kernel's)
    g = np.random.default_rng(4).standard_normal((*x.shape[:-1], w.shape[1])).astype(np.float32)
    _, vjp = jax.vjp(plan.dense, jnp.asarray(x), jnp.asarray(w))
    dx, dw = vjp(jnp.asarray(g))
    assert dx.dtype == dw.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(dx, np.float64), bf(g) @ bf(w).T, rtol=2e-6, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dw, np.float64),
                               bf(x).reshape(-1, x.shape[-1]).T @ bf(g).reshape(-1, g.shape[-1]), rtol=2e-6, atol=1e-5)
    gl = np.random.default_rng(5).standard_normal(logits.shape).astype(np.float32)
    _, vjp = jax.vjp(plan.lm_logits, jnp.asarray(x), jnp.asarray(head))
    dx, dhead = vjp(jnp.asarray(gl))
    np.testing.assert_allclose(np.asarray(dx, np.float64), bf(gl) @ bf(head), rtol=2e-6, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dhead, np.float64), np.einsum("btv,btd->vd", bf(gl), bf(x)),
                               rtol=2e-6, atol=1e-5)


def test_fused_head_loss_rounds_its_operands_and_keeps_a_float32_softmax():
    rng = np.random.default_rng(3)
    b, t, d, v = 2, 10, 16, 37
    h = rng.standard_normal((b, t, d)).astype(np.float32)
    head = rng.standard_normal((v, d)).astype(np.float32)
    tgt = rng.integers(0, v, (b, t)).astype(np.int32)
    mask = (rng.random((b, t)) > 0.2).astype(np.float32)

    def loss(hh, ww):
        return fused_head_loss.fused_head_xent_sum(hh, ww, jnp.asarray(tgt), jnp.asarray(mask), chunk_rows=7,
                                                   operands=jnp.bfloat16)

    got, (dh, dw) = jax.value_and_grad(loss, argnums=(0, 1))(jnp.asarray(h), jnp.asarray(head))
    logits = bf(h) @ bf(head).T  # [B, T, V], float64
    mx = logits.max(-1, keepdims=True)
    p = np.exp(logits - mx) / np.exp(logits - mx).sum(-1, keepdims=True)
    nll = -np.log(np.take_along_axis(p, tgt[..., None], -1)[..., 0])
    np.testing.assert_allclose(float(got), float((nll * mask).sum()), rtol=1e-5)
    dl = bf((p - np.eye(v)[tgt]) * mask[..., None])  # the cotangent is rounded too
    np.testing.assert_allclose(np.asarray(dh, np.float64), dl @ bf(head), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dw, np.float64), np.einsum("btv,btd->vd", dl, bf(h)), rtol=1e-5, atol=1e-5)


TINY = {
    "model.type": "gpt2", "model.seq_len": 16, "model.hidden_dim": 32, "model.num_heads": 2, "model.num_layers": 2,
    "model.gradient_checkpointing": False, "trainer.train_batch_size": 4, "optimizer.learning_rate": 1e-2,
    "optimizer.warmup": 0,
}


def _losses(mp: str, steps: int = 12):
    cfg = load_config(None, {**TINY, "trainer.mp": mp})
    plan = make_mesh(cfg.trainer, jax.devices()[:1])
    fns = build_step_functions(cfg.model, cfg.optimizer, cfg.trainer, vocab_size=64, num_train_steps=steps,
                               plan=plan, has_segments=False)
    state = fns.init(jax.random.key_data(jax.random.key(0)))
    batch = LmBatch(np.random.default_rng(0).integers(0, 64, (4, 16)).astype(np.int32))
    out = []
    for _ in range(steps):
        state, m = fns.train_step(state, *step_args(fns, put_batch(batch, plan)))
        out.append(float(m["train/loss"]))
    return fns, out


def test_training_with_bf16_operands_learns_and_tracks_float32():
    fns, mixed = _losses("p=f32,c=f32,m=bf16")
    assert fns.compute.matmul_operands == jnp.bfloat16
    ref_fns, f32 = _losses("f32")
    assert ref_fns.compute.matmul_operands is None
    assert mixed != f32  # the operands really are rounded
    np.testing.assert_allclose(mixed[0], f32[0], rtol=2e-3)  # same weights, same batch: bf16 rounding only
    assert mixed[-1] < 0.8 * mixed[0]
    np.testing.assert_allclose(mixed[-1], f32[-1], rtol=0.05)
