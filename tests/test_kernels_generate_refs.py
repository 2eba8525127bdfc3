"""The CPU plan's fused LM head + cross-entropy and text generation against
independent references.

* ``kernels.cpu.fused_head_loss``: the loss sum and both gradients against a float64 NumPy
  cross-entropy (a max-shifted log-sum-exp) for logits far beyond float32's ``exp`` range, with
  chunk sizes that leave a ragged last chunk, a mask with holes in every chunk, and through the
  CPU plan's own ``head_xent_sum``.
* ``generate.select_tokens``: for temperature, top-k and top-p (nucleus), the token drawn with a
  key is the one ``jax.random.categorical`` draws with that key from the logits processed by
  ``transformers``' own warpers (temperature, then top-k, then top-p), including a nucleus whose
  boundary falls exactly on ``top_p``.
* ``generate.generate``: greedy continuations against a full forward pass per step; a row that
  emits ``eos_id`` keeps it and holds ``eos_id`` (the default ``pad_id``) afterwards.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lm_pipeline.compute import plan_for
from lm_pipeline.generate import generate, select_tokens
from lm_pipeline.kernels.cpu.fused_head_loss import fused_head_xent_sum, head_chunks
from lm_pipeline.models import Gpt2Config
from lm_pipeline.models.layers import named_params, replace_params


def _xent_ref(h, w, targets, mask):
    """Float64 loss sum and gradients of ``sum(mask * xent(h @ wᵀ, targets))``."""
    h, w = np.asarray(h, np.float64), np.asarray(w, np.float64)
    logits = np.einsum("btd,vd->btv", h, w)
    mx = logits.max(-1, keepdims=True)
    lse = (mx + np.log(np.exp(logits - mx).sum(-1, keepdims=True)))[..., 0]
    picked = np.take_along_axis(logits, targets[..., None], -1)[..., 0]
    loss = float(((lse - picked) * mask).sum())
    probs = np.exp(logits - lse[..., None])
    dl = (probs - np.eye(w.shape[0])[targets]) * mask[..., None]
    return loss, np.einsum("btv,vd->btd", dl, w), np.einsum("btv,btd->vd", dl, h)


def _large_logits_case(b=2, t=23, d=8, v=37, seed=0):
    rng = np.random.default_rng(seed)
    h = (rng.standard_normal((b, t, d)) * 12.0).astype(np.float32)
    w = (rng.standard_normal((v, d)) * 6.0).astype(np.float32)  # logits of a few hundred
    targets = rng.integers(0, v, (b, t)).astype(np.int32)
    mask = (rng.random((b, t)) > 0.3).astype(np.float32)
    mask[0, ::3] = 0.0
    return h, w, targets, mask


@pytest.mark.parametrize("chunk_rows", [None, 10, 7])
def test_fused_head_loss_and_gradients_match_float64_for_logits_beyond_exp_range(chunk_rows):
    h, w, targets, mask = _large_logits_case()
    logits = np.einsum("btd,vd->btv", h.astype(np.float64), w.astype(np.float64))
    assert np.abs(logits).max() > 150  # exp overflows float32 past ~88.7
    bounds = head_chunks(*targets.shape, rows=chunk_rows)
    if chunk_rows is not None:
        assert len(bounds) > 2 and bounds[-1][1] - bounds[-1][0] != bounds[0][1] - bounds[0][0]  # ragged last chunk
        assert all(mask[:, s:e].min() == 0 for s, e in bounds)  # every chunk has masked rows
    loss_ref, dh_ref, dw_ref = _xent_ref(h, w, targets, mask)

    def loss(h, w):
        return fused_head_xent_sum(h, w, jnp.asarray(targets), jnp.asarray(mask), chunk_rows=chunk_rows)

    value, (dh, dw) = jax.jit(jax.value_and_grad(loss, (0, 1)))(jnp.asarray(h), jnp.asarray(w))
    np.testing.assert_allclose(float(jax.jit(loss)(jnp.asarray(h), jnp.asarray(w))), loss_ref, rtol=1e-5)
    np.testing.assert_allclose(float(value), loss_ref, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(dh), dh_ref, rtol=0, atol=1e-4 * np.abs(dh_ref).max())
    np.testing.assert_allclose(np.asarray(dw), dw_ref, rtol=0, atol=1e-4 * np.abs(dw_ref).max())


def test_cpu_plans_fused_head_matches_float64_for_large_logits():
    """The CPU plan's loss (whatever products it takes here: oneMKL's or XLA's) on large logits."""
    plan = plan_for("cpu", jnp.float32)
    assert plan.loss == "cpu_fused_head"
    h, w, targets, mask = _large_logits_case(seed=1)
    loss_ref, dh_ref, dw_ref = _xent_ref(h, w, targets, mask)

    def loss(h, w):
        return plan.head_xent_sum(h, w, jnp.asarray(targets), jnp.asarray(mask))

    value, (dh, dw) = jax.jit(jax.value_and_grad(loss, (0, 1)))(jnp.asarray(h), jnp.asarray(w))
    np.testing.assert_allclose(float(value), loss_ref, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(dh), dh_ref, rtol=0, atol=1e-4 * np.abs(dh_ref).max())
    np.testing.assert_allclose(np.asarray(dw), dw_ref, rtol=0, atol=1e-4 * np.abs(dw_ref).max())


