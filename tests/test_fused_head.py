"""The CPU plan's fused LM head + cross-entropy (``kernels.cpu.fused_head_loss``): same loss and
gradients as the logits path, in chunks that split positions, and no ``[B, T, V]`` array in the
compiled train step."""

from __future__ import annotations

import dataclasses
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lm_pipeline.compute import REFERENCE, plan_for
from lm_pipeline.config import load_config
from lm_pipeline.kernels.cpu import fused_head_loss
from lm_pipeline.kernels.cpu.fused_head_loss import fused_head_xent_sum, head_chunks
from lm_pipeline.models.config import Gpt2Config, LlamaConfig
from lm_pipeline.train.loss import model_loss_sums, next_token_loss_sums, next_token_targets
from lm_pipeline.train.sharding import make_mesh
from lm_pipeline.train.trainer import build_step_functions, put_batch

FUSED = plan_for("cpu", jnp.float32)
LOGITS = dataclasses.replace(FUSED, loss="logits")


def lm_logits(h, w):
    return jnp.einsum("btd,vd->btv", h, w)


def fused_head_loss_sums(h, w, tokens, seg):
    targets, mask = next_token_targets(tokens, seg)
    return fused_head_xent_sum(h, w, targets, mask), jnp.sum(mask)


def _case(b, t, d, v, dtype, segments, seed=0):
    rng = np.random.default_rng(seed)
    h = jnp.asarray(rng.standard_normal((b, t, d)), dtype)
    w = jnp.asarray(rng.standard_normal((v, d)) * 0.3, dtype)
    tokens = jnp.asarray(rng.integers(0, v, (b, t)), jnp.int32)
    seg = jnp.asarray(np.sort(rng.integers(0, 3, (b, t)), axis=1), jnp.int32) if segments else None
    return h, w, tokens, seg


@pytest.mark.parametrize("segments", [False, True], ids=["plain", "packed"])
def test_fused_loss_and_gradients_equal_the_logits_path(monkeypatch, segments):
    monkeypatch.setattr(fused_head_loss, "HEAD_CHUNK_ROWS", 16)  # 37 positions x 2 rows: 5 uneven chunks
    h, w, tokens, seg = _case(2, 37, 16, 50, jnp.float32, segments)
    assert len(head_chunks(2, 37)) == 5

    def ref(h, w):
        return next_token_loss_sums(lm_logits(h, w), tokens, seg)

    def fused(h, w):
        return fused_head_loss_sums(h, w, tokens, seg)

    s_ref, n_ref = ref(h, w)
    l_fused, g_fused = jax.jit(jax.value_and_grad(lambda h, w: fused(h, w)[0], (0, 1)))(h, w)
    g_ref = jax.grad(lambda h, w: ref(h, w)[0], (0, 1))(h, w)
    s_fused, n_fused = jax.jit(fused)(h, w)  # not differentiated: the loss alone
    assert float(n_fused) == float(n_ref)
    np.testing.assert_allclose(float(l_fused), float(s_ref), rtol=1e-6)
    np.testing.assert_allclose(float(s_fused), float(s_ref), rtol=1e-6)
    for a, b in zip(g_fused, g_ref, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_allclose(a, b, atol=1e-5 * float(jnp.max(jnp.abs(b))), rtol=0)


def test_fused_gradients_scale_with_the_cotangent_and_keep_bf16():
    """The gradients are computed in the forward pass; the backward pass multiplies them by the
    incoming cotangent (a loss scale, a 1/count), so they must follow it exactly."""
    h, w, tokens, _ = _case(2, 24, 16, 40, jnp.bfloat16, False)
    g1 = jax.grad(lambda h, w: fused_head_loss_sums(h, w, tokens, None)[0], (0, 1))(h, w)
    g3 = jax.grad(lambda h, w: 3.0 * fused_head_loss_sums(h, w, tokens, None)[0], (0, 1))(h, w)
    ref = jax.grad(lambda h, w: next_token_loss_sums(lm_logits(h, w), tokens, None)[0], (0, 1))(h, w)
    for a, b, r in zip(g1, g3, ref, strict=True):
        assert a.dtype == jnp.bfloat16
        a, b, r = (np.asarray(x, np.float32) for x in (a, b, r))
        np.testing.assert_allclose(3.0 * a, b, rtol=2e-2, atol=2e-2 * np.abs(b).max())
        np.testing.assert_allclose(a, r, rtol=0, atol=2e-2 * np.abs(r).max())


def test_chunks_cover_every_position_once_and_follow_the_row_budget():
    for b, t in [(1, 1), (8, 256), (12, 64), (3, 1000), (1024, 4)]:
        bounds = head_chunks(b, t)
        assert bounds[0][0] == 0 and bounds[-1][1] == t
        assert all(e0 == s1 for (_, e0), (s1, _) in zip(bounds, bounds[1:], strict=False))
        assert all(e > s for s, e in bounds)
    assert len(head_chunks(8, 256)) == 4  # 2048 rows / 512
    assert len(head_chunks(1024, 4)) == 4  # never more chunks than positions


@pytest.mark.parametrize("model_cfg", [
    Gpt2Config(seq_len=16, hidden_dim=32, num_layers=2, num_heads=4),
    LlamaConfig(seq_len=16, hidden_dim=32, intermediate_dim=48, num_layers=2, num_heads=4, num_kv_heads=2),
], ids=["gpt2", "llama"])
def test_model_loss_is_the_same_through_features(model_cfg):
    model = model_cfg.build(40, key=jax.random.key(0))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 40, (3, 16)), jnp.int32)
    params, static = eqx.partition(model, eqx.is_array)

    def loss(p, plan):
        return model_loss_sums(eqx.combine(p, static), tokens, None, key=None, inference=True, plan=plan)[0]

    np.testing.assert_allclose(model(tokens), REFERENCE.lm_logits(*model.features(tokens)), rtol=0, atol=0)
    l0, g0 = jax.value_and_grad(loss)(params, LOGITS)
    l1, g1 = jax.value_and_grad(loss)(params, FUSED)
    np.testing.assert_allclose(float(l1), float(l0), rtol=1e-6)
    scale = max(float(jnp.max(jnp.abs(b))) for b in jax.tree.leaves(g0))
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5 * scale, rtol=0)


