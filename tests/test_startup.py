"""A run's start-up: the state's initialisation compiled for speed, the train step compiled on a
thread while the state is initialised, a small corpus tokenized without worker processes."""

import jax
import ml_dtypes
import numpy as np
import pytest

from lm_pipeline.batch import LmBatch
from lm_pipeline.config import load_config
from lm_pipeline.data.cache import build as cache_build
from lm_pipeline.data.cache import build_cache
from lm_pipeline.data.textshard import TextShard
from lm_pipeline.train.precompile import AheadStep
from lm_pipeline.train.sharding import make_mesh
from lm_pipeline.train.trainer import (
    INIT_COMPILE_OPTIONS,
    STEP_COMPILE_OPTIONS,
    build_step_functions,
    put_batch,
    step_args,
)

TINY = {
    "model.type": "gpt2", "model.seq_len": 16, "model.hidden_dim": 32, "model.num_heads": 2, "model.num_layers": 2,
    "model.gradient_checkpointing": False, "trainer.train_batch_size": 4, "trainer.mp": "f32",
    "optimizer.learning_rate": 1e-2, "optimizer.warmup": 0,
}
VOCAB = 64


def _fns(**over):
    cfg = load_config(None, {**TINY, **over})
    plan = make_mesh(cfg.trainer, jax.devices()[:1])
    fns = build_step_functions(cfg.model, cfg.optimizer, cfg.trainer, vocab_size=VOCAB, num_train_steps=20, plan=plan,
                               has_segments=False)
    return fns, plan, cfg


def _batches(n: int, rows: int = 4, seq: int = 16, seed: int = 0) -> list[LmBatch]:
    rng = np.random.default_rng(seed)
    return [LmBatch(rng.integers(0, VOCAB, (rows, seq)).astype(np.int32)) for _ in range(n)]


def _leaves(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_initialisation_compiled_for_speed_computes_the_same_bits():
    """The state from the trainer's init program (compiled with INIT_COMPILE_OPTIONS on CPU) equals,
    bit for bit, the one the same function gives compiled at XLA's default level."""
    fns, _, _ = _fns()
    key = jax.random.key_data(jax.random.key(3))
    assert INIT_COMPILE_OPTIONS  # the CPU plan compiles init with them
    default = jax.jit(fns.init.__wrapped__, out_shardings=fns.state_shardings)(key)
    a, b = _leaves(fns.init(key)), _leaves(default)
    assert len(a) == len(b) > 4
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes()
    assert any(np.abs(x).sum() > 0 for x in a if x.dtype == np.float32)  # real weights, not zeros


@pytest.mark.parametrize("mp", ["f32", "p=f32,c=f32,m=bf16"])
def test_steps_compiled_for_speed_compute_what_the_default_level_computes(mp):
    """Six train steps and an evaluation from the trainer's programs (compiled with
    STEP_COMPILE_OPTIONS on CPU) give the losses, gradient norms and parameters that the same
    functions give compiled at XLA's default level."""
    fns, plan, _ = _fns(**{"trainer.mp": mp})
    assert STEP_COMPILE_OPTIONS  # the CPU plan compiles the steps with them
    default_step = jax.jit(fns.train_step.__wrapped__, donate_argnums=(0,))
    default_eval = jax.jit(fns.eval_step.__wrapped__)
    batches = _batches(2, seed=7) * 3  # two batches in turn: the loss on each falls
    runs = []
    for step, evaluate in ((fns.train_step, fns.eval_step), (default_step, default_eval)):
        state, metrics = _train(step, fns, plan, batches, seed=1)
        ev = evaluate(state, *step_args(fns, put_batch(_batches(1, seed=8)[0], plan)))
        runs.append(([m["train/loss"] for m in metrics], [m["optim/grad_norm"] for m in metrics],
                     _leaves(state.model), [float(x) for x in jax.tree.leaves(ev)]))
    (l1, n1, p1, e1), (l2, n2, p2, e2) = runs
    # Not bit for bit: LLVM's levels may order a float sum differently (a few ulps).
    np.testing.assert_allclose(l1, l2, rtol=1e-5)
    np.testing.assert_allclose(n1, n2, rtol=1e-4)
    np.testing.assert_allclose(e1, e2, rtol=1e-5)
    assert l1[4] < l1[2] < l1[0]  # it trains
    assert len(p1) == len(p2) > 4
    for x, y in zip(p1, p2, strict=True):  # parameters moved by up to ~6e-2 in these steps
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-4)


def _train(step, fns, plan, batches, seed: int = 0):
    """(final state, each step's metrics as floats) of ``step`` from ``fns.init`` over ``batches``."""
    state = fns.init(jax.random.key_data(jax.random.key(seed)))
    metrics = []
    for b in batches:
        state, m = step(state, *step_args(fns, put_batch(b, plan)))
        metrics.append({k: float(v) for k, v in m.items()})
    return state, metrics


def _run(step, fns, plan, batches):
    state, metrics = _train(step, fns, plan, batches)
    return _leaves(state), [m["train/loss"] for m in metrics]


