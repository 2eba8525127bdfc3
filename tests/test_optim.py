"""Optimizer config: schedules at their key points, validation, weight-decay mask, AdamW, bad-step skipping."""

from __future__ import annotations

import dataclasses
import math
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from lm_pipeline.schema import ConfigError, from_dict
from lm_pipeline.train.optim import current_lr, skipped_steps, weight_decay_mask
from lm_pipeline.train.optim_config import OptimizerConfig

PEAK = 1.0
MIN = 0.1  # min_lr_ratio * PEAK with the default ratio


def cfg(**kw) -> OptimizerConfig:
    kw.setdefault("learning_rate", PEAK)
    return from_dict(OptimizerConfig, kw)


def lrs(c: OptimizerConfig, n: int, steps) -> np.ndarray:
    sched = jax.jit(c.lr_scheduler(n))
    return np.array([float(sched(jnp.int32(s))) for s in steps])


def approx(x, y, tol=1e-5):
    return np.allclose(x, y, rtol=0, atol=tol)


# --- single cycle ----------------------------------------------------------------------------


def test_defaults_follow_levanter():
    c = OptimizerConfig()
    assert (c.learning_rate, c.weight_decay, c.beta1, c.beta2, c.epsilon) == (1e-4, 0.0, 0.9, 0.95, 1e-8)
    assert (c.max_grad_norm, c.lr_schedule, c.min_lr_ratio, c.warmup) == (1.0, "cosine", 0.1, 0.01)
    assert (c.decay, c.rewarmup, c.cycles, c.cycle_length, c.skip_bad_steps) == (None, 0.0, None, None, False)
    assert all(f.metadata["semantic"] for f in dataclasses.fields(OptimizerConfig))


def test_cosine_warmup_then_decay_to_min():
    c = cfg(warmup=10)
    v = lrs(c, 100, [0, 5, 10, 55, 100, 150])
    assert approx(v, [0.0, 0.5, PEAK, (PEAK + MIN) / 2, MIN, MIN])
    dec = lrs(c, 100, range(10, 101))
    assert np.all(np.diff(dec) <= 1e-7)


def test_warmup_fraction_of_run():
    v = lrs(cfg(warmup=0.1), 200, [0, 10, 20, 200])  # 0.1 * 200 = 20 steps
    assert approx(v, [0.0, 0.5, PEAK, MIN])


@pytest.mark.parametrize(
    "kind,mid",
    [
        ("linear", (PEAK + MIN) / 2),
        ("cosine", (PEAK + MIN) / 2),
        ("inv", PEAK / (1 + (1 / 0.1 - 1) * 0.5)),
        ("inv_sqrt", PEAK / math.sqrt(1 + (1 / 0.1**2 - 1) * 0.5)),
    ],
)
def test_decay_shapes_end_at_min(kind, mid):
    v = lrs(cfg(lr_schedule=kind, warmup=0), 100, [0, 50, 100, 1000])
    assert approx(v, [PEAK, mid, MIN, MIN])


def test_constant_stays_constant_after_warmup():
    v = lrs(cfg(lr_schedule="constant", warmup=10), 100, [0, 5, 10, 11, 50, 99, 100, 500])
    assert approx(v, [0.0, 0.5, PEAK, PEAK, PEAK, PEAK, PEAK, PEAK])


def test_wsd_with_fractions():
    c = cfg(lr_schedule="linear", warmup=0.1, decay=0.2)  # 10 warmup, 70 stable, 20 decay of 100
    (ph,) = c.schedule_phases(100)
    assert (ph.warmup, ph.stable, ph.decay) == (10, 70, 20)
    v = lrs(c, 100, [0, 5, 10, 50, 79, 80, 90, 100])
    assert approx(v, [0.0, 0.5, PEAK, PEAK, PEAK, PEAK, (PEAK + MIN) / 2, MIN])


def test_wsd_with_steps():
    c = cfg(lr_schedule="linear", warmup=5, decay=20)
    (ph,) = c.schedule_phases(100)
    assert (ph.warmup, ph.stable, ph.decay) == (5, 75, 20)
    v = lrs(c, 100, [5, 40, 80, 90, 100])
    assert approx(v, [PEAK, PEAK, PEAK, (PEAK + MIN) / 2, MIN])


