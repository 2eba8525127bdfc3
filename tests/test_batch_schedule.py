"""Levanter's batch-size schedule (``trainer.train_batch_size: [{start, value}, ...]``), each
behaviour against a reference computed apart from the code under test:

- the rows each step of a real training run reads, against a brute-force enumeration in NumPy
  (per-step sizes from a plain loop over the schedule, consecutive positions, the row order of a
  position from the epoch permutation), also for a mixture (its blocks, shares, phases and each
  component's row order enumerated position by position from the documented rules) and across an
  epoch boundary;
- a constant two-entry schedule over a mixture, against the fixed-batch mixture a plain run reads
  (rows, segment ids, length under each stop strategy);
- the parameters after a schedule run with gradient accumulation, against a plain Optax Adam
  loop over the same model's loss (its logits, a log-softmax here) on the brute-force rows;
- a run interrupted in the middle of its schedule and resumed, against the uninterrupted run;
- one compiled train step per distinct batch size; the logged batch sizes and tokens;
- run lengths from a token budget or epochs, against the step found by summing sizes;
- config problems, each in one line naming the entry, all at once.
"""

from __future__ import annotations

import hashlib

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers.resume import assert_resumed_to, crash_after_step, params

from lm_pipeline.batch import ArrayDataset, LmBatch, epoch_permutation
from lm_pipeline.config import load_config
from lm_pipeline.data.mixture import MixtureBatchSource
from lm_pipeline.fingerprint import semantic_view
from lm_pipeline.schema import ConfigError
from lm_pipeline.train import run as run_module
from lm_pipeline.train.run import train
from lm_pipeline.train.trackers import read_metrics

SEQ, VOCAB, ROWS = 16, 50, 23  # 23 rows: the schedules below run past the first epoch
CFG = {
    "model.type": "gpt2", "model.seq_len": SEQ, "model.hidden_dim": 16, "model.num_heads": 2, "model.num_layers": 2,
    "model.gradient_checkpointing": False, "trainer.mp": "f32", "trainer.progress": False,
    "trainer.steps_per_eval": 1000, "trainer.log_every": 1, "trainer.id": "sched",
    "optimizer.learning_rate": 1e-2, "optimizer.warmup": 0, "optimizer.lr_schedule": "constant",
    "optimizer.max_grad_norm": None, "optimizer.weight_decay": 0.0, "optimizer.epsilon": 1e-4,
}
SCHEDULE = [{"start": 0, "value": 4}, {"start": 2, "value": 8}, {"start": 4, "value": 2}]


def sizes_by_brute_force(schedule: list[dict], steps: int) -> list[int]:
    """Each step's batch size: the value of the last entry whose start is at or before it."""
    out = []
    for k in range(steps):
        size = None
        for entry in schedule:
            if entry["start"] <= k:
                size = entry["value"]
        out.append(size)
    return out


def positions_by_brute_force(schedule: list[dict], steps: int) -> list[list[int]]:
    """Each step's positions in the run's row order: the next `size` positions after the earlier steps'."""
    out, cursor = [], 0
    for size in sizes_by_brute_force(schedule, steps):
        out.append(list(range(cursor, cursor + size)))
        cursor += size
    return out


