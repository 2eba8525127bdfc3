"""``optimizer.type``: Lion, Adafactor and Muon step for step as Optax's own optimizers (the
independent reference: ``optax.lion``, ``optax.adafactor``, ``optax.contrib.muon`` built here
from their documented arguments), on a small parameter tree with logical axes; Muon's matrices
and axes as read from those axes; Sophia-H against a NumPy transcription of the paper's update;
AdamW's fingerprint unchanged."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P
from optax.contrib import MuonDimensionNumbers

from lm_pipeline.config import load_config
from lm_pipeline.fingerprint import semantic_view
from lm_pipeline.schema import ConfigError, from_dict
from lm_pipeline.train.optim import muon_dimensions, weight_decay_mask
from lm_pipeline.train.optim_config import OptimizerConfig

LR, WD = 3e-3, 0.1
PARAMS = {
    "token_embeddings": jnp.ones((11, 8)),
    "blocks": {"q_proj": jnp.ones((2, 8, 2, 4)), "o_proj": jnp.ones((2, 2, 4, 8)), "down_proj": jnp.ones((2, 6, 8)),
               "ln": jnp.ones((2, 8)), "q_bias": jnp.ones((2, 2, 4)), "o_bias": None},  # None: a bias left out
    "lm_head": jnp.ones((11, 8)),
}
AXES = {
    "token_embeddings": P("vocab", "embed"),
    "blocks": {"q_proj": P("layers", "embed", "heads", "head_dim"), "o_proj": P("layers", "heads", "head_dim", "embed"),
               "down_proj": P("layers", "mlp", "embed"), "ln": P("layers", "embed"),
               "q_bias": P("layers", "heads", "head_dim"), "o_bias": None},
    "lm_head": P("vocab", "embed"),
}


def ours(kind: str, **extra):
    cfg = from_dict(OptimizerConfig, {"type": kind, "learning_rate": LR, "weight_decay": WD, "lr_schedule": "constant",
                                      "warmup": 0, "max_grad_norm": None, **extra})
    return cfg.build(100, weight_decay_mask(PARAMS, AXES), param_axes=AXES)


def _grads(seed):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), PARAMS)


def assert_same_steps(tx, ref, steps=3, rtol=2e-5, atol=1e-7):
    params_a = params_b = jax.tree.map(lambda p: p * 0.5, PARAMS)
    sa, sb = tx.init(params_a), ref.init(params_b)
    for step in range(steps):
        g = _grads(step)
        ua, sa = tx.update(g, sa, params_a)
        ub, sb = ref.update(g, sb, params_b)
        for a, b in zip(jax.tree.leaves(ua), jax.tree.leaves(ub), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)
        params_a, params_b = optax.apply_updates(params_a, ua), optax.apply_updates(params_b, ub)


def test_lion_is_optax_lion():
    mask = weight_decay_mask(PARAMS, AXES)
    assert_same_steps(ours("lion", beta1=0.9, beta2=0.99), optax.lion(LR, b1=0.9, b2=0.99, weight_decay=WD, mask=mask))


def test_adafactor_is_optax_adafactor():
    mask = weight_decay_mask(PARAMS, AXES)
    ref = optax.chain(optax.adafactor(LR, multiply_by_parameter_scale=False, clipping_threshold=None),
                      optax.masked(optax.add_decayed_weights(-LR * WD), mask))  # decoupled decay, rate x lr
    assert_same_steps(ours("adafactor"), ref)


def test_muon_is_optax_muon_on_the_blocks_matrices():
    dims = {"token_embeddings": None, "lm_head": None,
            "blocks": {"q_proj": MuonDimensionNumbers((1,), (2, 3)), "o_proj": MuonDimensionNumbers((1, 2), (3,)),
                       "down_proj": MuonDimensionNumbers((1,), (2,)), "ln": None, "q_bias": None,
                       "o_bias": None}}
    assert muon_dimensions(AXES) == dims
    mask = weight_decay_mask(PARAMS, AXES)
    ref = optax.chain(optax.contrib.muon(LR, beta=0.9, adam_b1=0.9, adam_b2=0.95, adam_learning_rate=1e-3,
                                         muon_weight_dimension_numbers=dims),
                      optax.masked(optax.add_decayed_weights(-LR * WD), mask))
    assert_same_steps(ours("muon", momentum=0.9, adam_lr=1e-3), ref, rtol=1e-4, atol=1e-6)


def test_muon_orthogonalizes_each_layers_matrix():
    """Independently of Optax: Muon's first step on a [layers, in, out] matrix is, per layer, near
    an orthogonal matrix's direction (singular values clustered around 1, Newton-Schulz's band)."""
    tx = ours("muon", momentum=0.9)
    params = jax.tree.map(lambda p: p * 0.5, PARAMS)
    upd, _ = tx.update(_grads(7), tx.init(params), params)
    down = np.asarray(upd["blocks"]["down_proj"]) / -LR
    for layer in down:
        sv = np.linalg.svd(layer - WD * 0.5, compute_uv=False)  # the decoupled decay of 0.5-valued weights removed
        assert 0.5 < sv.min() and sv.max() < 1.5, sv


def test_type_spellings_and_fingerprints():
    with pytest.raises(ConfigError) as err:
        load_config(None, {"optimizer.type": "sophia-g"})
    assert "did you mean 'sophia-h'" in str(err.value) and "\n" not in str(err.value)
    assert load_config(None, {"optimizer.type": "sophiah"}).optimizer.type == "sophia-h"
    assert semantic_view(load_config(None, {"optimizer.type": "adamw"})) == semantic_view(load_config(None))
    assert semantic_view(load_config(None, {"optimizer.type": "lion"})) != semantic_view(load_config(None))


# --- Sophia-H: a NumPy transcription of the paper's update (Levanter's variant) -------------------


def _quadratic(n: int, seed: int = 3):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(n, n))
    a = q @ q.T / n + np.diag(rng.uniform(0.5, 2.0, n))  # symmetric positive definite: the Hessian
    return a, rng.normal(size=n)


def test_hutchinson_estimate_is_the_hessian_diagonal_on_average():
    from lm_pipeline.train.sophia import hutchinson_diagonal

    a, c = _quadratic(6)
    f = lambda p: 0.5 * p["x"] @ (jnp.asarray(a, jnp.float32) @ p["x"]) + jnp.asarray(c, jnp.float32) @ p["x"]  # noqa: E731
    params = {"x": jnp.ones(6, jnp.float32)}
    keys = jax.random.split(jax.random.key(1), 3000)
    est = np.asarray(jax.jit(jax.vmap(lambda k: hutchinson_diagonal(f, params, k)["x"]))(keys)).mean(0)
    np.testing.assert_allclose(est, np.diag(a), rtol=0.12)


def test_sophia_h_is_the_papers_update_step_for_step():
    """Lr, beta1, beta2, gamma, epsilon, the interval, bias correction and the clip as the paper (with
    Levanter's bias-corrected momentum); the Gaussian probes, drawn as the optimizer draws them, are
    the one shared input, and the Hessian-vector product is the exact A @ u."""
    shapes = {"b": (5,), "w": (3, 4)}
    n = 17
    a, c = _quadratic(n)
    # gamma large enough that, once h holds an estimate, most coordinates' steps m / (gamma h) fall
    # inside the clip: the preconditioner (and when h is updated) decides the values, not the sign
    lr, b1, b2, gamma, eps, every = 0.05, 0.96, 0.99, 300.0, 1e-12, 3

    def flat(p):
        return jnp.concatenate([p["b"], p["w"].reshape(-1)])

    def obj(p):
        x = flat(p)
        return 0.5 * x @ (jnp.asarray(a, jnp.float32) @ x) + jnp.asarray(c, jnp.float32) @ x

    cfg = from_dict(OptimizerConfig, {"type": "sophia-h", "learning_rate": lr, "weight_decay": 0.0, "gamma": gamma,
                                      "update_interval": every, "lr_schedule": "constant", "warmup": 0,
                                      "max_grad_norm": None})
    assert (cfg.beta1, cfg.beta2, cfg.epsilon) == (b1, b2, eps)  # Levanter's Sophia-H defaults
    tx = cfg.build(100, None)
    params = {"b": jnp.linspace(-1, 1, 5, dtype=jnp.float32), "w": jnp.linspace(1, -2, 12, dtype=jnp.float32).reshape(3, 4)}
    state = tx.init(params)
    x = np.asarray(flat(params), np.float64)
    m, h, key = np.zeros(n), np.zeros(n), jax.random.key(0)
    inside = 0
    for t in range(1, 14):
        g = jax.grad(obj)(params)
        upd, state = tx.update(g, state, params, obj_fn=obj)
        params = optax.apply_updates(params, upd)
        # the reference
        grad = a @ x + c
        m = b1 * m + (1 - b1) * grad
        raw = m / (1 - b1 ** t) / np.maximum(gamma * h, eps)
        inside += int((np.abs(raw) < 0.9).sum())
        step = np.clip(raw, -1, 1)
        if t % every == 0:
            key, nxt = jax.random.split(key)
            ks = jax.random.split(key, 2)
            u = np.concatenate([np.asarray(jax.random.normal(k, shapes[name], jnp.float32), np.float64).reshape(-1)
                                for k, name in zip(ks, ("b", "w"), strict=True)])
            h = b2 * h + (1 - b2) * u * (a @ u)
            key = nxt
        x = x - lr * step
        np.testing.assert_allclose(np.asarray(flat(params)), x, rtol=1e-4, atol=1e-5, err_msg=f"step {t}")
    assert inside >= 3 * n, f"only {inside} unclipped coordinate steps: the Hessian term is not exercised"
