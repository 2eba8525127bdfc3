"""Levanter's config features that change training, each against an independent reference: the
z-loss against a NumPy computation from the logits, norms without a weight against a NumPy RMSNorm
and against transformers' Llama, the epoch cap against the hand-computed step count; and the
spellings that map onto fields here (data.shuffle, gradient_checkpointing names, rope: default,
initialize_from_hf: true, epoch, z_loss_weight), written in the shapes of Levanter's configs."""

import math

import numpy as np
import pytest

from lm_pipeline.config import load_config
from lm_pipeline.fingerprint import semantic_view
from lm_pipeline.schema import ConfigError

LLAMA = {"model.type": "llama", "model.hidden_dim": 32, "model.intermediate_dim": 64, "model.num_heads": 4,
         "model.num_kv_heads": 2, "model.num_layers": 2, "model.seq_len": 16}


@pytest.mark.parametrize("value, shuffle, era", [(True, "epoch", 4096), (10000, "era", 10000), (7, "era", 7)])
def test_levanter_shuffle_spellings(value, shuffle, era):
    data = load_config(None, {"data.shuffle": value}).data
    assert (data.shuffle, data.era_length) == (shuffle, era)


def test_levanter_shuffle_false_and_enforce_eos_false_are_refused_in_one_message():
    with pytest.raises(ConfigError) as err:
        load_config(None, {"data.shuffle": False})
    assert "Levanter's `data.shuffle: false`" in str(err.value)
    with pytest.raises(ConfigError, match="enforce_eos: false"):
        load_config(None, {"data.enforce_eos": False})
    assert semantic_view(load_config(None, {"data.enforce_eos": True})) == semantic_view(load_config(None))


@pytest.mark.parametrize("name, on", [("nested", True), ("offload", True), ("recompute", True), ("save_all", False)])
def test_gradient_checkpointing_policy_names(name, on):
    assert load_config(None, {"model.gradient_checkpointing": name}).model.gradient_checkpointing is on
    assert load_config(None, {**LLAMA, "model.gradient_checkpointing": name}).model.gradient_checkpointing is on


def test_rope_default_is_rope_theta():
    cfg = load_config(None, {**LLAMA, "model.rope": {"type": "default", "theta": 500000, "factor": 1.0}})
    assert cfg.model.rope_theta == 500000 and cfg.model.rope_scaling is None
    with pytest.raises(ConfigError, match="Levanter's `model.rope`"):
        load_config(None, {"model.rope": {"type": "yarn", "factor": 4.0}})  # GPT-2: learned positions


def test_top_level_epoch_z_loss_and_initialize_from_hf_true(tmp_path):
    cfg = load_config(None, {"epoch": 3, "z_loss_weight": "5e-6"})
    assert cfg.trainer.max_epochs == 3 and cfg.trainer.z_loss_weight == pytest.approx(5e-6)
    assert load_config(None, {"epoch": 0}).trainer.max_epochs is None  # Levanter: 0 = no cap
    from lm_pipeline.hf.tiny import make_tiny_hf_model

    hf = make_tiny_hf_model(str(tmp_path / "hf"), "llama", seq_len=32)
    cfg = load_config(None, {"initialize_from_hf": True, "use_hf_model_config": True, "model.type": "llama",
                             "model.reference_checkpoint": hf})
    assert cfg.initialize_from_hf == hf and cfg.model.type == "llama"
    with pytest.raises(ConfigError, match="model.reference_checkpoint"):
        load_config(None, {"initialize_from_hf": True})


def test_new_fields_enter_the_fingerprint_only_when_set():
    base = semantic_view(load_config(None, LLAMA))
    assert semantic_view(load_config(None, {**LLAMA, "model.use_layer_norm_weight": True})) == base
    assert semantic_view(load_config(None, {**LLAMA, "z_loss_weight": 0.0})) == base
    for change in ({"model.use_layer_norm_weight": False}, {"z_loss_weight": 1e-4}, {"epoch": 2}):
        assert semantic_view(load_config(None, {**LLAMA, **change})) != base, change


def test_the_epoch_cap_in_steps():
    tc = load_config(None, {"trainer.num_train_steps": 1000, "trainer.train_batch_size": 8, "epoch": 3}).trainer
    assert tc.resolve_num_steps(100, 16) == math.ceil(3 * 100 / 8)  # 38: the cap comes first
    assert tc.resolve_num_steps(10_000, 16) == 1000  # the run's length comes first


def _tiny_llama(**extra):
    import jax

    cfg = load_config(None, {**LLAMA, **extra}).model
    return cfg, cfg.build(64, key=jax.random.PRNGKey(0))


