"""Levanter's "how, not what" model keys mapped onto the compute plan (status ``mapped`` in
``lm_pipeline.levanter.LEVANTER_KEYS``): each says what it became in one log line, none enters a
fingerprint or the run id, and each changes the plan the trainer, evaluation and generation build
(the attention form, the blocked attention's block, the fused head's chunk, the layer loop).

Independent references: attention values and gradients against a NumPy float64 transcription of
causal (grouped-query) softmax attention and its backward pass; the block and chunk counts read off
the traced program (one pair of products per block or chunk); the step's loss and gradients under
each backend against each other and the plain-XLA reference plan.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lm_pipeline import compute, levanter
from lm_pipeline.compute import REFERENCE, ComputeHints, hints_from, plan_for, plan_for_params
from lm_pipeline.config import load_config
from lm_pipeline.fingerprint import semantic_view
from lm_pipeline.kernels.cpu import native_attention
from lm_pipeline.train.run_identity import run_semantics

TINY = {"model.type": "gpt2", "model.seq_len": 64, "model.hidden_dim": 32, "model.num_layers": 2,
        "model.num_heads": 4, "model.gradient_checkpointing": False, "trainer.mp": "f32",
        "trainer.train_batch_size": 2, "trainer.progress": False}
HOW = {"model.attn_backend": "jax_flash", "model.flash_attention_block_size": 16,
       "model.cross_entropy_block_size": 32, "model.scan_layers": False}
PROFILE = {"trainer.profiler": True, "trainer.profiler_start_step": 1, "trainer.profiler_num_steps": 2}
CPU_OWN = "cpu_native" if native_attention.available() else "cpu_blocked"


def _plan(overrides: dict, platform: str = "cpu", dtype=jnp.float32):
    return plan_for(platform, dtype, num_devices=1, hints=hints_from(load_config(None, {**TINY, **overrides}).model))


# --- the config: one log line each, no fingerprint --------------------------------------------


def test_mapped_keys_say_what_they_became_and_enter_no_fingerprint_or_run_id(caplog):
    levanter._NOTED.clear()
    with caplog.at_level("INFO", logger="lm_pipeline.config"):
        tuned = load_config(None, {**TINY, **HOW, **PROFILE})
        load_config(None, {**TINY, **HOW, **PROFILE})  # a second load logs nothing again
    lines = [r.getMessage() for r in caplog.records if r.name == "lm_pipeline.config"]
    assert len(lines) == len(HOW) + len(PROFILE), lines
    for key, value in {**HOW, **PROFILE}.items():
        line = next(x for x in lines if x.startswith(f"Levanter's `{key}: {str(value).lower()}` ("))
        assert "is mapped here:" in line, line
    plain = load_config(None, TINY)
    assert semantic_view(tuned) == semantic_view(plain)
    assert run_semantics(tuned) == run_semantics(plain)
    for family in ("gpt2", "llama"):  # the fields exist in both families, non-semantic
        cfg = load_config(None, {"model.type": family, "model.attn_backend": "VANILLA", "model.scan_layers": True})
        assert (cfg.model.attn_backend, cfg.model.scan_layers) == ("vanilla", True)
    # and the plan they make differs from the plain config's
    assert _plan(HOW) != _plan({})


def test_pipeline_addresses_ignore_the_mapped_keys(tmp_path):
    from lm_pipeline.steps import Pipeline

    def versions(extra):
        cfg = load_config(None, {**TINY, **extra, "store.root": str(tmp_path / "store")})
        return Pipeline(cfg).config_versions()

    assert versions({**HOW, **PROFILE}) == versions({})
    assert versions({"model.num_layers": 3}) != versions({})  # a semantic change does change them


@pytest.mark.parametrize("key, bad", [("model.attn_backend", "flash"), ("model.flash_attention_block_size", 0),
                                      ("model.cross_entropy_block_size", -4), ("model.scan_layers", "yes")])
def test_bad_values_are_refused_naming_the_field(key, bad):
    from lm_pipeline.schema import ConfigError

    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, {**TINY, key: bad})


# --- the plan -----------------------------------------------------------------------------------


def test_attn_backend_picks_the_plans_attention_per_platform(monkeypatch, caplog):
    monkeypatch.delenv(compute.ATTENTION_ENV, raising=False)
    cpu = {b: _plan({"model.attn_backend": b}).attention for b in compute.LEVANTER_BACKENDS}
    assert cpu == {"default": CPU_OWN, "vanilla": "xla", "jax_flash": "cpu_blocked", "nvte": CPU_OWN,
                   "splash": CPU_OWN}
    assert _plan({}).attention == CPU_OWN
    gpu = {b: _plan({"model.attn_backend": b}, "gpu", jnp.bfloat16) for b in compute.LEVANTER_BACKENDS}
    assert {b: p.attention for b, p in gpu.items()} == {"default": "cudnn", "vanilla": "xla", "jax_flash": "cudnn",
                                                        "nvte": "cudnn", "splash": "cudnn"}
    assert not any(p.strict_attention for p in gpu.values())  # a config's backend never fails a call
    assert _plan({"model.attn_backend": "jax_flash"}, "gpu", jnp.float32).attention == "cudnn"
    assert _plan({}, "gpu", jnp.float32).attention == "xla"  # the plan's own choice in f32
    tpu = {b: _plan({"model.attn_backend": b}, "tpu", jnp.bfloat16).attention for b in compute.LEVANTER_BACKENDS}
    assert set(tpu.values()) == {"xla"}
    # a backend without a kernel on the device: one log line
    levanter._NOTED.clear()
    caplog.clear()  # the lines of the plans above (captured when an earlier test set the root logger's level)
    with caplog.at_level("INFO", logger="lm_pipeline.compute"):
        _plan({"model.attn_backend": "splash"})
        _plan({"model.attn_backend": "splash"})
    assert sum("splash has no kernel on cpu" in r.getMessage() for r in caplog.records) == 1, [(r.name, r.getMessage()[:80]) for r in caplog.records]
    # the environment variable overrides the config (and keeps its strictness)
    monkeypatch.setenv(compute.ATTENTION_ENV, "xla")
    assert _plan({"model.attn_backend": "jax_flash"}).attention == "xla"
    monkeypatch.setenv(compute.ATTENTION_ENV, "blocked")
    assert _plan({"model.attn_backend": "vanilla"}).attention == "cpu_blocked"


def test_block_sizes_and_the_layer_loop_reach_the_plan(monkeypatch):
    monkeypatch.delenv(compute.ATTENTION_ENV, raising=False)
    p = _plan(HOW)
    assert (p.attention, p.attention_block, p.head_chunk_rows, p.layer_loop) == ("cpu_blocked", 16, 32, "unroll")
    own = _plan({})
    assert (own.attention_block, own.head_chunk_rows, own.layer_loop) == (0, 0, "auto")
    # a block size where the plan's attention has no blocks is not used
    assert _plan({"model.attn_backend": "vanilla", "model.flash_attention_block_size": 16}).attention_block == 0
    # the fused head is the CPU plan's: GPU plans compute full logits
    assert _plan({"model.cross_entropy_block_size": 32}, "gpu", jnp.bfloat16).head_chunk_rows == 0
    # scan_layers: the plan's own rule is scanned on a CPU in f32, unrolled (<= 48 layers) on a GPU
    assert not own.unroll(2) and _plan({"model.scan_layers": False}).unroll(2)
    assert _plan({}, "gpu").unroll(2) and not _plan({"model.scan_layers": True}, "gpu").unroll(2)
    assert _plan({"model.scan_layers": False}).unroll_rematerialized(2) and not own.unroll_rematerialized(2)


def test_the_trainer_evaluation_and_generation_build_the_configs_plan(monkeypatch):
    """Wherever a plan is built: the train step's (from the mesh) and the one evaluation, generation
    and the harness build from a model (its config's keys)."""
    from lm_pipeline.train.sharding import make_mesh
    from lm_pipeline.train.trainer import build_step_functions

    monkeypatch.delenv(compute.ATTENTION_ENV, raising=False)
    for extra, attention in (({}, CPU_OWN), ({"model.attn_backend": "vanilla"}, "xla"), (HOW, "cpu_blocked")):
        cfg = load_config(None, {**TINY, **extra})
        mesh = make_mesh(cfg.trainer, jax.devices()[:1])
        fns = build_step_functions(cfg.model, cfg.optimizer, cfg.trainer, vocab_size=50, num_train_steps=2,
                                   plan=mesh, has_segments=False)
        assert fns.compute.attention == attention
        assert fns.compute == _plan(extra)
        model = cfg.model.build(50, key=jax.random.key(0))
        assert plan_for_params(model) == _plan(extra)


# --- the values ---------------------------------------------------------------------------------


def numpy_attention(q, k, v, scale, d_out):
    """Causal grouped-query attention in float64 and its gradients for the cotangent ``d_out``:
    q ``[B, T, N, H]``, k/v ``[B, T, K, H]`` -> (out, dq, dk, dv)."""
    q, k, v, d_out = (np.asarray(x, np.float64) for x in (q, k, v, d_out))
    n, kh = q.shape[2], k.shape[2]
    group = n // kh
    ke, ve = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)  # head i reads kv head i // group
    s = np.einsum("bqnh,bknh->bnqk", q, ke) * scale
    t = q.shape[1]
    s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = np.einsum("bnqk,bknh->bqnh", p, ve)
    dp = np.einsum("bqnh,bknh->bnqk", d_out, ve)
    dve = np.einsum("bnqk,bqnh->bknh", p, d_out)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    dq = np.einsum("bnqk,bknh->bqnh", ds, ke) * scale
    dke = np.einsum("bnqk,bqnh->bknh", ds, q) * scale
    fold = lambda x: x.reshape(*x.shape[:2], kh, group, x.shape[-1]).sum(3)  # noqa: E731
    return out, dq, fold(dke), fold(dve)


