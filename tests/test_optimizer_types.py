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
    Levanter's bias-corrected momentum); the Gaussian probes, drawn as the optimizer draws them (a fresh
    one per estimate: the key folded with the step), are the one shared input, and the Hessian-vector
    product is the exact A @ u. Run twice: with the objective whole, and as two parts (a batch's two
    micro-batches: A = A1 + A2, c = c1 + c2) whose Hessian-vector products are summed."""
    shapes = {"b": (5,), "w": (3, 4)}
    n = 17
    a, c = _quadratic(n)
    a1 = np.triu(a) * 0.7 + np.tril(a, -1) * 0.7
    a1 = (a1 + a1.T) / 2  # a symmetric part; a2 = a - a1 the other
    a2, c1 = a - a1, c * 0.25
    c2 = c - c1
    # gamma large enough that, once h holds an estimate, most coordinates' steps m / (gamma h) fall
    # inside the clip: the preconditioner (and when h is updated) decides the values, not the sign
    lr, b1, b2, gamma, eps, every = 0.05, 0.96, 0.99, 300.0, 1e-12, 3

    def flat(p):
        return jnp.concatenate([p["b"], p["w"].reshape(-1)])

    def quad(x, aa, cc):
        return 0.5 * x @ (jnp.asarray(aa, jnp.float32) @ x) + jnp.asarray(cc, jnp.float32) @ x

    def obj(p):
        return quad(flat(p), a, c)

    def obj_part(p, i):  # part 0 + part 1 = obj
        return jnp.where(i == 0, quad(flat(p), a1, c1), quad(flat(p), a2, c2))

    cfg = from_dict(OptimizerConfig, {"type": "sophia-h", "learning_rate": lr, "weight_decay": 0.0, "gamma": gamma,
                                      "update_interval": every, "lr_schedule": "constant", "warmup": 0,
                                      "max_grad_norm": None})
    assert (cfg.beta1, cfg.beta2, cfg.epsilon) == (b1, b2, eps)  # Levanter's Sophia-H defaults
    for parts in (None, 2):
        tx = cfg.build(100, None)
        params = {"b": jnp.linspace(-1, 1, 5, dtype=jnp.float32),
                  "w": jnp.linspace(1, -2, 12, dtype=jnp.float32).reshape(3, 4)}
        state = tx.init(params)
        extra = {"obj_fn": obj} if parts is None else {"obj_fn": obj_part, "obj_parts": parts}

        @jax.jit  # one compiled step, as the trainer runs it (13 eager steps take ~10 s on 2 cores)
        def opt_step(params, state):
            upd, state = tx.update(jax.grad(obj)(params), state, params, **extra)  # noqa: B023 - called in this iteration
            return optax.apply_updates(params, upd), state

        x = np.asarray(flat(params), np.float64)
        m, h, key = np.zeros(n), np.zeros(n), jax.random.key(0)
        inside, probes = 0, []
        for t in range(1, 14):
            params, state = opt_step(params, state)
            # the reference
            grad = a @ x + c
            m = b1 * m + (1 - b1) * grad
            raw = m / (1 - b1 ** t) / np.maximum(gamma * h, eps)
            inside += int((np.abs(raw) < 0.9).sum())
            step = np.clip(raw, -1, 1)
            if t % every == 0:
                ks = jax.random.split(jax.random.fold_in(key, t), 2)
                u = np.concatenate([np.asarray(jax.random.normal(k, shapes[name], jnp.float32), np.float64).reshape(-1)
                                    for k, name in zip(ks, ("b", "w"), strict=True)])
                probes.append(u)
                h = b2 * h + (1 - b2) * u * (a @ u)
            x = x - lr * step
            np.testing.assert_allclose(np.asarray(flat(params)), x, rtol=1e-4, atol=1e-5,
                                       err_msg=f"step {t}, parts {parts}")
        assert inside >= 3 * n, f"only {inside} unclipped coordinate steps: the Hessian term is not exercised"
        assert len(probes) == 4 and all(np.abs(p - q).max() > 0.1 for i, p in enumerate(probes) for q in probes[:i])


def test_sophia_h_draws_a_fresh_probe_for_each_estimate():
    """Read off the probes themselves, whatever the key scheme: with f = |x|^2 / 2 (H = I) and beta2 = 0,
    h after an estimate is u * u exactly; two estimates (steps 1 and 2), with or without the trainer's
    per-step probe key, hold different probes."""
    from lm_pipeline.train.sophia import SophiaState, scale_by_sophia_h

    params = {"x": jnp.ones(64, jnp.float32)}
    obj = lambda p: 0.5 * jnp.sum(p["x"] ** 2)  # noqa: E731
    for keyed in (False, True):
        tx = scale_by_sophia_h(0.9, 0.0, 1e-12, 1.0, 1)
        state, seen = tx.init(params), []
        for step in range(3):
            extra = {"probe_key": jax.random.fold_in(jax.random.key(7), step)} if keyed else {}
            _, state = tx.update(jax.grad(obj)(params), state, params, obj_fn=obj, **extra)
            assert isinstance(state, SophiaState)
            seen.append(np.asarray(state.h["x"]))
        assert all(np.all(u2 > 0) for u2 in seen)  # u * u: an estimate was taken each step
        for i in range(3):
            for j in range(i):
                assert np.abs(seen[i] - seen[j]).max() > 0.1, (keyed, i, j)


def _packed_batches(steps: int, rows: int, seq_len: int = 32, vocab: int = 64):
    """Random documents packed into rows with segment ids and trailing padding (id 0): the
    micro-batches of a step hold different numbers of predicted tokens."""
    from lm_pipeline.batch import LmBatch

    rng = np.random.default_rng(1)
    out = []
    for _ in range(steps):
        seg = np.zeros((rows, seq_len), np.int32)
        for r in range(rows):
            pos, doc, end = 0, 1, seq_len - int(rng.integers(0, 16))
            while pos < end:
                k = int(rng.integers(2, 14))
                seg[r, pos : min(pos + k, end)] = doc
                pos, doc = pos + k, doc + 1
        out.append(LmBatch(rng.integers(0, vocab, (rows, seq_len)).astype(np.int32), seg))
    return out


def _sophia_run(per_device: int, batches):
    from lm_pipeline.train.sharding import make_mesh
    from lm_pipeline.train.sophia import SophiaState
    from lm_pipeline.train.trainer import build_step_functions, put_batch

    cfg = load_config(None, {
        "model.type": "llama", "model.seq_len": 32, "model.hidden_dim": 32, "model.num_heads": 4,
        "model.num_kv_heads": 2, "model.intermediate_dim": 64, "model.num_layers": 2,
        "model.gradient_checkpointing": False, "trainer.mp": "f32", "trainer.train_batch_size": 16,
        "trainer.per_device_parallelism": per_device, "trainer.progress": False, "optimizer.type": "sophia-h",
        "optimizer.learning_rate": 1e-2, "optimizer.warmup": 0, "optimizer.update_interval": 1,
        "optimizer.gamma": 1e-4, "optimizer.weight_decay": 0.0})
    plan = make_mesh(cfg.trainer, jax.devices()[:1])
    fns = build_step_functions(cfg.model, cfg.optimizer, cfg.trainer, vocab_size=64, num_train_steps=10, plan=plan,
                               has_segments=True)
    assert fns.accumulation_steps == (1 if per_device == -1 else 16 // per_device)
    state = fns.init(jax.random.key_data(jax.random.key(0)))
    hs = []
    for b in batches:
        state, _ = fns.train_step(state, *put_batch(b, plan))
        soph = [s for s in jax.tree.leaves(state.opt_state, is_leaf=lambda x: isinstance(x, SophiaState))
                if isinstance(s, SophiaState)]
        hs.append([np.asarray(x, np.float64) for x in jax.tree.leaves(soph[0].h)])
    return [np.asarray(x, np.float64) for x in jax.tree.leaves(state.model)], hs


@pytest.mark.slow  # two Sophia-H train steps compiled (about 45 s on a 2-core Xeon)
def test_sophia_h_with_accumulation_estimates_the_hessian_on_the_whole_batch():
    """Three steps, an estimate each: 4 micro-batches of 4 rows (packed rows of unequal token counts)
    give the full batch's Hessian estimate (the same probe, the token-weighted mean over the batch) and
    the same parameters as one micro-batch of 16 rows."""
    batches = _packed_batches(3, 16)
    full, h_full = _sophia_run(-1, batches)
    accum, h_accum = _sophia_run(4, batches)
    for step, (hf, ha) in enumerate(zip(h_full, h_accum, strict=True)):
        assert sum(np.abs(x).sum() for x in hf) > 0, step  # an estimate was taken
        for a, b in zip(hf, ha, strict=True):
            assert np.linalg.norm(a - b) <= 1e-4 * np.linalg.norm(a) + 1e-12, step
    for a, b in zip(full, accum, strict=True):
        assert np.linalg.norm(a - b) <= 1e-4 * np.linalg.norm(a)


@pytest.mark.slow  # a Sophia-H train step compiled (about 35 s on a 2-core Xeon)
def test_the_trainers_sophia_h_probe_is_drawn_fresh_per_step_from_the_run_key():
    """Through the real train step (update_interval 1, beta2 0: h after step k is that step's estimate
    alone): h equals u_k * (H_k u_k) recomputed here apart from the optimizer: H_k the Hessian of the
    batch's mean next-token cross-entropy (a log-softmax of the model's logits) at the step's parameters,
    its product with u_k by forward-over-reverse differentiation, and u_k the Gaussian probe of the
    documented key fold_in(fold_in(run key, k), HUTCHINSON_STREAM) (one key per leaf, by split).
    Successive estimates thus hold different probes: no step's h matches the previous step's probe,
    nor one probe repeated for every step (the run key folded with the stream alone)."""
    import equinox as eqx

    from lm_pipeline.batch import LmBatch
    from lm_pipeline.train.sharding import make_mesh
    from lm_pipeline.train.sophia import SophiaState
    from lm_pipeline.train.trainer import HUTCHINSON_STREAM, build_step_functions, put_batch

    seq, vocab, rows = 16, 32, 4
    cfg = load_config(None, {
        "model.type": "llama", "model.seq_len": seq, "model.hidden_dim": 16, "model.num_heads": 2,
        "model.num_kv_heads": 1, "model.intermediate_dim": 32, "model.num_layers": 1,
        "model.gradient_checkpointing": False, "trainer.mp": "f32", "trainer.train_batch_size": rows,
        "trainer.per_device_parallelism": -1, "trainer.progress": False, "optimizer.type": "sophia-h",
        "optimizer.learning_rate": 1e-2, "optimizer.warmup": 0, "optimizer.update_interval": 1,
        "optimizer.beta2": 0.0, "optimizer.gamma": 1e-2, "optimizer.weight_decay": 0.0})
    plan = make_mesh(cfg.trainer, jax.devices()[:1])
    fns = build_step_functions(cfg.model, cfg.optimizer, cfg.trainer, vocab_size=vocab, num_train_steps=10,
                               plan=plan, has_segments=False)
    state = fns.init(jax.random.key_data(jax.random.key(0)))
    run_key = jax.random.wrap_key_data(np.asarray(state.key))
    abstract = eqx.filter_eval_shape(cfg.model.build, vocab, key=jax.random.key(0))  # the model's structure
    static = eqx.partition(abstract, lambda x: isinstance(x, jax.ShapeDtypeStruct))[1]

    def mean_xent(p, tokens):
        logits = eqx.combine(p, static)(tokens, None, key=None, inference=True)
        logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))

    @jax.jit
    def u_hu_arrays(p, tokens, key):
        leaves, treedef = jax.tree.flatten(p)
        u = jax.tree.unflatten(treedef, [jax.random.normal(k, x.shape, jnp.float32)
                                         for k, x in zip(jax.random.split(key, len(leaves)), leaves, strict=True)])
        hu = jax.jvp(jax.grad(lambda q: mean_xent(q, tokens)), (p,), (u,))[1]
        return [a * b for a, b in zip(jax.tree.leaves(u), jax.tree.leaves(hu), strict=True)]

    def u_hu(p, tokens, key):  # u * (H u) for the probe of `key`
        return [np.asarray(x, np.float64) for x in u_hu_arrays(p, tokens, key)]

    def close(a, b, rtol):
        return all(np.linalg.norm(x - y) <= rtol * np.linalg.norm(x) for x, y in zip(a, b, strict=True))

    def probe_key(k):
        return jax.random.fold_in(jax.random.fold_in(run_key, k), HUTCHINSON_STREAM)

    rng = np.random.default_rng(5)
    for k in range(3):
        tokens = rng.integers(0, vocab, (rows, seq)).astype(np.int32)
        before = jax.tree.map(lambda x: jnp.array(np.asarray(x)), state.model)  # the step donates the state
        state, _ = fns.train_step(state, *put_batch(LmBatch(tokens, None), plan))
        (soph,) = [s for s in jax.tree.leaves(state.opt_state, is_leaf=lambda x: isinstance(x, SophiaState))
                   if isinstance(s, SophiaState)]
        h = [np.asarray(x, np.float64) for x in jax.tree.leaves(soph.h)]
        assert int(soph.count) == k + 1 and sum(np.abs(x).sum() for x in h) > 0
        want = u_hu(before, jnp.asarray(tokens), probe_key(k))
        own = close(want, h, 1e-3)
        assert own, f"step {k}: h is not the estimate of the step's own probe"
        repeated = u_hu(before, jnp.asarray(tokens), jax.random.fold_in(run_key, HUTCHINSON_STREAM))
        same = close(repeated, h, 0.5)
        assert not same, f"step {k}: h is a repeated probe's estimate"
        if k:
            previous = u_hu(before, jnp.asarray(tokens), probe_key(k - 1))
            stale = close(previous, h, 0.5)
            assert not stale, f"step {k}: h holds step {k - 1}'s probe"