def test_z_loss_objective_is_cross_entropy_plus_weighted_squared_logsumexp():
    import jax.numpy as jnp

    from lm_pipeline.train.loss import training_loss_sums

    _, model = _tiny_llama()
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 16)), jnp.int32)
    w = 1e-2
    obj, ce, n = training_loss_sums(model, tokens, None, key=None, inference=True, z_loss_weight=w)
    logits = np.asarray(model(tokens, None, key=None, inference=True), np.float64)[:, :-1]
    targets = np.asarray(tokens)[:, 1:]
    m = logits.max(-1, keepdims=True)
    lse = (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))[..., 0]
    ref_ce = (lse - np.take_along_axis(logits, targets[..., None], -1)[..., 0]).sum()
    assert float(n) == targets.size
    assert float(ce) == pytest.approx(ref_ce, rel=1e-5)
    assert float(obj) == pytest.approx(ref_ce + w * (lse ** 2).sum(), rel=1e-5)
    obj0, ce0, _ = training_loss_sums(model, tokens, None, key=None, inference=True)
    assert float(obj0) == float(ce0) == pytest.approx(ref_ce, rel=1e-5)


def test_rms_norm_without_weight_ignores_its_weight():
    import jax.numpy as jnp

    from lm_pipeline.models.layers import RmsNorm

    x = np.random.default_rng(1).normal(size=(3, 8)).astype(np.float32)
    ref = x / np.sqrt((x ** 2).mean(-1, keepdims=True) + 1e-6)
    norm = RmsNorm(8, 1e-6, use_weight=False)
    norm = type(norm).__new__(type(norm))
    object.__setattr__(norm, "weight", jnp.full((8,), 3.0))
    object.__setattr__(norm, "eps", 1e-6)
    object.__setattr__(norm, "use_weight", False)
    np.testing.assert_allclose(np.asarray(norm(jnp.asarray(x))), ref, rtol=1e-5, atol=1e-6)
    with_weight = RmsNorm(8, 1e-6)
    object.__setattr__(with_weight, "weight", jnp.full((8,), 3.0))
    np.testing.assert_allclose(np.asarray(with_weight(jnp.asarray(x))), 3 * ref, rtol=1e-5, atol=1e-6)


def test_llama_without_norm_weights_matches_transformers(tmp_path):
    """Trained a few steps without norm weights, the model's norms stay at ones, and its export
    gives transformers' logits (transformers' norms always scale: by ones, here)."""
    import jax
    import jax.numpy as jnp
    import torch
    import transformers

    from lm_pipeline.models.hf_mapping import hf_config, to_hf_state_dict

    cfg, model = _tiny_llama(**{"model.use_layer_norm_weight": False})
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 64, (2, 16)), jnp.int32)

    def loss(m):
        return jnp.mean(m(tokens, None, key=None, inference=True) ** 2)

    for _ in range(2):  # a plain gradient step moves every weight the loss reads
        grads = jax.grad(loss)(model)
        model = jax.tree.map(lambda p, g: p - 0.5 * g, model, grads)
    norms = [model.norm.weight, model.blocks.input_layernorm.weight, model.blocks.post_attention_layernorm.weight]
    assert all(np.all(np.asarray(w) == 1.0) for w in norms)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_config(cfg, 64)))
    hf.load_state_dict({k: torch.tensor(np.asarray(v)) for k, v in to_hf_state_dict(model, cfg).items()}, strict=False)
    hf.eval()
    with torch.no_grad():
        ref = hf(torch.tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(np.asarray(model(tokens, None, key=None, inference=True)), ref, atol=2e-4, rtol=1e-4)


def test_weight_average_is_the_numpy_ema_of_the_weights_after_each_step():
    import jax
    import jax.numpy as jnp
    import optax

    from lm_pipeline.schema import from_dict
    from lm_pipeline.train.optim import AveragedState, averaged_params
    from lm_pipeline.train.optim_config import OptimizerConfig

    beta = 0.8
    cfg = from_dict(OptimizerConfig, {"learning_rate": 0.1, "warmup": 0, "lr_schedule": "constant", "ema_beta": beta})
    params = {"w": jnp.asarray(np.arange(6.0).reshape(2, 3), jnp.float32), "b": jnp.ones(3, jnp.float32)}
    tx = cfg.build(10, None)
    state = tx.init(params)
    ref = {k: np.asarray(v, np.float64) for k, v in params.items()}
    rng = np.random.default_rng(0)
    for _ in range(4):
        grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        ref = {k: beta * ref[k] + (1 - beta) * np.asarray(params[k], np.float64) for k in ref}
    assert isinstance(state, AveragedState)
    for k in ref:
        np.testing.assert_allclose(np.asarray(averaged_params(state, params)[k]), ref[k], rtol=1e-5, atol=1e-6)


def test_levanter_model_averaging_trains_and_evaluation_reads_the_average(tmp_path):
    """trainer.model_averaging as Levanter writes it: the checkpoint keeps the raw weights (to resume)
    and the average; loading for evaluation or export gives the average, not the last weights (the
    average's arithmetic is checked against NumPy above)."""
    from helpers import pipeline as pt

    from lm_pipeline.eval.loading import MODEL_SUBTREE, load_model_from_checkpoint
    from lm_pipeline.steps import Pipeline
    from lm_pipeline.train.checkpoint import load

    cfg = pt.tiny_config(tmp_path)
    cfg["trainer"].update({"num_train_steps": 3, "steps_per_eval": 3, "model_averaging": {"type": "ema", "beta": 0.9}})
    run = Pipeline(load_config(None, list(_flat(cfg).items())), progress=False).train_ckpt()
    step = run.manifest["final_checkpoint"]
    loaded = load_model_from_checkpoint(step)
    assert loaded.config.optimizer.ema_beta == pytest.approx(0.9)
    raw = load(step, loaded.model, subtree=MODEL_SUBTREE)
    gaps = [np.abs(a - b).max() for a, b in zip(jax_leaves(loaded.model), jax_leaves(raw), strict=True)]
    assert max(gaps) > 1e-4  # three steps from the initial weights: the average lags the weights


def jax_leaves(tree):
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _flat(cfg, prefix=""):
    out = {}
    for k, v in cfg.items():
        if isinstance(v, dict) and k in ("data", "model", "trainer", "optimizer", "store"):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


ROPES = {
    "llama3": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8, "theta": 500000},
    "yarn": {"type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "original_max_position_embeddings": 8,
             "theta": 10000},
    "linear": {"type": "linear", "factor": 2.0, "theta": 10000},
}