@pytest.mark.parametrize("backend", ["default", "vanilla", "jax_flash"])
def test_each_backends_attention_is_the_float64_attention(backend, monkeypatch):
    monkeypatch.delenv(compute.ATTENTION_ENV, raising=False)
    plan = _plan({"model.attn_backend": backend, "model.flash_attention_block_size": 16})
    assert plan.attention == {"default": CPU_OWN, "vanilla": "xla", "jax_flash": "cpu_blocked"}[backend]
    rng = np.random.default_rng(0)
    b, t, n, kh, h = 2, 64, 4, 2, 8
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((b, t, n, h), (b, t, kh, h), (b, t, kh, h)))
    d_out = rng.standard_normal((b, t, n, h))
    scale = 1 / np.sqrt(h)
    out, vjp = jax.vjp(lambda q, k, v: plan.causal_attention(q, k, v, None, scale), q, k, v)
    grads = vjp(jnp.asarray(d_out, jnp.float32))
    ref = numpy_attention(q, k, v, scale, d_out)
    for got, want, name in zip((out, *grads), ref, ("out", "dq", "dk", "dv"), strict=True):
        np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=2e-5 * np.abs(want).max(), rtol=0,
                                   err_msg=f"{backend}: {name}")


def _count(fn, *args, what: str = "dot_general") -> int:
    return str(jax.make_jaxpr(fn)(*args)).count(what)