def test_int_one_is_a_step_float_one_is_the_cycle():
    assert cfg(warmup=1).schedule_phases(50)[0].warmup == 1
    assert cfg(warmup=0.0, decay=1.0).schedule_phases(50)[0].decay == 50
    assert cfg(warmup=1e3).schedule_phases(5000)[0].warmup == 1000  # YAML 1e3: integral float = steps
    assert cfg(warmup=0.29).schedule_phases(100)[0].warmup == 29  # not 28 from 0.29 * 100 = 28.999...
    assert cfg(warmup=0.015).schedule_phases(100)[0].warmup == 1  # fractions truncate


# --- cycles ----------------------------------------------------------------------------------


def test_cycles_int_minima_and_rewarmup_ramps():
    c = cfg(lr_schedule="linear", warmup=10, cycles=3, rewarmup=5)
    assert c.cycle_ends(300) == [100, 200, 300]
    ph = c.schedule_phases(300)
    assert [(p.start, p.warmup, p.decay, p.end) for p in ph] == [(0, 10, 90, 100), (100, 5, 95, 200), (200, 5, 95, 300)]
    # Each cycle's minimum; the rewarmup starts from it and climbs linearly back to the peak.
    v = lrs(c, 300, [10, 100, 102, 105, 200, 201, 205, 300])
    assert approx(v, [PEAK, MIN, MIN + (PEAK - MIN) * 2 / 5, PEAK, MIN, MIN + (PEAK - MIN) / 5, PEAK, MIN])
    # Decay phases run from the peak to the minimum.
    assert approx(lrs(c, 300, [199]), [PEAK + (MIN - PEAK) * 94 / 95])


def test_cycles_without_rewarmup_jump_back_to_peak():
    c = cfg(lr_schedule="linear", warmup=0, cycles=3)
    v = lrs(c, 300, [0, 99, 100, 199, 200, 299, 300])
    step_down = (PEAK - MIN) / 100
    assert approx(v, [PEAK, MIN + step_down, PEAK, MIN + step_down, PEAK, MIN + step_down, MIN])


def test_cycles_list_are_the_minima():
    c = cfg(lr_schedule="cosine", warmup=10, cycles=[50, 120], rewarmup=0.1)
    assert c.cycle_ends(200) == [50, 120, 200]
    ph = c.schedule_phases(200)
    assert [(p.start, p.warmup, p.end) for p in ph] == [(0, 10, 50), (50, 7, 120), (120, 8, 200)]
    v = lrs(c, 200, [10, 50, 57, 120, 128, 200])
    assert approx(v, [PEAK, MIN, PEAK, MIN, PEAK, MIN])


def test_cycle_length_int_fraction_and_list():
    assert cfg(cycle_length=50).cycle_ends(200) == [50, 100, 150, 200]
    assert cfg(cycle_length=0.25).cycle_ends(200) == [50, 100, 150, 200]
    assert cfg(cycle_length=60).cycle_ends(200) == [60, 120, 200]  # the last cycle absorbs the rest
    assert cfg(cycle_length=[30, 70]).cycle_ends(200) == [30, 100, 200]
    v = lrs(cfg(lr_schedule="linear", warmup=0, cycle_length=[30, 70], rewarmup=1), 200, [30, 31, 100, 200])
    assert approx(v, [MIN, PEAK, MIN, MIN])


def test_cycles_and_cycle_length_together_is_an_error():
    with pytest.raises(ConfigError) as e:
        cfg(cycles=3, cycle_length=100)
    assert e.value.path == "cycle_length"
    assert "cycles" in str(e.value)


