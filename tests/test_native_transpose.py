"""The native library's 2-D transpose and the weight-gradient products it feeds: bit-exact against
NumPy for every instruction-set level the CPU runs, and the bf16 weight gradients of ``m=bf16``
really multiplied as bf16 (XLA computes them in float32 when it sees the transpose)."""

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from lm_pipeline.compute import plan_for
from lm_pipeline.config import load_config
from lm_pipeline.kernels.cpu import matmul, native_attention
from lm_pipeline.train.sharding import make_mesh
from lm_pipeline.train.trainer import build_step_functions, put_batch, step_args

pytestmark = pytest.mark.skipif(not native_attention.available(), reason="the native library needs a C++ compiler")

ISAS = native_attention.runnable_isas() if native_attention.available() else []


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float16, np.int32])
def test_transpose_is_numpys_bit_for_bit(isa, dtype):
    rng = np.random.default_rng(0)
    # whole 16 x 16 tiles, ragged edges on both axes, a single row, more tasks than tiles
    for shape in ((768, 512), (37, 53), (16, 16), (1, 7), (250, 3), (0, 5)):
        x = (rng.standard_normal(shape) * 100).astype(dtype)
        got = np.asarray(jax.jit(lambda a: matmul.transpose(a, isa))(jnp.asarray(x)))
        assert got.dtype == x.dtype and got.shape == shape[::-1]
        assert got.tobytes() == np.ascontiguousarray(x.T).tobytes(), (isa, dtype, shape)


def test_transpose_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="2-D array of 2- or 4-byte"):
        matmul.transpose(jnp.zeros((2, 3, 4)))
    with pytest.raises(ValueError, match="2-D array of 2- or 4-byte"):
        matmul.transpose(jnp.zeros((2, 3), jnp.int8))


@pytest.mark.parametrize("operands", [None, jnp.bfloat16])
def test_native_weight_gradient_matches_float64(operands):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 96, 40)).astype(np.float32)
    w = rng.standard_normal((40, 24)).astype(np.float32)
    g = rng.standard_normal((4, 96, 24)).astype(np.float32)
    rnd = (lambda a: np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)) if operands else \
        (lambda a: np.asarray(a, np.float64))
    _, vjp = jax.vjp(lambda a, b: matmul.matmul(a, b, operands, True), jnp.asarray(x), jnp.asarray(w))
    dx, dw = vjp(jnp.asarray(g))
    ref_dw = rnd(x).reshape(-1, 40).T @ rnd(g).reshape(-1, 24)
    np.testing.assert_allclose(np.asarray(dw, np.float64), ref_dw, rtol=1e-5, atol=1e-5 * np.abs(ref_dw).max())
    np.testing.assert_allclose(np.asarray(dx, np.float64), rnd(g) @ rnd(w).T, rtol=1e-5, atol=1e-5)
    # K > N (the MLP's output projection): x is still the operand transposed
    x2, w2, g2 = x[..., :32].repeat(2, -1), w[:, :8].repeat(8, 0)[:64], g[..., :8]
    _, vjp = jax.vjp(lambda a, b: matmul.matmul(a, b, operands, True), jnp.asarray(x2), jnp.asarray(w2))
    ref_dw2 = rnd(x2).reshape(-1, 64).T @ rnd(g2).reshape(-1, 8)
    np.testing.assert_allclose(np.asarray(vjp(jnp.asarray(g2))[1], np.float64), ref_dw2, rtol=1e-5,
                               atol=1e-5 * np.abs(ref_dw2).max())


def test_the_one_device_cpu_plan_uses_it_and_a_sharded_one_does_not():
    assert plan_for("cpu", jnp.float32).native_transpose
    assert not plan_for("cpu", jnp.float32, num_devices=2).native_transpose  # a custom call is not partitioned
    assert not plan_for("gpu", jnp.bfloat16).native_transpose