def epoch_rows(positions: list[int], n: int, seed: int = 0) -> list[int]:
    """The row at each position of the `epoch` order: epoch p // n's permutation at p % n."""
    return [int(epoch_permutation(n, seed, p // n)[p % n]) for p in positions]


class Recording(ArrayDataset):
    """Records the rows each read returns: what really reaches the train step."""

    def __init__(self, rows: int = ROWS, seed: int = 0):
        super().__init__(np.random.default_rng(seed).integers(0, VOCAB, rows * SEQ), SEQ)
        self.reads: list[list[int]] = []

    def get_many(self, indices):
        self.reads.append([int(i) for i in indices])
        return super().get_many(indices)


def step_reads(data: Recording, step0: list[int]) -> list[list[int]]:
    """The reads of the steps: the first read is the trainer's look at step 0's rows ``step0``
    (segment ids or not), whatever step the run starts at."""
    assert data.reads[0] == step0
    return data.reads[1:]


def config(tmp_path, schedule=SCHEDULE, steps=6, **extra):
    return load_config(None, {**CFG, "trainer.train_batch_size": schedule, "trainer.num_train_steps": steps,
                              "trainer.log_dir": str(tmp_path / "logs"), **extra})


def capture_step_functions(monkeypatch) -> list:
    """The step functions the run builds (the real ones, kept for inspection)."""
    built = []
    real = run_module.build_step_functions

    def build(*args, **kwargs):
        built.append(real(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(run_module, "build_step_functions", build)
    return built


def test_each_step_reads_the_next_rows_of_its_size_and_compiles_once_per_size(tmp_path, monkeypatch):
    built = capture_step_functions(monkeypatch)
    data = Recording()
    res = train(config(tmp_path, **{"trainer.per_device_parallelism": 2}), train_data=data, vocab_size=VOCAB,
                run_dir=str(tmp_path / "run"))
    assert res.final_step == 6
    expected = [epoch_rows(p, ROWS) for p in positions_by_brute_force(SCHEDULE, 6)]
    assert step_reads(data, expected[0]) == expected
    # 28 positions over 23 rows: the first epoch is read whole, each row once, before any repeats
    first_epoch = [r for step in expected for r in step][:ROWS]
    assert sorted(first_epoch) == list(range(ROWS))
    (fns,) = built
    assert sorted({fns.batch_rows, *fns.other_train_steps}) == [2, 4, 8]
    # one compiled program per distinct size, not per step; the first size's was compiled ahead
    # (lm_pipeline.train.precompile) and ran every step of that size, so its jit compiled none
    assert fns.train_step._cache_size() == 0
    for fn in fns.other_train_steps.values():
        assert fn._cache_size() == 1
    rows = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "train/loss" in r]
    assert [r["train/batch_size"] for r in rows] == sizes_by_brute_force(SCHEDULE, 6)
    assert [r["throughput/total_tokens"] for r in rows] == [
        SEQ * sum(sizes_by_brute_force(SCHEDULE, k + 1)) for k in range(6)]


def reference_adam(cfg, data: ArrayDataset, schedule: list[dict], steps: int) -> list[np.ndarray]:
    """A plain Optax Adam loop: the gradient of the model's mean next-token cross-entropy
    (log-softmax of its logits) over each step's brute-force rows, summed two rows at a time
    (one compiled shape) and divided by the step's predicted tokens."""
    oc = cfg.optimizer
    model = cfg.model.build(VOCAB, key=jax.random.split(jax.random.key(cfg.trainer.seed))[0])
    arrays, static = eqx.partition(model, eqx.is_array)

    def loss_sum(p, tokens):
        logits = eqx.combine(p, static)(tokens, None, key=None, inference=True)
        logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
        return -jnp.sum(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))

    tx = optax.adam(oc.learning_rate, b1=oc.beta1, b2=oc.beta2, eps=oc.epsilon)
    opt = tx.init(arrays)
    grad_sum = jax.jit(jax.grad(loss_sum))

    @jax.jit
    def update(arrays, opt, grads):
        updates, opt = tx.update(grads, opt, arrays)
        return optax.apply_updates(arrays, updates), opt

    for positions in positions_by_brute_force(schedule, steps):
        tokens = data.rows[epoch_rows(positions, len(data))]
        total = None
        for i in range(0, len(tokens), 2):
            g = grad_sum(arrays, jnp.asarray(tokens[i:i + 2]))
            total = g if total is None else jax.tree.map(jnp.add, total, g)
        grads = jax.tree.map(lambda x, n=len(tokens) * (SEQ - 1): x / n, total)
        arrays, opt = update(arrays, opt, grads)
    return [np.asarray(x) for x in jax.tree.leaves(arrays)]


def test_parameters_equal_a_plain_optax_loop_on_the_brute_force_rows(tmp_path):
    # sizes 4, 8, 2: 2, 4 and 1 micro-batches of 2 rows; 28 rows over 23, across an epoch boundary
    cfg = config(tmp_path, SCHEDULE, steps=6, **{"trainer.per_device_parallelism": 2})
    data = ArrayDataset(np.random.default_rng(1).integers(0, VOCAB, ROWS * SEQ), SEQ)
    res = train(cfg, train_data=data, vocab_size=VOCAB, run_dir=str(tmp_path / "run"))
    ours, ref = params(res.state), reference_adam(cfg, data, SCHEDULE, 6)
    assert len(ours) == len(ref)
    start = [np.asarray(x) for x in jax.tree.leaves(eqx.filter(
        cfg.model.build(VOCAB, key=jax.random.split(jax.random.key(0))[0]), eqx.is_array))]
    assert max(float(np.abs(a - b).max()) for a, b in zip(ours, start, strict=True)) > 1e-2  # it learned
    for a, b in zip(ours, ref, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-6)


def test_a_run_resumed_in_the_middle_of_its_schedule_equals_the_uninterrupted_one(tmp_path, monkeypatch):
    extra = {"trainer.checkpointer.keep": [{"every": 3}], "trainer.per_device_parallelism": 2}
    clean_data = Recording()
    clean = train(config(tmp_path, **extra), train_data=clean_data, vocab_size=VOCAB, run_dir=str(tmp_path / "clean"))
    run_dir = str(tmp_path / "run")
    data = Recording()
    latest = crash_after_step(monkeypatch, 4, lambda: train(config(tmp_path, **extra), train_data=data,
                                                           vocab_size=VOCAB, run_dir=run_dir), run_dir)
    assert latest.endswith("step-3")  # inside the 8-row segment: steps 3.. read from position 16 on
    data.reads.clear()
    resumed = train(config(tmp_path, **extra), train_data=data, vocab_size=VOCAB, run_dir=run_dir)
    assert resumed.resumed_from.endswith("step-3") and resumed.final_step == 6
    expected = [epoch_rows(p, ROWS) for p in positions_by_brute_force(SCHEDULE, 6)]
    assert step_reads(data, expected[0]) == expected[3:]
    assert step_reads(clean_data, expected[0]) == expected
    assert_resumed_to(clean.state, resumed.state, run_dir, "step-3")


def component_seed_by_hand(seed: int, name: str) -> int:
    """A component's row-order seed as documented (lm_pipeline.data.mixture.component_seed)."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little")


def mixture_rows_by_brute_force(names: list[str], lengths: dict[str, int], phases: list[tuple[int, dict]],
                                block_size: int, seed: int, count: int) -> list[tuple[str, int]]:
    """(component, row) of the run's positions 0..count-1, one position at a time, from the mixture's
    documented rules: each phase (given by its first row) is cut into blocks of ``block_size`` rows from
    that row (the last block before the next phase short); a block holds int(w / total * rows) rows of
    each component and the rest goes to the one with the most (the first on a tie), laid out as
    ``repeat(components, counts)`` in the block's seeded permutation; a component's j-th draw is row
    j % n of its epoch j // n permutation under its own seed."""
    starts = [row for row, _ in phases]
    drawn = [n for n in names if any(w.get(n, 0) > 0 for _, w in phases)]
    draws = dict.fromkeys(drawn, 0)
    out = []
    for pos in range(count):
        q = max(i for i, row in enumerate(starts) if row <= pos)
        weights = phases[q][1]
        block = (pos - starts[q]) // block_size
        first = starts[q] + block * block_size
        size = min(block_size, (starts[q + 1] if q + 1 < len(starts) else first + block_size) - first)
        total = sum(weights.values())
        counts = [int(weights.get(n, 0) / total * size) for n in drawn]
        largest = max((i for i, n in enumerate(drawn) if weights.get(n, 0) > 0), key=lambda i: (counts[i], -i))
        counts[largest] += size - sum(counts)
        order = np.random.Generator(np.random.PCG64([seed, 0xB10C, q, block])).permutation(size)
        name = drawn[int(np.repeat(np.arange(len(drawn)), counts)[order][pos - first])]
        j, n = draws[name], lengths[name]
        draws[name] += 1
        out.append((name, int(epoch_permutation(n, component_seed_by_hand(seed, name), j // n)[j % n])))
    return out


def test_a_mixture_reads_by_position_and_its_phases_start_at_the_steps_rows(tmp_path):
    """What a real schedule run reads from each component, step by step, against the brute-force
    mixture (no code of the mixture's), its phase given at step 3 starting at row 16."""
    datasets = {"a": Recording(17, seed=2), "b": Recording(11, seed=3)}
    weights = [[0, {"a": 0.75, "b": 0.25}], [3, {"a": 0.25, "b": 0.75}]]
    cfg = config(tmp_path, data={"configs": {"a": {"train_urls": ["a.jsonl"]}, "b": {"train_urls": ["b.jsonl"]}},
                                 "train_weights": weights, "mixture_block_size": 4},
                 **{"trainer.per_device_parallelism": 2})
    train(cfg, train_data=datasets, vocab_size=VOCAB, run_dir=str(tmp_path / "run"))
    positions = positions_by_brute_force(SCHEDULE, 6)
    # the phase given at step 3 starts at the row after steps 0..2's: 4 + 4 + 8
    phase_row = len([p for step in positions[:3] for p in step])
    assert phase_row == 16
    drawn = mixture_rows_by_brute_force(["a", "b"], {"a": 17, "b": 11}, [(0, weights[0][1]), (phase_row, weights[1][1])],
                                        4, cfg.trainer.seed, positions[-1][-1] + 1)
    assert {r for n, r in drawn if n == "b"} == set(range(11))  # b runs past its first epoch
    got = {n: d.reads[1:] for n, d in datasets.items()}  # reads[0]: the look at step 0
    for k, step in enumerate(positions):
        for name in ("a", "b"):
            want = [drawn[p][1] for p in step if drawn[p][0] == name]
            if want:
                assert got[name].pop(0) == want, (k, name)
    assert got == {"a": [], "b": []}


class Segmented(ArrayDataset):
    """Rows with segment ids (two documents a row, split where the row's id says)."""

    has_segments = True

    def get_many(self, indices):
        idx = np.asarray(indices, np.int64)
        seg = np.where(np.arange(SEQ)[None, :] < (3 + idx[:, None] % (SEQ - 4)), 1, 2).astype(np.int32)
        return LmBatch(self.rows[idx], seg)


@pytest.mark.parametrize("data", [
    {"stop_strategy": "restart"},
    {"stop_strategy": "first_exhausted"},
    {"stop_strategy": "all_exhausted", "shuffle": "era", "era_length": 4},
], ids=["restart", "first_exhausted", "era"])
def test_a_constant_schedule_over_a_mixture_reads_what_the_fixed_batch_mixture_reads(data):
    """[{0: 6}, {3: 6}]: the scheduled mixture (as a schedule run builds it) reads, step by step, the
    rows and segment ids the plain fixed-batch mixture of 6 (as a fixed-batch run builds it) reads, with
    its phase at step 3 starting at row 18 (inside a block of 4: a short block ends the first phase),
    over the same length; and both are the brute-force mixture's rows."""
    from lm_pipeline.data.mixture import mixture_source
    from lm_pipeline.train.batch_schedule import scheduled_mixture

    B, lengths = 6, {"a": 17, "b": 11, "c": 9}
    weights = [[0, {"a": 0.5, "b": 0.25, "c": 0.25}], [3, {"a": 0.25, "b": 0.75, "c": 0.0}]]
    cfg = load_config(None, {"data.configs": {n: {"train_urls": [f"{n}.jsonl"]} for n in lengths},
                             "data.train_weights": weights, "data.mixture_block_size": 4,
                             **{f"data.{k}": v for k, v in data.items()},
                             "trainer.train_batch_size": [{"start": 0, "value": B}, {"start": 3, "value": B}]})
    sets = {n: Segmented(np.random.default_rng(i).integers(0, VOCAB, m * SEQ), SEQ) for i, (n, m) in enumerate(lengths.items())}
    scheduled = scheduled_mixture(cfg.data, sets, cfg.trainer.batch_schedule, 0, process_index=0, process_count=1)
    fixed = mixture_source(cfg.data, sets, B, 0, process_index=0, process_count=1)
    assert scheduled.num_steps == fixed.num_steps
    steps = 10 if fixed.num_steps is None else fixed.num_steps
    assert steps >= 4  # past the phase at step 3
    for k in range(steps):
        got, want = scheduled.batch(k), fixed.batch(k)
        np.testing.assert_array_equal(got.tokens, want.tokens, err_msg=f"step {k}")
        np.testing.assert_array_equal(got.segment_ids, want.segment_ids, err_msg=f"step {k}")
        assert got.loss_mask is None and want.loss_mask is None
        np.testing.assert_array_equal(np.stack(scheduled.global_rows(k)), np.stack(fixed.global_rows(k)))
    if fixed.num_steps is not None:
        for source in (scheduled, fixed):
            with pytest.raises(IndexError, match="past the mixture's end"):
                source.batch(fixed.num_steps)
    if data.get("shuffle") != "era":  # the brute force knows the epoch order
        drawn = mixture_rows_by_brute_force(list(lengths), lengths, [(0, weights[0][1]), (3 * B, weights[1][1])],
                                            4, 0, steps * B)
        rows = np.stack([sets[n].rows[r] for n, r in drawn])
        np.testing.assert_array_equal(np.concatenate([fixed.batch(k).tokens for k in range(steps)]), rows)


def test_run_lengths_from_tokens_and_epochs_sum_the_schedule():
    tc = load_config(None, {"trainer.train_batch_size": SCHEDULE, "trainer.train_tokens": 21 * SEQ}).trainer
    sizes = sizes_by_brute_force(SCHEDULE, 100)
    want = next(k for k in range(1, 100) if sum(sizes[:k]) >= 21)  # 4 + 4 + 8 + 8 = 24 >= 21
    assert tc.resolve_num_steps(None, SEQ) == want == 4
    tc = load_config(None, {"trainer.train_batch_size": SCHEDULE, "trainer.num_epochs": 2}).trainer
    want = next(k for k in range(1, 100) if sum(sizes[:k]) >= 2 * ROWS)  # 24 + 2 * 11 = 46 >= 46
    assert tc.resolve_num_steps(ROWS, SEQ) == want == 15


def test_schedule_enters_the_fingerprint_and_a_plain_size_keeps_its_own():
    plain = semantic_view(load_config(None, {"trainer.train_batch_size": 64}).trainer)
    assert plain["train_batch_size"] == 64
    assert semantic_view(load_config(None, {"trainer.train_batch_size": [{"start": 0, "value": 64}]}).trainer) == plain
    a = semantic_view(load_config(None, {"trainer.train_batch_size": SCHEDULE}).trainer)
    b = semantic_view(load_config(None, {"trainer.batch_size": [{"start": 0, "value": 4}, {"start": 3, "value": 8}]}).trainer)
    assert a["train_batch_size"] == SCHEDULE and len({str(plain), str(a), str(b)}) == 3
    # the run's id (train(...) without one; the pipeline's train_ckpt address hashes the same semantics)
    ids = [run_module.run_id_for(load_config(None, {"trainer.train_batch_size": v}), "data")
           for v in (64, [{"start": 0, "value": 64}], SCHEDULE)]
    assert ids[0] == ids[1] != ids[2]


def test_config_problems_of_a_schedule_are_reported_together_naming_each_entry():
    bad = [{"start": 1, "value": 4}, {"start": 1, "value": 0}, {"start": "x", "value": 8, "size": 2}, 16]
    with pytest.raises(ConfigError) as err:
        load_config(None, {"trainer.train_batch_size": bad})
    text = str(err.value)
    assert text.startswith("6 problems: ") and "\n" not in text
    for where in ("[0].start", "[1].start", "[1].value", "[2].start", "[2].size", "[3]"):
        assert f"'trainer.train_batch_size{where}'" in text, where
    with pytest.raises(ConfigError, match="at least one entry"):
        load_config(None, {"trainer.train_batch_size": []})
    # each size splits into micro-batches as a plain size must
    with pytest.raises(ConfigError) as err:
        load_config(None, {"trainer.train_batch_size": [{"start": 0, "value": 6}, {"start": 5, "value": 10}],
                           "trainer.per_device_parallelism": 4})
    assert "trainer.train_batch_size[0].value" in str(err.value) and "trainer.train_batch_size[1].value" in str(err.value)
    with pytest.raises(ConfigError, match=r"train_batch_size\[1\].value.*3 is not divisible by the 2 data-parallel"):
        load_config(None, {"trainer.train_batch_size": [{"start": 0, "value": 4}, {"start": 5, "value": 3}]}
                    ).trainer.check_devices(2)
    load_config(None, {"trainer.train_batch_size": SCHEDULE}).trainer.check_devices(2)


def test_levanter_schedule_as_written_loads():
    raw = {"train_batch_size": [{"start": 0, "value": 64}, {"start": 64, "value": 128}, {"start": 256, "value": 64},
                                {"start": 1024, "value": 256}], "allow_nondivisible_batch_size": True,
           "per_device_parallelism": -1}
    tc = load_config(None, {f"trainer.{k}": v for k, v in raw.items()}).trainer
    s = tc.batch_schedule
    assert [s.batch_size_at(k) for k in (0, 63, 64, 255, 256, 1023, 1024, 5000)] == [64, 64, 128, 128, 64, 64, 256, 256]
    assert s.offset_at(1024) == 64 * 64 + 192 * 128 + 768 * 64 == sum(sizes_by_brute_force(raw["train_batch_size"], 1024))


def test_processes_read_contiguous_slices_that_make_up_the_step():
    from lm_pipeline.batch import StepBatchSource
    from lm_pipeline.train.batch_schedule import ScheduledBatchSource, scheduled_mixture

    tc = load_config(None, {"trainer.train_batch_size": SCHEDULE}).trainer
    data = ArrayDataset(np.arange(ROWS * SEQ), SEQ)
    order = StepBatchSource(data, 1, 0)
    parts = [ScheduledBatchSource(order, tc.batch_schedule, process_index=i, process_count=2) for i in range(2)]
    for k, positions in enumerate(positions_by_brute_force(SCHEDULE, 8)):
        want = epoch_rows(positions, ROWS)
        assert [int(r) for p in parts for r in p.local_indices(k)] == want
        assert [int(r) for r in parts[0].global_indices(k)] == want
        np.testing.assert_array_equal(np.concatenate([p.batch(k).tokens for p in parts]), data.rows[want])
    cfg = load_config(None, {"data.configs": {"a": {"train_urls": ["a.jsonl"]}, "b": {"train_urls": ["b.jsonl"]}},
                             "data.train_weights": {"a": 0.5, "b": 0.5}, "data.mixture_block_size": 4})
    sets = {"a": ArrayDataset(np.arange(17 * SEQ), SEQ), "b": ArrayDataset(1000 + np.arange(11 * SEQ), SEQ)}
    mixed = [scheduled_mixture(cfg.data, sets, tc.batch_schedule, 0, process_index=i, process_count=2)
             for i in range(2)]
    with pytest.raises(ValueError, match="batch size 4 of the schedule is not divisible by process_count 3"):
        scheduled_mixture(cfg.data, sets, load_config(None, {"trainer.train_batch_size": [
            {"start": 0, "value": 6}, {"start": 1, "value": 4}]}).trainer.batch_schedule, 0, process_count=3)
    reference = MixtureBatchSource(sets, {"a": 0.5, "b": 0.5}, 4, 0, block_size=4)  # one phase: rows by position
    for k, positions in enumerate(positions_by_brute_force(SCHEDULE, 8)):
        component, rows = reference.rows_at(positions)
        want = np.stack([sets[reference.names[c]].rows[r] for c, r in zip(component, rows, strict=True)])
        np.testing.assert_array_equal(np.concatenate([m.batch(k).tokens for m in mixed]), want)