def _transformers_processed(logits, temperature, top_k, top_p):
    """``logits`` after transformers' warpers, in the order its sampling applies them."""
    import torch
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    scores = torch.from_numpy(np.array(logits, np.float32))
    warpers = [TemperatureLogitsWarper(temperature)]
    if top_k is not None:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p is not None:
        warpers.append(TopPLogitsWarper(top_p))
    for warper in warpers:
        scores = warper(None, scores)
    return scores.numpy()


_KEYS = jax.random.split(jax.random.PRNGKey(3), 96)


@jax.jit
def _reference_draws(processed, keys):
    return jax.vmap(lambda k: jax.random.categorical(k, processed, axis=-1))(keys)


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (0.5, None, None), (2.0, None, None), (0.7, 5, None), (1.3, None, 0.6), (0.8, 8, 0.9),
])
def test_select_tokens_draws_what_transformers_warpers_leave(temperature, top_k, top_p):
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((4, 40)) * 2.0).astype(np.float32)
    processed = _transformers_processed(logits, temperature, top_k, top_p)
    kept = np.isfinite(processed)
    if top_k is not None or top_p is not None:
        assert (kept.sum(-1) < logits.shape[-1]).all() and (kept.sum(-1) > 1).all()
    want = np.asarray(_reference_draws(jnp.asarray(processed), _KEYS))
    got = np.asarray(jax.jit(jax.vmap(lambda k: select_tokens(
        jnp.asarray(logits), k, temperature=temperature, top_k=top_k, top_p=top_p)))(_KEYS))
    assert kept[np.arange(4), got].all()
    np.testing.assert_array_equal(got, want)


def test_nucleus_boundary_exactly_at_top_p_is_transformers():
    """Probabilities 1/2, 1/4, 1/8, 1/16, 1/16 (exact in float32) and ``top_p = 0.75``: the two most
    likely tokens already reach 0.75, so transformers keeps exactly those two."""
    logits = np.log(np.array([[0.125, 0.5, 0.0625, 0.25, 0.0625]], np.float32))
    processed = _transformers_processed(logits, 1.0, None, 0.75)
    assert np.isfinite(processed[0]).tolist() == [False, True, False, True, False]
    want = np.asarray(_reference_draws(jnp.asarray(processed), _KEYS))
    for top_p in (0.75, jnp.float32(0.75)):  # a Python number and a traced array
        got = np.asarray(jax.vmap(lambda k, p=top_p: select_tokens(
            jnp.asarray(logits), k, temperature=1.0, top_p=p))(_KEYS))
        assert set(got[:, 0].tolist()) == {1, 3}
        np.testing.assert_array_equal(got, want)


def _greedy_by_full_forward(model, ids: np.ndarray, new: int) -> np.ndarray:
    """Greedy continuation by a full forward pass over the whole sequence at every step."""
    out = np.asarray(ids, np.int32)
    for _ in range(new):
        logits = np.asarray(eqx.filter_jit(lambda m, x: m(x))(model, jnp.asarray(out)))
        out = np.concatenate([out, logits[:, -1].argmax(-1).astype(np.int32)[:, None]], axis=1)
    return out


def test_generate_stops_rows_at_eos_and_pads_with_eos_by_default():
    """A row that emits ``eos_id`` keeps it and holds ``eos_id`` (the default ``pad_id``) after it;
    the other rows continue as greedy decoding by full forward passes; exactly ``max_new_tokens``
    new positions."""
    skeleton = eqx.filter_eval_shape(Gpt2Config(seq_len=32, hidden_dim=32, num_layers=1, num_heads=2).build, 64,
                                     key=jax.random.key(0))
    rng = np.random.default_rng(2)  # weights near one, the rest near zero: varied greedy continuations
    model = replace_params(skeleton, {name: (1.0 if name.endswith(".weight") else 0.0)
                                      + 0.3 * rng.standard_normal(leaf.shape).astype(np.float32)
                                      for name, leaf in named_params(skeleton).items()})
    ids = np.random.default_rng(5).integers(0, 64, (3, 4)).astype(np.int32)
    new = 8
    ref = _greedy_by_full_forward(model, ids, new)
    free = generate(model, ids, new)
    assert free.shape == (3, 4 + new)
    np.testing.assert_array_equal(free, ref)
    eos = int(ref[0, 4 + 2])  # row 0's third new token
    want = ref.copy()
    for r in range(3):
        cont = ref[r, 4:].tolist()
        if eos in cont:
            want[r, 4 + cont.index(eos):] = eos
    assert eos != 0 and (want != ref).any()  # row 0 stops early, with positions left after EOS
    np.testing.assert_array_equal(generate(model, ids, new, eos_id=eos), want)