# --- validation ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw,path",
    [
        ({"warmup": 0.5, "decay": 0.6}, "decay"),
        ({"min_lr_ratio": 1.5}, "min_lr_ratio"),
        ({"lr_schedule": "inv", "min_lr_ratio": 0.0}, "min_lr_ratio"),
        ({"lr_schedule": "cosin"}, "lr_schedule"),
        ({"warmup": -1}, "warmup"),
        ({"warmup": 2.5}, "warmup"),
        ({"beta2": 1.0}, "beta2"),
        ({"max_grad_norm": 0.0}, "max_grad_norm"),
        ({"cycles": [100, 50]}, "cycles"),
        ({"cycles": 0}, "cycles"),
        ({"cycle_length": [10, 0]}, "cycle_length"),
        ({"learning_rate": 0.0}, "learning_rate"),
        ({"skip_grad_norm_factor": 1.0}, "skip_grad_norm_factor"),
    ],
)
def test_validation_names_the_field(kw, path):
    with pytest.raises(ConfigError) as e:
        cfg(**kw)
    assert e.value.path == path


def test_errors_that_need_the_run_length():
    with pytest.raises(ConfigError) as e:
        cfg(warmup=30, decay=80).lr_scheduler(100)
    assert e.value.path == "decay" and "exceed" in e.value.message
    with pytest.raises(ConfigError) as e:
        cfg(cycles=[50, 150]).lr_scheduler(100)
    assert e.value.path == "cycles"
    with pytest.raises(ConfigError) as e:
        cfg(cycle_length=[60, 60]).lr_scheduler(100)
    assert e.value.path == "cycle_length"


def test_levanter_type_key():
    assert cfg(type="adam") == cfg()
    with pytest.raises(ConfigError) as e:
        cfg(type="sgd")
    assert e.value.path == "type"


# --- weight decay mask -----------------------------------------------------------------------


class Tiny(eqx.Module):
    token_embedding: jax.Array
    w_stacked: jax.Array
    norm_stacked: jax.Array
    head: jax.Array
    bias: jax.Array


def tiny():
    return Tiny(jnp.ones((5, 4)), jnp.ones((2, 4, 4)), jnp.ones((2, 4)), jnp.ones((4, 5)), jnp.ones(5))


def tiny_axes(m):
    specs = [P("vocab", "embed"), P("layers", "embed", "mlp"), P("layers", "embed"), P("embed", "vocab"), P("vocab")]
    return eqx.tree_at(lambda t: (t.token_embedding, t.w_stacked, t.norm_stacked, t.head, t.bias), m, specs)


def test_weight_decay_mask_on_a_small_pytree():
    params = {
        "wte": {"embedding": jnp.ones((5, 4))},
        "attn": {"w": jnp.ones((4, 4)), "b": jnp.ones(4), "q_bias": jnp.ones((2, 2))},
        "ln": {"scale": jnp.ones(4)},
        "stack": {"norm": jnp.ones((3, 4)), "mlp": jnp.ones((3, 4, 8))},
    }
    axes = {
        "wte": {"embedding": P("vocab", "embed")},
        "attn": {"w": P("embed", "heads"), "b": P("heads"), "q_bias": P("heads", "head_dim")},
        "ln": {"scale": P("embed")},
        "stack": {"norm": P("layers", "embed"), "mlp": P("layers", "embed", "mlp")},
    }
    assert weight_decay_mask(params, axes) == {
        "wte": {"embedding": False},
        "attn": {"w": True, "b": False, "q_bias": False},  # a 2-axis bias is still a bias
        "ln": {"scale": False},
        "stack": {"norm": False, "mlp": True},
    }


def test_weight_decay_mask_on_an_equinox_module_and_abstract_params():
    m = tiny()
    axes = tiny_axes(m)
    mask = weight_decay_mask(eqx.filter(m, eqx.is_array), axes)
    assert (mask.token_embedding, mask.w_stacked, mask.norm_stacked, mask.head, mask.bias) == (False, True, False, True, False)
    # Shapes only (what a trainer has before allocating), or no params at all: same mask.
    abstract = jax.eval_shape(lambda: m)
    assert weight_decay_mask(abstract, axes) == mask
    with pytest.raises(ValueError, match="one entry per dimension"):
        weight_decay_mask(m, eqx.tree_at(lambda t: t.head, axes, P("embed")))


# --- AdamW -----------------------------------------------------------------------------------