def _dot_operand_types(mp: str) -> list[str]:
    cfg = load_config(None, {
        "model.type": "gpt2", "model.seq_len": 32, "model.hidden_dim": 64, "model.num_heads": 2, "model.num_layers": 2,
        "model.gradient_checkpointing": False, "trainer.train_batch_size": 8, "trainer.mp": mp,
    })
    plan = make_mesh(cfg.trainer, jax.devices()[:1])
    fns = build_step_functions(cfg.model, cfg.optimizer, cfg.trainer, vocab_size=128, num_train_steps=4, plan=plan,
                               has_segments=False)
    state = fns.init(jax.random.key_data(jax.random.key(0)))
    from lm_pipeline.batch import LmBatch

    args = step_args(fns, put_batch(LmBatch(np.zeros((8, 32), np.int32)), plan))
    hlo = fns.train_step.lower(state, *args).compile().as_text()
    # the element types of every computation's parameters that holds a dot
    computations = re.finditer(r"\n%\S+ \((.*?)\) -> \S+ \{\n(.*?)\n\}", hlo, re.S)
    return [m.group(1) for m in computations if " dot(" in m.group(2)]


def test_bf16_operands_reach_every_dot_as_bf16():
    params = _dot_operand_types("p=f32,c=f32,m=bf16")
    # forward, input-gradient and weight-gradient products of 2 layers and the head
    assert len(params) >= 12, params
    f32_dots = [p for p in params if "f32[" in p]
    assert not f32_dots, f"dots computed in float32 from bf16-rounded operands: {f32_dots}"


def _one_step(overrides: dict, native: bool, monkeypatch) -> tuple[float, list[np.ndarray]]:
    from lm_pipeline import compute
    from lm_pipeline.batch import LmBatch

    with monkeypatch.context() as m:
        m.setattr(compute, "_native_library", lambda: native)
        m.setenv(compute.BLAS_ENV, "xla")  # the transpose's products, not oneMKL's (tests/test_blas_gemm.py)
        cfg = load_config(None, {
            "model.seq_len": 16, "model.hidden_dim": 32, "model.num_heads": 2, "model.num_layers": 2,
            "model.gradient_checkpointing": False, "trainer.train_batch_size": 4, "optimizer.warmup": 0,
            "optimizer.learning_rate": 1e-2, **overrides,
        })
        plan = make_mesh(cfg.trainer, jax.devices()[:1])
        fns = build_step_functions(cfg.model, cfg.optimizer, cfg.trainer, vocab_size=48, num_train_steps=4, plan=plan,
                                   has_segments=False)
        assert fns.compute.native_transpose is native
        state = fns.init(jax.random.key_data(jax.random.key(0)))
        batch = LmBatch(np.random.default_rng(0).integers(0, 48, (4, 16)).astype(np.int32))
        state, metrics = fns.train_step(state, *step_args(fns, put_batch(batch, plan)))
        return float(metrics["train/loss"]), [np.asarray(x, np.float64) for x in jax.tree.leaves(state.model)]


LLAMA = {"model.type": "llama", "model.intermediate_dim": 64}


GPT2, UNTIED, TIED = {"model.type": "gpt2"}, {**LLAMA, "model.num_kv_heads": 1}, {**LLAMA, "model.tie_word_embeddings": True,
                                                                                  "model.num_kv_heads": 2}
#: the default tier: bf16 operands through the fused head (tied and GPT-2's) and the f16 logits path
#: (loss scaling, untied head); the slow tier: every model with every precision
CASES = [pytest.param(model, mp, id=f"{name}-{mp}", marks=() if (name, mp) in {
    ("gpt2", "p=f32,c=f32,m=bf16"), ("llama-tied", "p=f32,c=f32,m=bf16"), ("llama", "p=f32,c=f16")} else pytest.mark.slow)
    for name, model in (("gpt2", GPT2), ("llama", UNTIED), ("llama-tied", TIED))
    for mp in ("f32", "p=f32,c=f32,m=bf16", "p=f32,c=bfloat16", "p=f32,c=f16")]