@pytest.mark.parametrize("kind", sorted(ROPES))
def test_scaled_rope_matches_transformers(kind):
    """Levanter's model.rope spelling -> our model's logits equal transformers' Llama with the
    exported rope_parameters (and its inverse frequencies equal transformers' own computation)."""
    import jax.numpy as jnp
    import torch
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from lm_pipeline.models.hf_mapping import hf_config, to_hf_state_dict
    from lm_pipeline.models.rope import rope_frequencies

    cfg, model = _tiny_llama(**{"model.rope": ROPES[kind], "model.seq_len": 32})
    assert cfg.rope_scaling.type == kind and cfg.rope_theta == ROPES[kind]["theta"]
    hf_cfg = transformers.LlamaConfig(**hf_config(cfg, 64))
    assert hf_cfg.rope_parameters["rope_type"] == kind
    ref_inv, ref_factor = ROPE_INIT_FUNCTIONS[kind](hf_cfg, "cpu")
    inv, factor = rope_frequencies(cfg.head_size, cfg.rope_theta, cfg.rope_scaling)
    np.testing.assert_allclose(inv, ref_inv.numpy(), rtol=1e-6)
    assert factor == pytest.approx(ref_factor)
    hf = transformers.LlamaForCausalLM(hf_cfg)
    hf.load_state_dict({k: torch.tensor(np.asarray(v)) for k, v in to_hf_state_dict(model, cfg).items()}, strict=False)
    hf.eval()
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 64, (2, 32)), jnp.int32)
    with torch.no_grad():
        ref = hf(torch.tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(np.asarray(model(tokens, None, key=None, inference=True)), ref, atol=2e-4, rtol=1e-4)


def test_plain_levanter_rope_adds_no_scaling():
    cfg = load_config(None, {**LLAMA, "model.rope": {"type": "default", "theta": 10000, "factor": 1.0}}).model
    assert cfg.rope_scaling is None and cfg.rope_parameters() == {"rope_type": "default", "rope_theta": 10000}


@pytest.mark.parametrize("kind", sorted(ROPES))
def test_a_scaled_rope_round_trips_through_config_json(kind):
    """What the export writes is read back as the same model config (continued pretraining from a
    Llama 3.1 or YaRN model keeps its rope)."""
    from lm_pipeline.hf.load import config_from_hf
    from lm_pipeline.models.hf_mapping import hf_config

    cfg = load_config(None, {**LLAMA, "model.rope": ROPES[kind]}).model
    assert config_from_hf(hf_config(cfg, 64)) == cfg
    v5 = {k: v for k, v in hf_config(cfg, 64).items() if k not in ("rope_theta", "rope_scaling")}
    assert config_from_hf({**v5, "rope_parameters": cfg.rope_parameters()}) == cfg