def test_train_step_compiled_ahead_runs_that_program_and_matches_the_jitted_step():
    fns, plan, _ = _fns()
    batches = _batches(2) * 3  # two batches in turn: the loss on each falls
    ref_state, ref_losses = _run(fns.train_step, fns, plan, batches)  # the jitted step itself

    fns2, plan2, _ = _fns()
    first = step_args(fns2, put_batch(batches[0], plan2))
    ahead = AheadStep(fns2.train_step, fns2.abstract_state, first, plan2.mesh)
    assert ahead.ready(timeout=300)
    state, losses = _run(ahead, fns2, plan2, batches)
    assert ahead.compile_s is not None and ahead.compile_s > 0
    assert fns2.train_step._cache_size() == 0  # every step ran the program compiled ahead, none compiled here
    assert losses == ref_losses
    for x, y in zip(state, ref_state, strict=True):
        assert np.array_equal(x, y)
    assert losses[4] < losses[2] < losses[0]


def test_a_batch_of_other_shapes_goes_to_the_jitted_step():
    fns, plan, _ = _fns()
    ahead = AheadStep(fns.train_step, fns.abstract_state, step_args(fns, put_batch(_batches(1)[0], plan)), plan.mesh)
    state = fns.init(jax.random.key_data(jax.random.key(0)))
    short = LmBatch(np.asarray(_batches(1, rows=4, seq=8, seed=1)[0].tokens))  # 8 positions, not 16
    ref_fns, ref_plan, _ = _fns()
    ref_state, ref_m = ref_fns.train_step(ref_fns.init(jax.random.key_data(jax.random.key(0))),
                                          *step_args(ref_fns, put_batch(short, ref_plan)))
    state, m = ahead(state, *step_args(fns, put_batch(short, plan)))
    assert fns.train_step._cache_size() == 1  # compiled for the new shapes on this call
    assert float(m["train/loss"]) == float(ref_m["train/loss"])
    for x, y in zip(_leaves(state), _leaves(ref_state), strict=True):
        assert np.array_equal(x, y)


def test_the_step_is_traced_on_the_calling_thread_and_compiled_on_another():
    """Tracing holds the GIL: traced on the thread, it would take turns with the state's own
    trace on one core. XLA's compilation does not, so that part runs on the thread."""
    import threading

    where: dict[str, object] = {}

    class Mesh:  # records where the mesh is entered and whether the trace ran inside it
        inside = False

        def __enter__(self):
            where["mesh"] = threading.current_thread().name
            Mesh.inside = True

        def __exit__(self, *exc):
            Mesh.inside = False

    class Step:
        def lower(self, *args):
            where["lower"] = (threading.current_thread().name, Mesh.inside)

            class Lowered:
                def compile(self):
                    where["compile"] = threading.current_thread().name
                    return lambda state, *batch: ("compiled", len(batch))

            return Lowered()

    tokens = jax.numpy.zeros((2, 4), jax.numpy.int32)
    ahead = AheadStep(Step(), None, (tokens, None), Mesh())
    me = threading.current_thread().name
    assert where["lower"] == (me, True) and where["mesh"] == me  # before the constructor returns
    assert not Mesh.inside
    assert ahead.ready(timeout=30) and where["compile"] == "lm_pipeline-compile-ahead"
    assert ahead(None, tokens, None) == ("compiled", 2) and ahead.compile_s is not None


def test_a_compilation_that_fails_ahead_fails_where_the_step_is_called():
    calls = []

    class Broken:
        def lower(self, *args):
            raise RuntimeError("lowering failed")

        def __call__(self, state, *batch):
            calls.append(len(batch))
            raise RuntimeError("lowering failed")

    tokens = jax.numpy.zeros((2, 4), jax.numpy.int32)
    ahead = AheadStep(Broken(), None, (tokens, None))
    assert ahead.ready(timeout=30) and ahead.compile_s is None
    with pytest.raises(RuntimeError, match="lowering failed"):
        ahead(None, tokens, None)
    assert calls == [2]


# --- the token cache of a small corpus ----------------------------------------------------------


def _tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["hello world " * 20, "tokens and caches " * 20],
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<unk>"]))
    d = tmp_path / "tok"
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text('{"eos_token": "<|endoftext|>"}')
    return d


def test_input_bytes_counts_local_files_and_texts_and_gives_up_on_others(tmp_path):
    from lm_pipeline.data.sources.readers import ReaderSettings
    from lm_pipeline.data.sources.shard import Shard

    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_bytes(b"x" * 1000)
    b.write_bytes(b"y" * 234)
    settings = ReaderSettings("text", None, "text", 0, "fail")
    local = [Shard("a", str(a), settings), Shard("b", f"file://{b}", settings)]
    assert cache_build.input_bytes(local) == 1234
    assert cache_build.input_bytes([TextShard("t", ("abc", "de"))]) == 5
    assert cache_build.input_bytes([*local, Shard("s3", "s3://bucket/c.txt", settings)]) is None
    assert cache_build.input_bytes([Shard("gone", str(tmp_path / "missing.txt"), settings)]) is None
    gz = tmp_path / "c.jsonl.gz"
    gz.write_bytes(b"z" * 100)  # compressed: its text may be many times its size
    assert cache_build.input_bytes([Shard("gz", str(gz), ReaderSettings("jsonl", "gzip", "text", 0, "fail"))]) is None