def test_cpu_train_step_never_holds_the_whole_logits(monkeypatch):
    """On the CPU backend the compiled step has no ``[B, T, V]`` array (the logits path has one);
    f16 loss scaling keeps the logits path."""
    monkeypatch.setattr(fused_head_loss, "HEAD_CHUNK_ROWS", 64)  # 8 x 32 rows: 4 chunks of 8 positions
    assert FUSED.loss == "cpu_fused_head" and plan_for("cpu", jnp.float16, loss_scaling=True).loss == "logits"
    b, t, v = 8, 32, 96
    cfg = load_config(None, {"model.type": "gpt2", "model.seq_len": t, "model.hidden_dim": 32, "model.num_layers": 1,
                             "model.num_heads": 2, "trainer.train_batch_size": b, "trainer.mp": "f32"})
    plan = make_mesh(cfg.trainer, jax.devices()[:1])

    def hlo(fused: bool) -> str:
        fns = build_step_functions(cfg.model, cfg.optimizer, cfg.trainer, vocab_size=v, num_train_steps=10,
                                   plan=plan, has_segments=False, compute=FUSED if fused else LOGITS)
        assert fns.compute.loss == ("cpu_fused_head" if fused else "logits")
        state = fns.abstract_state
        tokens, seg = put_batch(_batch(b, t, v), plan)
        return fns.train_step.lower(state, tokens, seg).compile().as_text()

    whole = re.compile(rf"\[{b},{t},{v}\]")
    assert whole.search(hlo(False)), "the logits path should hold [B, T, V] logits"
    assert not whole.search(hlo(True))


def _batch(b, t, v):
    from lm_pipeline.batch import LmBatch

    return LmBatch(np.random.default_rng(0).integers(0, v, (b, t), dtype=np.int32))


def test_eval_step_loss_is_the_same_on_the_chunked_path(monkeypatch):
    monkeypatch.setattr(fused_head_loss, "HEAD_CHUNK_ROWS", 64)
    b, t, v = 8, 32, 96
    cfg = load_config(None, {"model.type": "gpt2", "model.seq_len": t, "model.hidden_dim": 32, "model.num_layers": 1,
                             "model.num_heads": 2, "trainer.train_batch_size": b, "trainer.mp": "f32"})
    plan = make_mesh(cfg.trainer, jax.devices()[:1])
    sums = {}
    for fused in (False, True):
        fns = build_step_functions(cfg.model, cfg.optimizer, cfg.trainer, vocab_size=v, num_train_steps=10,
                                   plan=plan, has_segments=False, compute=FUSED if fused else LOGITS)
        state = fns.init(jax.random.key_data(jax.random.key(0)))
        sums[fused] = [float(x) for x in fns.eval_step(state, *put_batch(_batch(b, t, v), plan))]
    assert sums[True][1] == sums[False][1] == b * (t - 1)
    np.testing.assert_allclose(sums[True][0], sums[False][0], rtol=1e-6)
