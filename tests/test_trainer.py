"""The trainer: learning, logging, gradient accumulation, mesh equivalence, multi-process, resume."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers.nonfinite import poisoning
from helpers.steps import segment_row, train_steps

from lm_pipeline.batch import ArrayDataset, LmBatch, StepBatchSource
from lm_pipeline.config import load_config
from lm_pipeline.train import run
from lm_pipeline.train.checkpoint import latest_checkpoint, read_metadata
from lm_pipeline.train.run import train
from lm_pipeline.train.sharding import make_mesh
from lm_pipeline.train.trackers import read_metrics
from lm_pipeline.train.trainer import build_step_functions, put_batch

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "scripts"

TINY = {
    "model.type": "llama", "model.seq_len": 32, "model.hidden_dim": 32, "model.num_heads": 4, "model.num_kv_heads": 2,
    "model.intermediate_dim": 64, "model.num_layers": 2, "model.gradient_checkpointing": False,
    "trainer.train_batch_size": 8, "trainer.progress": False, "optimizer.learning_rate": 1e-2, "optimizer.warmup": 2,
}


def periodic_tokens(n_rows: int, seq_len: int = 32, vocab: int = 64, seed: int = 0) -> np.ndarray:
    """A learnable stream: a fixed random 'text' of 97 tokens repeated."""
    rng = np.random.default_rng(seed)
    return np.tile(rng.integers(0, vocab, 97), n_rows * seq_len // 97 + 2)[: n_rows * seq_len]


def test_train_learns_and_logs(tmp_path):
    cfg = load_config(None, {**TINY, "trainer.num_train_steps": 80, "trainer.log_every": 10, "trainer.steps_per_eval": 40,
                             "trainer.log_dir": str(tmp_path / "logs"), "trainer.id": "t1",
                             "trainer.tracker": [{"type": "tensorboard"}]})
    data = ArrayDataset(periodic_tokens(64), 32)
    res = train(cfg, train_data=data, vocab_size=64, eval_data={"held": ArrayDataset(periodic_tokens(16, seed=0), 32)},
                run_dir=str(tmp_path / "run"))
    assert res.final_step == 80
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    train_rows = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in train_rows] == list(range(10, 81, 10))
    for key in ("train/loss", "optim/learning_rate", "optim/grad_norm", "throughput/tokens_per_second"):
        assert all(np.isfinite(r[key]) for r in train_rows), key
    assert train_rows[-1]["train/loss"] < 0.5 * train_rows[0]["train/loss"]
    evals = [r for r in rows if "eval/held/loss" in r]
    assert [r["step"] for r in evals] == [40, 80] and evals[-1]["eval/held/loss"] < np.log(64) * 0.5
    assert list((tmp_path / "run" / "tensorboard").rglob("events.out.tfevents*"))
    for name in ("loss.png", "learning_rate.png", "eval_bpb.png", "tokens_per_second.png"):
        png = tmp_path / "run" / "plots" / name
        assert name == "eval_bpb.png" or png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name  # no bpb without eval bytes
    assert (tmp_path / "logs" / "t1.log").read_text().count("finished t1") == 1
    # the last step's checkpoint is complete and describes itself
    last = latest_checkpoint(tmp_path / "run")
    assert last.endswith("step-80") and (Path(last) / "config.yaml").is_file()
    assert read_metadata(last)["step"] == 80


def _packed_batches(steps: int, rows: int, seq_len: int = 32, vocab: int = 64) -> list[LmBatch]:
    """Random documents packed into rows with segment ids and trailing padding (id 0), so the
    micro-batches of a step hold different numbers of predicted tokens."""
    rng = np.random.default_rng(1)
    out = []
    for _ in range(steps):
        seg = np.zeros((rows, seq_len), np.int32)
        for r in range(rows):
            seg[r] = segment_row(rng, seq_len, (2, 14), 12)
        out.append(LmBatch(rng.integers(0, vocab, (rows, seq_len)).astype(np.int32), seg[:, :seq_len]))
    return out


def _train_steps(per_device: int, batches: list[LmBatch]):
    return train_steps({**TINY, "trainer.mp": "f32", "trainer.train_batch_size": 16,
                        "trainer.per_device_parallelism": per_device, "optimizer.warmup": 0,
                        "optimizer.weight_decay": 0.1}, batches)


def test_gradient_accumulation_matches_full_batch():
    """Four steps at a real learning rate: 4 micro-batches of 4 rows give the full batch's
    loss, gradient norm and parameters (token-weighted over micro-batches of unequal counts)."""
    batches = _packed_batches(4, 16)
    full, m_full = _train_steps(-1, batches)
    accum, m_accum = _train_steps(4, batches)
    for a, b in zip(m_full, m_accum, strict=True):
        assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-5)
        assert a["optim/grad_norm"] == pytest.approx(b["optim/grad_norm"], rel=1e-5)
    init, _ = _train_steps(-1, [])
    for a, b in zip(full, accum, strict=True):  # relative to each tensor's norm
        assert np.linalg.norm(a - b) <= 1e-5 * np.linalg.norm(a)
    assert sum(np.linalg.norm(a - c) for a, c in zip(full, init, strict=True)) > 1e-2  # parameters moved


@pytest.mark.slow  # compiles the step for several meshes of 8 simulated devices: ~55 s
def test_mesh_equivalence_on_8_simulated_devices():
    """Same 20-step f32 run on 1 device, FSDP x8, data x tensor 2x4, and 4-way accumulation."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    out = subprocess.run([sys.executable, str(SCRIPTS / "mesh_equivalence.py")], capture_output=True, text=True,
                         env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.split("RESULT ", 1)[1])
    base = np.array(res["single"]["losses"])
    assert len(base) == 20 and base[-1] < base[0]
    for name in ("fsdp8", "dp2_tp4", "accum4"):
        assert np.max(np.abs(np.array(res[name]["losses"]) - base)) <= 1e-4, name
    # the layouts really differ: FSDP shards over 'data', tensor parallelism over 'model'
    assert any("'data'" in s for s in res["fsdp8"]["shardings"])
    assert any("'model'" in s for s in res["dp2_tp4"]["shardings"])
    assert not any("'data'" in s for s in res["dp2_tp4"]["shardings"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_process_run_on_loopback(tmp_path):
    """jax.distributed with gloo CPU collectives: two processes train and checkpoint together."""
    coord = f"127.0.0.1:{_free_port()}"
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [subprocess.Popen([sys.executable, str(SCRIPTS / "distributed_train.py"), coord, "2", str(i), str(run_dir)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for i in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_out, e) in zip(procs, outs, strict=True):
        assert p.returncode == 0, e[-3000:]
    results = [json.loads(o.split("RESULT ", 1)[1]) for o, _ in outs]
    assert {r["process"] for r in results} == {0, 1}
    assert all(r["processes"] == 2 and r["devices"] == 2 and r["final_step"] == 6 for r in results)
    assert results[0]["loss"] == pytest.approx(results[1]["loss"])
    last = latest_checkpoint(run_dir)
    assert last.endswith("step-6")
    meta = read_metadata(last)
    assert meta["step"] == 6


def _cli_train(store: Path, extra=(), **popen):
    cmd = [sys.executable, "-m", "lm_pipeline.cli", "train", "--config_path", str(ROOT / "configs/tiny_gpt2.yaml"),
           "--store.root", str(store), "--data.builtin_max_bytes", "150000", "--data.tokenizer.vocab_size", "300",
           "--model.num_layers", "2", "--model.hidden_dim", "32", "--model.num_heads", "2", "--model.seq_len", "64",
           "--trainer.num_train_steps", "60", "--trainer.train_batch_size", "4", "--trainer.steps_per_eval", "1000",
           "--trainer.mp", "f32", "--trainer.checkpointer.keep", "[{every: 10}]", "--trainer.progress", "false",
           "--trainer.log_dir", str(store / "logs"), *extra]
    return subprocess.Popen(cmd, cwd=store.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)


def _final_params(store: Path) -> list[np.ndarray]:
    """The model arrays of the run's step-60 checkpoint, in key order."""
    from lm_pipeline.train.checkpoint import load

    (run,) = [p for p in (store / "train_ckpt").iterdir() if p.is_dir()]
    path = latest_checkpoint(run)
    assert path.endswith("step-60")
    arrays = read_metadata(path)["state"]["arrays"]
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = {k: jax.ShapeDtypeStruct(tuple(v["shape"]), np.dtype(v["dtype"]), sharding=device)
                for k, v in sorted(arrays.items()) if k.startswith("model.")}
    tree: dict = {}
    for key, v in abstract.items():  # dotted keys -> nested dicts, as the checkpoint names them
        node = tree
        *parents, leaf = key[len("model."):].split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = v
    return [np.asarray(x) for x in jax.tree.leaves(load(path, tree, subtree="model"))]


@pytest.mark.slow
def test_sigkill_mid_run_resumes_bitwise(tmp_path):
    """Kill the CLI mid-run, run the same command again: final params equal an uninterrupted run's."""
    clean = tmp_path / "clean" / "store"
    clean.parent.mkdir()
    p = _cli_train(clean)
    out, _ = p.communicate(timeout=900)
    assert p.returncode == 0, out[-3000:]

    killed = tmp_path / "killed" / "store"
    killed.parent.mkdir()
    p = _cli_train(killed)
    deadline = time.time() + 900
    while time.time() < deadline:  # wait until a complete checkpoint past step 20 exists, then kill
        marks = list((killed / "train_ckpt").glob("*/step-*/checkpoint.json")) if (killed / "train_ckpt").exists() else []
        if any(int(m.parent.name.split("-")[1]) >= 30 for m in marks):
            break
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.wait()
    marks = {m.parent.name for m in (killed / "train_ckpt").glob("*/step-*/checkpoint.json")}
    assert "step-60" not in marks, "the run finished before it was killed; the test proves nothing"
    p = _cli_train(killed)
    out, _ = p.communicate(timeout=900)
    assert p.returncode == 0, out[-3000:]
    assert "resumed from" in out
    a, b = _final_params(clean), _final_params(killed)
    assert len(a) == len(b) > 0
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.mark.slow
def test_initialize_from_starts_a_new_run_with_old_weights(tmp_path):
    data = ArrayDataset(periodic_tokens(64), 32)
    base = {**TINY, "trainer.log_every": 5, "trainer.steps_per_eval": 1000}
    first = train(load_config(None, {**base, "trainer.num_train_steps": 10, "trainer.id": "a"}), train_data=data,
                  vocab_size=64, run_dir=str(tmp_path / "a"))
    second = train(load_config(None, {**base, "trainer.num_train_steps": 2, "trainer.id": "b",
                                      "optimizer.learning_rate": 1e-9, "optimizer.weight_decay": 0.0, "trainer.initialize_from": str(tmp_path / "a")}),
                   train_data=data, vocab_size=64, run_dir=str(tmp_path / "b"))
    assert second.resumed_from is None and second.final_step == 2
    for x, y in zip(jax.tree.leaves(first.state.model), jax.tree.leaves(second.state.model), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-6)  # lr ~0: run a's weights


def _nan_run(tmp_path, monkeypatch, skip: bool):
    monkeypatch.setattr(run, "build_step_functions", poisoning(run.build_step_functions, {5, 6}))  # NaN at 5 and 6
    cfg = load_config(None, {**TINY, "trainer.num_train_steps": 12, "trainer.log_every": 4,
                             "optimizer.skip_bad_steps": skip, "optimizer.skip_grad_norm_factor": None,
                             "trainer.checkpointer.keep": [{"every": 3}], "trainer.log_dir": str(tmp_path / "logs")})
    return cfg, ArrayDataset(periodic_tokens(64), 32)


def test_injected_nan_steps_are_skipped_when_configured(tmp_path, monkeypatch):
    cfg, data = _nan_run(tmp_path, monkeypatch, skip=True)
    res = train(cfg, train_data=data, vocab_size=64, run_dir=str(tmp_path / "run"))
    assert res.final_step == 12 and res.metrics["optim/skipped_steps"] == 2
    rows = {r["step"]: r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "train/loss" in r}
    assert np.isfinite(rows[4]["train/loss"]) and np.isfinite(rows[12]["train/loss"])
    assert rows[12]["train/loss"] < rows[4]["train/loss"]
    for leaf in jax.tree.leaves(res.state.model):
        assert np.all(np.isfinite(np.asarray(leaf)))


def test_injected_nan_stops_the_run_before_any_poisoned_checkpoint(tmp_path, monkeypatch):
    cfg, data = _nan_run(tmp_path, monkeypatch, skip=False)
    with pytest.raises(FloatingPointError, match="after step 6.*skip_bad_steps"):
        train(cfg, train_data=data, vocab_size=64, run_dir=str(tmp_path / "run"))
    # keep every 3 steps: step-3 was saved before the NaN at step 5; step-6 was refused
    assert latest_checkpoint(tmp_path / "run").endswith("step-3")
    assert not (tmp_path / "run" / "step-6").exists()


@pytest.mark.slow  # f16 compile and overflow rounds: ~20 s
def test_f16_compute_trains_with_dynamic_loss_scaling(monkeypatch):
    from lm_pipeline.train import optim

    monkeypatch.setattr(optim, "LOSS_SCALE_INIT", 2.0**40)  # overflows f16: the first steps must be skipped
    cfg = load_config(None, {**TINY, "trainer.mp": "p=f32,c=f16"})
    plan = make_mesh(cfg.trainer, jax.devices()[:1])
    fns = build_step_functions(cfg.model, cfg.optimizer, cfg.trainer, vocab_size=64, num_train_steps=60, plan=plan,
                               has_segments=False)
    src = StepBatchSource(ArrayDataset(periodic_tokens(64), 32), 8, seed=0)
    state = fns.init(jax.random.key_data(jax.random.key(0)))
    first = [np.asarray(x) for x in jax.tree.leaves(state.model)]
    history = []
    for step in range(60):
        state, m = fns.train_step(state, *put_batch(src.batch(step), plan))
        history.append({k: float(v) for k, v in m.items()})
        if step == 0:  # an overflowing step changes nothing
            assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(first, jax.tree.leaves(state.model), strict=True))
    scales = [h["optim/loss_scale"] for h in history]
    skipped = history[-1]["optim/skipped_steps"]
    assert scales[0] == 2.0**39 and 1 <= skipped <= 30  # halved per overflow until the gradients fit
    assert max(scales[30:]) < 2.0**24 and all(b in (a, a / 2) for a, b in zip(scales[30:-1], scales[31:], strict=True))
    losses = [h["train/loss"] for h in history]
    assert all(np.isfinite(losses)) and losses[-1] < 0.5 * losses[0]