def test_the_block_size_is_the_blocked_attentions_block(monkeypatch):
    """One score and one value product per query block, read off the traced forward pass."""
    monkeypatch.delenv(compute.ATTENTION_ENV, raising=False)
    q = jnp.ones((1, 64, 2, 8), jnp.float32)

    def products(overrides):
        plan = _plan({"model.attn_backend": "jax_flash", **overrides})
        return _count(lambda q: plan.causal_attention(q, q, q, None, 0.3), q)

    assert products({}) == 2  # 64 rows: one block of its own rule
    assert products({"model.flash_attention_block_size": 16}) == 2 * 4
    assert products({"model.flash_attention_block_size": 24}) == 2 * 3  # 24 + 24 + 16


def test_the_cross_entropy_block_is_the_fused_heads_chunk(monkeypatch):
    """One logits product per chunk of the fused head's forward pass (2 x 64 = 128 token rows)."""
    hidden, head = jnp.ones((2, 64, 16), jnp.float32), jnp.ones((50, 16), jnp.float32)
    targets, mask = jnp.zeros((2, 64), jnp.int32), jnp.ones((2, 64), jnp.float32)

    def products(overrides):
        plan = _plan(overrides)
        assert plan.loss == "cpu_fused_head"
        def fn(h):
            return plan.head_xent_sum(h, head, targets, mask)

        # XLA's dot, or on Intel CPUs (the plan's blas) the native library's oneMKL product
        return _count(fn, hidden) + _count(fn, hidden, what="target_name=lm_pipeline_gemm_f32")

    assert products({}) == 1  # 128 rows < 512: one chunk
    assert products({"model.cross_entropy_block_size": 32}) == 4
    assert products({"model.cross_entropy_block_size": 64}) == 2