def test_adamw_decays_only_masked_leaves():
    m = tiny()
    params = eqx.filter(m, eqx.is_array)
    mask = weight_decay_mask(params, tiny_axes(m))
    c = cfg(learning_rate=0.1, weight_decay=0.5, warmup=0, lr_schedule="constant")
    tx = c.build(10, mask)
    state = tx.init(params)
    zero = jax.tree.map(jnp.zeros_like, params)
    updates, state = jax.jit(tx.update)(zero, state, params, loss=jnp.float32(1.0))
    new = optax.apply_updates(params, updates)
    factor = 1 - 0.1 * 0.5
    assert np.allclose(new.w_stacked, factor) and np.allclose(new.head, factor)
    assert np.array_equal(new.token_embedding, params.token_embedding)
    assert np.array_equal(new.norm_stacked, params.norm_stacked) and np.array_equal(new.bias, params.bias)
    assert float(current_lr(state)) == pytest.approx(0.1)


# Levanter's rule, written out by name: the weight matrices of the attention and MLP projections
# and an untied LM head decay; embeddings, norm scales and biases never do.
DECAYED = re.compile(r"\.(q|k|v|o|up|gate|down)_proj$|^\.lm_head$")


@pytest.mark.parametrize("model", [
    {"model.type": "gpt2", "model.use_bias": True},
    {"model.type": "llama", "model.tie_word_embeddings": False, "model.num_kv_heads": 1, "model.intermediate_dim": 24},
], ids=["gpt2", "llama"])
def test_real_train_step_with_zero_gradients_decays_exactly_the_matrices(model):
    """The trainer's own step, on a batch that is all padding (no predicted token, so every
    gradient is 0): AdamW's update is then only the decay, p <- p * (1 - lr * wd)."""
    from lm_pipeline.batch import LmBatch
    from lm_pipeline.config import load_config
    from lm_pipeline.train.sharding import make_mesh
    from lm_pipeline.train.trainer import build_step_functions, put_batch

    lr, wd = 0.1, 0.5
    c = load_config(None, {**model, "model.seq_len": 8, "model.hidden_dim": 16, "model.num_heads": 2,
                           "model.num_layers": 2, "trainer.mp": "f32", "trainer.train_batch_size": 2,
                           "optimizer.learning_rate": lr, "optimizer.weight_decay": wd, "optimizer.warmup": 0,
                           "optimizer.lr_schedule": "constant"})
    plan = make_mesh(c.trainer, jax.devices()[:1])
    fns = build_step_functions(c.model, c.optimizer, c.trainer, vocab_size=32, num_train_steps=4, plan=plan,
                               has_segments=True)
    state = fns.init(jax.random.key_data(jax.random.key(0)))
    before = {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(state.model)[0]}
    tokens = np.arange(16, dtype=np.int32).reshape(2, 8)
    state, metrics = fns.train_step(state, *put_batch(LmBatch(tokens, np.zeros_like(tokens)), plan))
    assert float(metrics["optim/grad_norm"]) == 0.0
    after = {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(state.model)[0]}
    assert after.keys() == before.keys()
    decayed = {name for name in before if DECAYED.search(name)}
    kept = set(before) - decayed
    assert len(decayed) >= 5 and any("embedding" in n for n in kept) and any("norm" in n or "ln" in n for n in kept)
    for name in decayed:
        np.testing.assert_allclose(after[name], before[name] * (1 - lr * wd), rtol=1e-6, err_msg=name)
    for name in kept:
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)


def test_gradients_are_clipped_by_global_norm():
    params = {"a": jnp.zeros(3), "b": jnp.zeros(4)}
    g = {"a": jnp.full(3, 3.0), "b": jnp.full(4, 4.0)}
    tx = cfg(max_grad_norm=1.0, warmup=0).build(10, None)
    _, state = jax.jit(tx.update)(g, tx.init(params), params)
    mu = state.inner[1].mu
    norm = math.sqrt(3 * 9 + 4 * 16)
    assert np.allclose(mu["a"], 0.1 * 3.0 / norm) and np.allclose(mu["b"], 0.1 * 4.0 / norm)


