"""Training core against independent references: a chat source's loss mask under gradient
accumulation (the one-micro-batch step), the evaluation loss over several batches (a NumPy
cross-entropy over the model's logits, weighted by predicted tokens), bad-step skipping of an
outlier gradient (Optax's own Adam fed only the steps that were taken), which mixed-precision
policies use dynamic loss scaling (float16 compute only), the float16 step's gradients divided
by that scale again (the float32 step's gradient norm), and the checkpoint guard (it reads the
parameters, not the optimizer state)."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers.steps import segment_row, train_steps

from lm_pipeline.batch import LmBatch
from lm_pipeline.config import load_config
from lm_pipeline.schema import from_dict
from lm_pipeline.train.checkpoint import CheckpointerConfig, latest_checkpoint
from lm_pipeline.train.guard import FiniteStateCheckpointer
from lm_pipeline.train.optim import skipped_steps
from lm_pipeline.train.optim_config import OptimizerConfig
from lm_pipeline.train.precision import parse_mp
from lm_pipeline.train.sharding import make_mesh
from lm_pipeline.train.trainer import TrainState, build_step_functions, evaluate_datasets, put_batch

TINY = {
    "model.type": "llama", "model.seq_len": 32, "model.hidden_dim": 32, "model.num_heads": 4, "model.num_kv_heads": 2,
    "model.intermediate_dim": 64, "model.num_layers": 2, "model.gradient_checkpointing": False,
    "trainer.progress": False, "trainer.mp": "f32", "trainer.train_batch_size": 16,
    "optimizer.learning_rate": 1e-2, "optimizer.warmup": 0, "optimizer.weight_decay": 0.1,
}


def _masked_batches(steps: int, rows: int, seq_len: int = 32, vocab: int = 64) -> list[LmBatch]:
    """Packed rows (segment ids, trailing padding) whose loss masks differ row by row: some rows
    train on a short span only, others on most tokens, one on nothing."""
    rng = np.random.default_rng(7)
    out = []
    for _ in range(steps):
        seg = np.zeros((rows, seq_len), np.int32)
        mask = np.zeros((rows, seq_len), np.int32)
        for r in range(rows):
            seg[r] = segment_row(rng, seq_len, (3, 14), 10)
            if r % 5 != 4:  # row 4, 9, 14: no assistant tokens at all
                lo = int(rng.integers(0, seq_len // 2))
                hi = lo + int(rng.integers(1, seq_len // 2)) * (1 + r % 3)
                mask[r, lo:hi] = 1
        mask[seg == 0] = 0
        tokens = rng.integers(0, vocab, (rows, seq_len)).astype(np.int32)
        out.append(LmBatch(tokens, seg, mask))
    return out


def _masked_train(per_device: int, batches: list[LmBatch]):
    return train_steps({**TINY, "trainer.per_device_parallelism": per_device}, batches, has_loss_mask=True)


def test_loss_mask_under_gradient_accumulation_matches_the_one_micro_batch_step():
    """4 micro-batches of 4 rows of a chat batch give the whole batch's loss, gradient norm and
    parameters: each micro-batch's loss mask belongs to its own rows."""
    batches = _masked_batches(2, 16)
    full, m_full = _masked_train(-1, batches)
    accum, m_accum = _masked_train(4, batches)
    for a, b in zip(m_full, m_accum, strict=True):
        assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-5)
        assert a["optim/grad_norm"] == pytest.approx(b["optim/grad_norm"], rel=1e-5)
    for a, b in zip(full, accum, strict=True):
        assert np.linalg.norm(a - b) <= 1e-5 * np.linalg.norm(a)


def test_skipped_outlier_step_leaves_adam_state_as_if_it_never_happened():
    """With ``skip_bad_steps``, an outlier gradient after the EMA's warm-up changes neither the
    parameters nor Adam's moments and count: parameters and moments equal Optax's own
    ``scale_by_adam`` at the schedule's rate, fed only the steps that were taken."""
    lr, b1, b2, eps = 0.1, 0.9, 0.95, 1e-8
    c = from_dict(OptimizerConfig, {"learning_rate": lr, "lr_schedule": "constant", "warmup": 0, "weight_decay": 0.0,
                                    "max_grad_norm": None, "beta1": b1, "beta2": b2, "epsilon": eps,
                                    "skip_bad_steps": True, "skip_warmup_steps": 3, "skip_grad_norm_factor": 5.0})
    params = {"w": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3), "b": jnp.zeros(3)}
    tx = c.build(100, None)
    state = tx.init(params)
    ref = optax.scale_by_adam(b1, b2, eps)
    ref_state, ref_params = ref.init(params), params
    rng = np.random.default_rng(0)
    plan = ["g"] * 6 + ["spike"] + ["g"] * 3
    for kind in plan:
        g = {k: jnp.asarray(rng.normal(0.3, 0.05, v.shape), jnp.float32) for k, v in params.items()}
        if kind == "spike":
            g = jax.tree.map(lambda x: x * 100.0, g)
        updates, state = tx.update(g, state, params, loss=jnp.float32(1.0))
        params = optax.apply_updates(params, updates)
        if kind == "g":
            u, ref_state = ref.update(g, ref_state, ref_params)
            ref_params = jax.tree.map(lambda p, d: p - lr * d, ref_params, u)
    assert int(skipped_steps(state)) == 1 and int(state.step) == len(plan)
    adam = state.inner[0]
    assert int(adam.count) == int(ref_state.count) == plan.count("g")
    for got, want in ((adam.mu, ref_state.mu), (adam.nu, ref_state.nu), (params, ref_params)):
        for k in ("w", "b"):
            np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(("spec", "scaled"), [
    ("f32", False), ("bf16", False), ("p=f32,c=bfloat16", False), ("p=f32,c=f32,m=bf16", False),
    ("f16", True), ("p=f32,c=float16", True), ("p=f32,c=f16,o=f32", True),
])
def test_only_float16_compute_uses_dynamic_loss_scaling(spec, scaled):
    """Loss scaling belongs to float16 compute (its narrow exponent); bf16 and f32 never scale."""
    precision = parse_mp(spec)
    assert precision.uses_loss_scaling is scaled
    assert (np.dtype(precision.compute) == np.float16) is scaled