@pytest.mark.parametrize("checkpointing", [False, True])
def test_scan_layers_false_unrolls_the_traced_layer_loop(checkpointing):
    cfg = load_config(None, {**TINY, "model.gradient_checkpointing": checkpointing}).model
    model = cfg.build(50, key=jax.random.key(0))
    tokens = jnp.zeros((1, 64), jnp.int32)

    def loop(overrides):
        plan = _plan(overrides)
        text = str(jax.make_jaxpr(lambda m: m(tokens, plan=plan))(model))
        return [int(x.split()[0].rstrip(",]")) for x in text.split("unroll=")[1:]]

    assert loop({"model.scan_layers": False}) == [2]  # the 2 layers unrolled
    assert loop({"model.scan_layers": True}) == [1]
    assert loop({}) == [1]  # the CPU f32 plan's own rule: a scan


@pytest.mark.slow  # three attention backends' loss and gradients compiled (about 45 s on a 2-core Xeon)
def test_the_steps_loss_and_gradients_agree_across_backends(monkeypatch):
    """The training loss (fused head, chunks of 32 rows) and its gradients under attn_backend default,
    vanilla and jax_flash (blocks of 16) equal the plain-XLA reference plan's, packed rows included."""
    import equinox as eqx

    from lm_pipeline.train.loss import model_loss_sums

    monkeypatch.delenv(compute.ATTENTION_ENV, raising=False)
    cfg = load_config(None, {**TINY, "model.type": "llama", "model.num_kv_heads": 2, "model.intermediate_dim": 64}).model
    model = cfg.build(50, key=jax.random.key(1))
    rng = np.random.default_rng(2)
    tokens = jnp.asarray(rng.integers(0, 50, (2, 64)), jnp.int32)
    seg = jnp.asarray(np.repeat([[1, 2, 0]], [30, 30, 4], axis=1).repeat(2, 0), jnp.int32)

    def step(plan, segments):
        def loss(m):
            s, n = model_loss_sums(m, tokens, segments, key=None, inference=True, plan=plan)
            return s / n

        return eqx.filter_jit(eqx.filter_value_and_grad(loss))(model)

    plans = {b: _plan({"model.attn_backend": b, "model.flash_attention_block_size": 16,
                       "model.cross_entropy_block_size": 32}) for b in ("default", "vanilla", "jax_flash")}
    assert [p.attention for p in plans.values()] == [CPU_OWN, "xla", "cpu_blocked"]
    for segments in (None, seg):
        l_ref, g_ref = step(REFERENCE, segments)
        for name, plan in plans.items():
            loss, grads = step(plan, segments)
            np.testing.assert_allclose(float(loss), float(l_ref), rtol=1e-5, err_msg=name)
            for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(g_ref), strict=True):
                np.testing.assert_allclose(a, b, atol=1e-4 * float(jnp.max(jnp.abs(b))) + 1e-8, rtol=0, err_msg=name)


def test_hints_of_a_config_without_the_keys_are_the_plans_own():
    assert hints_from(None) == ComputeHints()
    assert hints_from(object()) == ComputeHints()
    assert hints_from(load_config(None, TINY).model) == ComputeHints()


def test_the_profiler_traces_its_window_of_steps_into_the_runs_log_directory(tmp_path, caplog):
    """trainer.profiler: steps 1 and 2 of 4 traced with jax.profiler under <log_dir>/<run id>/profiler/;
    without it no trace is written."""
    from lm_pipeline.batch import ArrayDataset
    from lm_pipeline.train.run import train

    data = ArrayDataset(np.tile(np.arange(50, dtype=np.int32), 30)[: 16 * 64], 64)
    for on in (False, True):
        cfg = load_config(None, {**TINY, "trainer.num_train_steps": 4, "trainer.log_dir": str(tmp_path / f"logs{on}"),
                                 "trainer.id": "prof", "trainer.steps_per_eval": 100,
                                 **(PROFILE if on else {})})
        with caplog.at_level("INFO", logger="lm_pipeline.train.profiling"):
            res = train(cfg, train_data=data, vocab_size=50, run_dir=str(tmp_path / f"run{on}"))
        assert res.final_step == 4
        traces = list((tmp_path / f"logs{on}" / "prof" / "profiler").glob("plugins/profile/*/*.xplane.pb"))
        assert len(traces) == (1 if on else 0), traces
    assert any("profiling steps 1..2" in r.getMessage() for r in caplog.records)