def test_state_is_a_pytree_usable_with_tree_map_params():
    params = {"w": jnp.ones((2, 2)), "b": jnp.ones(2)}
    tx = cfg(weight_decay=0.1, skip_bad_steps=True).build(10, {"w": True, "b": False})
    state = tx.init(params)
    tagged = optax.tree_map_params(tx, lambda _: "param", state, transform_non_params=lambda _: "other")
    assert tagged.inner[1].mu == {"w": "param", "b": "param"}
    assert tagged.step == "other" and tagged.skipped == "other"


def test_learning_rate_follows_the_schedule_step_by_step():
    c = cfg(warmup=4, learning_rate=0.5)
    sched = c.lr_scheduler(20)
    params = {"w": jnp.ones(3)}
    tx = c.build(20, None)
    state = tx.init(params)
    update = jax.jit(tx.update)
    for step in range(6):
        _, state = update({"w": jnp.ones(3)}, state, params)
        assert float(current_lr(state)) == pytest.approx(float(sched(step)))


# --- skipping bad steps ----------------------------------------------------------------------


def _skip_setup(**kw):
    params = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3)}
    c = cfg(learning_rate=0.1, warmup=0, lr_schedule="constant", weight_decay=0.1, skip_bad_steps=True, **kw)
    tx = c.build(100, {"w": True, "b": False})
    return params, tx, tx.init(params), jax.jit(tx.update)


def _step(update, params, state, grads, loss=1.0):
    updates, state = update(grads, state, params, loss=jnp.float32(loss))
    return optax.apply_updates(params, updates), state


def _same(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def test_nan_gradient_leaves_params_and_moments_untouched_and_is_counted():
    params, tx, state, update = _skip_setup()
    good = {"w": jnp.full((2, 3), 0.5), "b": jnp.full(3, -0.5)}
    params, state = _step(update, params, state, good)  # a normal step first: moments non-zero
    assert int(skipped_steps(state)) == 0
    bad = {"w": good["w"].at[0, 1].set(jnp.nan), "b": good["b"]}
    new_params, new_state = _step(update, params, state, bad)
    assert _same(new_params, params)
    assert _same(new_state.inner, state.inner)  # mu, nu and Adam's count
    assert int(skipped_steps(new_state)) == 1 and int(new_state.step) == int(state.step) + 1
    # A non-finite loss with finite gradients is skipped too.
    p2, s2 = _step(update, new_params, new_state, good, loss=float("inf"))
    assert _same(p2, new_params) and int(skipped_steps(s2)) == 2
    # And a normal step still updates everything.
    p3, s3 = _step(update, p2, s2, good)
    assert not np.array_equal(p3["w"], p2["w"]) and not np.array_equal(p3["b"], p2["b"])
    assert int(s3.inner[1].count) == 2 and int(skipped_steps(s3)) == 2
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves((p3, s3)))


def test_outlier_grad_norm_is_skipped_after_warmup():
    params, tx, state, update = _skip_setup(skip_warmup_steps=3, skip_grad_norm_factor=5.0)
    g = {"w": jnp.full((2, 3), 0.3), "b": jnp.full(3, 0.3)}
    spike = jax.tree.map(lambda x: x * 100.0, g)
    for _ in range(2):
        params, state = _step(update, params, state, g)
    params, state = _step(update, params, state, spike)  # still warming up the EMA: taken
    assert int(skipped_steps(state)) == 0
    for _ in range(30):
        params, state = _step(update, params, state, g)
    before = params
    params, state = _step(update, params, state, spike)
    assert int(skipped_steps(state)) == 1 and _same(params, before)
    params, state = _step(update, params, state, g)
    assert int(skipped_steps(state)) == 1 and not _same(params, before)


def test_without_skip_bad_steps_nan_propagates_and_nothing_is_counted():
    params = {"w": jnp.ones(3)}
    tx = cfg(warmup=0).build(10, None)
    updates, state = jax.jit(tx.update)({"w": jnp.array([1.0, jnp.nan, 1.0])}, tx.init(params), params, loss=jnp.float32(1.0))
    assert not np.all(np.isfinite(updates["w"]))
    assert int(skipped_steps(state)) == 0
