"""``optimizer.type``: Lion, Adafactor and Muon step for step as Optax's own optimizers (the
independent reference: ``optax.lion``, ``optax.adafactor``, ``optax.contrib.muon`` built here
from their documented arguments), on a small parameter tree with logical axes; Muon's matrices
and axes as read from those axes; Sophia refused in one line; AdamW's fingerprint unchanged."""

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
               "ln": jnp.ones((2, 8)), "q_bias": jnp.ones((2, 2, 4))},
    "lm_head": jnp.ones((11, 8)),
}
AXES = {
    "token_embeddings": P("vocab", "embed"),
    "blocks": {"q_proj": P("layers", "embed", "heads", "head_dim"), "o_proj": P("layers", "heads", "head_dim", "embed"),
               "down_proj": P("layers", "mlp", "embed"), "ln": P("layers", "embed"),
               "q_bias": P("layers", "heads", "head_dim")},
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
                       "down_proj": MuonDimensionNumbers((1,), (2,)), "ln": None, "q_bias": None}}
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


def test_sophia_is_refused_in_one_line_and_adamw_is_adam():
    with pytest.raises(ConfigError) as err:
        load_config(None, {"optimizer.type": "sophia-h", "optimizer.gamma": 0.01})
    assert "Levanter's `optimizer.type: sophia-h`" in str(err.value) and "\n" not in str(err.value)
    assert semantic_view(load_config(None, {"optimizer.type": "adamw"})) == semantic_view(load_config(None))
    assert semantic_view(load_config(None, {"optimizer.type": "lion"})) != semantic_view(load_config(None))