@pytest.mark.parametrize(("model", "mp"), CASES)
def test_every_model_and_precision_steps_as_without_it(model, mp, monkeypatch):
    """Forward, loss (fused head, or logits under f16 loss scaling) and every weight gradient with
    the native transpose against the same step without it; a product XLA rewrites into a form
    with no bf16 kernel would fail here (it did, for a head whose gradient was transposed)."""
    loss, params = _one_step({**model, "trainer.mp": mp}, True, monkeypatch)
    ref_loss, ref_params = _one_step({**model, "trainer.mp": mp}, False, monkeypatch)
    assert np.isfinite(loss) and loss == pytest.approx(ref_loss, rel=1e-6)
    low = mp.endswith(("bfloat16", "f16"))
    for got, ref in zip(params, ref_params, strict=True):
        np.testing.assert_allclose(got, ref, rtol=1e-2 if low else 1e-5, atol=1e-2 if low else 2e-5)


def _bf64(a) -> np.ndarray:
    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


@pytest.mark.parametrize("operands", [None, jnp.bfloat16])
def test_native_head_gradients_match_float64(operands):
    """The LM head's weight gradient straight into [V, D] (:func:`matmul.head_grad`), through the
    logits path and the fused head + cross-entropy, against float64 NumPy: values, not only signs."""
    from lm_pipeline.kernels.cpu import fused_head_loss

    rng = np.random.default_rng(7)
    b, t, d, v = 3, 20, 24, 40
    x = rng.standard_normal((b, t, d)).astype(np.float32)
    w = rng.standard_normal((v, d)).astype(np.float32)
    g = rng.standard_normal((b, t, v)).astype(np.float32)
    rnd = _bf64 if operands else (lambda a: np.asarray(a, np.float64))
    logits, vjp = jax.vjp(lambda a, c: matmul.lm_logits(a, c, operands, True), jnp.asarray(x), jnp.asarray(w))
    np.testing.assert_allclose(np.asarray(logits, np.float64), rnd(x) @ rnd(w).T, rtol=1e-5, atol=1e-5)
    one = jax.grad(lambda c: jnp.sum(matmul.lm_logits(jnp.asarray(x[0]), c, operands, True) * g[0]))(jnp.asarray(w))
    np.testing.assert_allclose(np.asarray(one, np.float64), rnd(g[0]).T @ rnd(x[0]), rtol=1e-5, atol=1e-4)  # [T, D] rows
    dx, dw = vjp(jnp.asarray(g))
    np.testing.assert_allclose(np.asarray(dx, np.float64), rnd(g) @ rnd(w), rtol=1e-5, atol=1e-5)
    ref_dw = np.einsum("btv,btd->vd", rnd(g), rnd(x))
    np.testing.assert_allclose(np.asarray(dw, np.float64), ref_dw, rtol=1e-5, atol=1e-5 * np.abs(ref_dw).max())

    tgt = rng.integers(0, v, (b, t)).astype(np.int32)
    mask = (rng.random((b, t)) > 0.25).astype(np.float32)

    def loss(h, head):  # 3 chunks of positions: the gradient is summed over them
        return fused_head_loss.fused_head_xent_sum(h, head, jnp.asarray(tgt), jnp.asarray(mask), chunk_rows=20,
                                                   operands=operands, native=True)

    got, (dh, dhead) = jax.value_and_grad(loss, argnums=(0, 1))(jnp.asarray(x), jnp.asarray(w))
    lg = rnd(x) @ rnd(w).T
    p = np.exp(lg - lg.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(float(got), float((-np.log(np.take_along_axis(p, tgt[..., None], -1)[..., 0]) * mask).sum()),
                               rtol=1e-5)
    dl = rnd((p - np.eye(v)[tgt]) * mask[..., None])
    np.testing.assert_allclose(np.asarray(dh, np.float64), dl @ rnd(w), rtol=1e-4, atol=1e-5)
    ref_dhead = np.einsum("btv,btd->vd", dl, rnd(x))
    np.testing.assert_allclose(np.asarray(dhead, np.float64), ref_dhead, rtol=1e-4, atol=1e-5 * np.abs(ref_dhead).max())