def _state(model, opt_state) -> TrainState:
    return TrainState(jnp.int32(3), model, opt_state, jax.random.key_data(jax.random.key(0)))


def test_checkpoint_guard_reads_the_parameters_not_the_optimizer_state(tmp_path):
    """A non-finite parameter refuses the save (nothing written); a non-finite optimizer entry with
    finite parameters is saved (only the parameters are the guard's business)."""
    ck = FiniteStateCheckpointer(CheckpointerConfig(), base_path_override=tmp_path / "a", async_save=False)
    bad_params = _state({"w": jnp.asarray([1.0, jnp.nan])}, {"mu": jnp.zeros(2)})
    with pytest.raises(FloatingPointError, match="non-finite parameters"):
        ck.save(3, bad_params)
    assert latest_checkpoint(tmp_path / "a") is None
    ck2 = FiniteStateCheckpointer(CheckpointerConfig(), base_path_override=tmp_path / "b", async_save=False)
    ck2.save(3, _state({"w": jnp.asarray([1.0, 2.0])}, {"mu": jnp.asarray([jnp.inf, 0.0])}))
    assert latest_checkpoint(tmp_path / "b") is not None


class _Rows:
    """Packed validation rows (tokens and segment ids) read by index."""

    def __init__(self, tokens: np.ndarray, seg: np.ndarray):
        self.tokens, self.seg = tokens, seg

    def __len__(self) -> int:
        return len(self.tokens)

    def get_many(self, indices) -> LmBatch:
        idx = np.asarray(indices)
        return LmBatch(self.tokens[idx], self.seg[idx], None)


def test_evaluation_loss_is_token_weighted_over_its_batches():
    """Three eval batches holding very different numbers of predicted tokens (full rows, then
    rows that are mostly padding): the reported loss is the NumPy cross-entropy of the model's
    logits summed over every predicted token of every batch, over their count."""
    cfg = load_config(None, TINY)
    plan = make_mesh(cfg.trainer, jax.devices()[:1])
    fns = build_step_functions(cfg.model, cfg.optimizer, cfg.trainer, vocab_size=64, num_train_steps=10, plan=plan,
                               has_segments=True)
    state = fns.init(jax.random.key_data(jax.random.key(0)))
    rng = np.random.default_rng(3)
    rows, t = 12, 32
    tokens = rng.integers(0, 64, (rows, t)).astype(np.int32)
    seg = np.zeros((rows, t), np.int32)
    for r in range(rows):
        length = t if r < 4 else (t // 2 if r < 8 else 3)  # batch 0 full, 1 half, 2 almost all padding
        seg[r, :length] = 1 + (np.arange(length) >= length // 2)  # two documents
    res = evaluate_datasets(fns, state, {"v": _Rows(tokens, seg)}, plan, batch_size=4)

    static = eqx.partition(cfg.model.build(64, key=jax.random.key(0)), eqx.is_array)[1]
    model = eqx.combine(state.model, static)
    logits = np.asarray(model(jnp.asarray(tokens), jnp.asarray(seg), key=None, inference=True), np.float64)
    nats, count = 0.0, 0
    for b in range(rows):
        for i in range(t - 1):
            if seg[b, i + 1] == 0 or seg[b, i + 1] != seg[b, i]:
                continue
            z = logits[b, i]
            nats += z.max() + np.log(np.exp(z - z.max()).sum()) - z[tokens[b, i + 1]]
            count += 1
    assert res["v"]["tokens"] == count
    assert res["v"]["loss"] == pytest.approx(nats / count, rel=1e-5)


def test_float16_step_reports_unscaled_gradients():
    """float16 compute multiplies the loss by the dynamic loss scale; the gradients the optimizer
    sees (and ``optim/grad_norm``) are divided by it again. Overflowing steps change nothing and
    halve the scale, so the first step taken is at the initial parameters: its gradient norm is
    the float32 step's there, whatever the scale has become."""
    batch = _masked_batches(1, 16)[0]._replace(loss_mask=None)
    norms = {}
    for mp in ("f32", "p=f32,c=f16"):
        cfg = load_config(None, {**TINY, "trainer.mp": mp})
        plan = make_mesh(cfg.trainer, jax.devices()[:1])
        fns = build_step_functions(cfg.model, cfg.optimizer, cfg.trainer, vocab_size=64, num_train_steps=40, plan=plan,
                                   has_segments=True)
        state = fns.init(jax.random.key_data(jax.random.key(0)))
        for _ in range(30):
            state, m = fns.train_step(state, *put_batch(batch, plan))
            m = {k: float(v) for k, v in m.items()}
            if m["optim/skipped_steps"] == int(state.step) - 1:  # this step was taken
                break
        norms[mp] = m["optim/grad_norm"]
        if mp != "f32":
            assert m["optim/loss_scale"] == 2.0**15 / 2.0 ** m["optim/skipped_steps"]
    assert np.isfinite(norms["p=f32,c=f16"])
    assert norms["p=f32,c=f16"] == pytest.approx(norms["f32"], rel=2e-2)