def test_a_small_corpus_is_tokenized_in_process_and_a_large_one_by_workers(tmp_path, monkeypatch):
    tokdir = _tokenizer(tmp_path)
    shards = [TextShard(f"s{i}", tuple(f"hello world {i} tokens {j}" for j in range(30))) for i in range(4)]
    ref = build_cache(str(tmp_path / "ref"), shards, tokdir, num_workers=1, progress=False)

    spawned = []
    real = cache_build._worker_parts

    def counting(todo, workers, *args, **kwargs):
        spawned.append(workers)
        return real(todo, workers, *args, **kwargs)

    monkeypatch.setattr(cache_build, "_resolve_workers", lambda n: 2 if n == 0 else n)  # "all cores" = 2 here
    monkeypatch.setattr(cache_build, "_worker_parts", counting)
    small = build_cache(str(tmp_path / "small"), shards, tokdir, num_workers=0, progress=False)
    assert spawned == []  # a few kB: this process
    assert small["committed"] == ref["committed"]

    monkeypatch.setattr(cache_build, "SMALL_INPUT_BYTES", 100)  # now the corpus counts as large
    large = build_cache(str(tmp_path / "large"), shards, tokdir, num_workers=0, progress=False)
    assert spawned == [2]
    assert large["committed"] == ref["committed"]

    explicit = build_cache(str(tmp_path / "explicit"), shards, tokdir, num_workers=2, progress=False)
    assert spawned == [2, 2]  # a number of workers asked for is never overridden
    assert explicit["committed"] == ref["committed"]


@pytest.mark.parametrize("bad", [None, "nan_f32", "inf_bf16", "neg_inf_f16"])
def test_the_checkpoint_guard_reads_cpu_parameters_in_place(bad, monkeypatch):
    """The finite check before a save (NumPy on CPU arrays, no compiled program) agrees with a
    float64 reference on every floating dtype, and ignores integer leaves."""
    from lm_pipeline.train.guard import params_finite, params_finite_jit

    params = {"w": np.linspace(-3, 3, 12, dtype=np.float32).reshape(3, 4), "b": np.ones(5, ml_dtypes.bfloat16),
              "h": np.full(4, 0.5, np.float16), "count": np.arange(4, dtype=np.int32)}
    if bad == "nan_f32":
        params["w"][1, 2] = np.nan
    elif bad == "inf_bf16":
        params["b"][3] = np.inf
    elif bad == "neg_inf_f16":
        params["h"][0] = -np.inf
    ref = all(np.isfinite(np.asarray(v, np.float64)).all() for k, v in params.items() if k != "count")
    placed = jax.tree.map(jax.numpy.asarray, params)
    assert bool(params_finite_jit(placed)) is ref  # the path for arrays on accelerators or other hosts
    from lm_pipeline.train import guard

    def no_program(_):
        raise AssertionError("CPU parameters are read in place, not by a compiled reduction")

    monkeypatch.setattr(guard, "params_finite_jit", no_program)
    assert params_finite(placed) is ref


FAILS_BEFORE_THE_FIRST_STEP = """
import sys, numpy as np
from lm_pipeline.batch import ArrayDataset
from lm_pipeline.config import load_config
from lm_pipeline.schema import ConfigError
from lm_pipeline.train.run import train
root = sys.argv[1]
cfg = load_config(None, {"model.type": "gpt2", "model.seq_len": 64, "model.hidden_dim": 128, "model.num_heads": 4,
    "model.num_layers": 4, "trainer.train_batch_size": 8, "trainer.mp": "f32", "trainer.num_train_steps": 5,
    "trainer.progress": False, "trainer.initialize_from": root + "/no_such_checkpoint",
    "trainer.checkpointer.base_path": root + "/ckpt", "store.root": root + "/store"})
data = ArrayDataset(np.random.default_rng(0).integers(0, 512, 64 * 64).astype(np.int32), 64)
try:
    train(cfg, train_data=data, vocab_size=512, run_dir=root + "/run")
except ConfigError as e:
    print("ConfigError:", e, flush=True)
    sys.exit(2)
"""


def test_a_run_that_fails_while_the_step_compiles_exits_with_its_error(tmp_path):
    """A config error raised while the train step is still compiling on its thread (here: a
    missing trainer.initialize_from) ends the process with the error's exit status, not with XLA
    aborting under a finalising interpreter (status 134)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", FAILS_BEFORE_THE_FIRST_STEP, str(tmp_path)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "ConfigError:" in out.stdout and "no_such_checkpoint" in out.stdout
    assert "terminate called" not in out.stderr
