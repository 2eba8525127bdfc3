"""Data mixtures: the config (Levanter's shape, every problem reported at once, dotted overrides
into components) and the step-indexed mixture (lm_pipeline.data.mixture).

Expected values come from plain Python written here: Levanter's rounding of a block (rows =
int(weight / total * block), the rows left over to the largest count), blocks counted from each
phase's first row (step x batch size), and the stop strategies' lengths found by walking the
sequence of components. Every row's tokens name its component and row, so the checks read what
the batches hold, not what the sampler says it did.
"""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from lm_pipeline.batch import ArrayDataset, StepBatchSource
from lm_pipeline.config import dump_config, load_config
from lm_pipeline.data.config import ConfigProblems, DataConfig
from lm_pipeline.data.mixture import MixtureBatchSource, mixture_source
from lm_pipeline.schema import ConfigError

SEQ = 4
TAG = 100_000  # a row's tokens are component_index * TAG + row


def datasets(sizes: dict[str, int]) -> dict[str, ArrayDataset]:
    """Component i's row r holds the token i * TAG + r in every position."""
    return {name: ArrayDataset(np.repeat(np.arange(n) + i * TAG, SEQ), SEQ) for i, (name, n) in enumerate(sizes.items())}


def read(batch, names: list[str]) -> list[tuple[str, int]]:
    """(component, row) of each row of a batch, from its tokens."""
    assert (batch.tokens == batch.tokens[:, :1]).all()
    return [(names[t // TAG], t % TAG) for t in batch.tokens[:, 0].tolist()]


def run_rows(src: MixtureBatchSource, steps: int, names: list[str]) -> list[tuple[str, int]]:
    return [r for k in range(steps) for r in read(src.batch(k), names)]


def levanter_counts(weights: dict[str, float], names: list[str], size: int) -> dict[str, int]:
    """Rows per component in a block of ``size`` rows: int(w / total * size), the rest to the
    largest count (the first such name of positive weight)."""
    total = sum(weights.values())
    counts = {n: int(weights[n] / total * size) if weights.get(n, 0) > 0 else 0 for n in names}
    largest = None
    for n in names:
        if weights.get(n, 0) > 0 and (largest is None or counts[n] > counts[largest]):
            largest = n
    counts[largest] += size - sum(counts.values())
    return {n: c for n, c in counts.items() if c}


def blocks(phases: list[tuple[int, dict[str, float]]], batch: int, block: int, rows: int):
    """(start, end, weights) of each block within the first ``rows`` rows: blocks counted from each
    phase's first row (step x batch), a phase's last block cut at the next phase's first row."""
    starts = [step * batch for step, _ in phases] + [None]
    for (_, weights), start, end in zip(phases, starts, starts[1:], strict=False):
        lo = start
        while lo < (rows if end is None else min(end, rows)):
            hi = lo + block if end is None else min(lo + block, end)
            yield lo, hi, weights
            lo = hi


# --- the mixture -------------------------------------------------------------------------------


@pytest.mark.parametrize("weights", [{"web": 7, "code": 2, "books": 1}, {"web": 0.35, "code": 0.65, "books": 0.0},
                                     {"web": 1, "code": 1, "books": 1}])
def test_every_block_holds_each_share_exactly(weights):
    names, B, S = ["web", "code", "books"], 40, 256
    src = MixtureBatchSource(datasets({"web": 5000, "code": 3000, "books": 900}), weights, B, seed=5, block_size=S)
    rows = run_rows(src, 250, names)  # 10,000 sequences
    checked = 0
    for lo, hi, w in blocks([(0, weights)], B, S, len(rows)):
        if hi - lo == S and hi <= len(rows):
            got = Counter(name for name, _ in rows[lo:hi])
            assert dict(got) == levanter_counts(w, names, S), (lo, dict(got))
            checked += 1
    assert checked == 10_000 // S
    total = sum(weights.values())
    got = Counter(name for name, _ in rows)
    for name in names:
        assert abs(got[name] / len(rows) - weights[name] / total) < 0.005, name
    # placed by a permutation, not in runs: the first block does not start with a run of one component
    assert len({name for name, _ in rows[:20]}) > 1


def test_rounding_is_levanters_not_nearest():
    # 0.35 and 0.65 of 10 rows: 3 and 6 rounded down, the row left over to the larger (7), where
    # rounding to nearest would give 4 and 6
    src = MixtureBatchSource(datasets({"a": 100, "b": 100}), {"a": 0.35, "b": 0.65}, 10, seed=0, block_size=10)
    for k in range(5):
        assert Counter(name for name, _ in read(src.batch(k), ["a", "b"])) == {"a": 3, "b": 7}


def test_a_batch_is_a_pure_function_of_the_step():
    sizes, w = {"a": 70, "b": 500, "c": 33}, [[0, {"a": 1, "b": 3}], [9, {"a": 1, "b": 1, "c": 1}]]
    run = MixtureBatchSource(datasets(sizes), w, 12, seed=3, block_size=32)
    seen = {k: run.batch(k).tokens for k in range(40)}  # in order, as a training run reads them
    for k in (0, 8, 9, 23, 39):
        fresh = MixtureBatchSource(datasets(sizes), w, 12, seed=3, block_size=32)  # a resumed run at step k
        np.testing.assert_array_equal(fresh.batch(k).tokens, seen[k])
    backwards = MixtureBatchSource(datasets(sizes), w, 12, seed=3, block_size=32)
    for k in reversed(range(40)):
        np.testing.assert_array_equal(backwards.batch(k).tokens, seen[k])
    np.testing.assert_array_equal(run.batch(5).tokens, seen[5])  # again, after later steps
    jumping = MixtureBatchSource(datasets(sizes), w, 12, seed=3, block_size=32)
    for k in np.random.default_rng(0).permutation(40).tolist():  # a block of one phase, then the other's
        np.testing.assert_array_equal(jumping.batch(k).tokens, seen[k])
    other = MixtureBatchSource(datasets(sizes), w, 12, seed=4, block_size=32)
    assert any(not np.array_equal(other.batch(k).tokens, seen[k]) for k in range(5))


class Recording(ArrayDataset):
    def __init__(self, *args):
        super().__init__(*args)
        self.read: list[int] = []

    def get_many(self, indices):
        self.read.extend(int(i) for i in indices)
        return super().get_many(indices)


def test_process_slices_concatenate_to_the_global_batch_and_read_only_their_rows():
    sizes, w, B = {"a": 90, "b": 400}, {"a": 1, "b": 2}, 16
    world = MixtureBatchSource(datasets(sizes), w, B, seed=1, block_size=24)
    for count in (2, 4):
        procs = []
        for i in range(count):
            ds = {n: Recording(d.rows.reshape(-1), SEQ) for n, d in datasets(sizes).items()}
            procs.append((ds, MixtureBatchSource(ds, w, B, seed=1, block_size=24, process_index=i, process_count=count)))
        for k in range(0, 30, 7):
            whole = world.batch(k).tokens
            np.testing.assert_array_equal(np.concatenate([p.batch(k).tokens for _, p in procs]), whole)
            for i, (ds, _) in enumerate(procs):
                mine = whole[i * B // count:(i + 1) * B // count, 0]
                read_rows = {(n, r) for n, d in ds.items() for r in d.read}
                assert read_rows == {("ab"[t // TAG], t % TAG) for t in mine.tolist()}
                for d in ds.values():
                    d.read.clear()


@pytest.mark.parametrize("step", [32, 37])  # 32 x 24 rows: a block boundary; 37 x 24: inside a block
def test_a_phase_starts_exactly_at_its_step(step):
    names, B, S = ["a", "b", "c"], 24, 64
    only = MixtureBatchSource(datasets({"a": 999, "b": 999, "c": 9}), [[0, {"a": 1}], [step, {"b": 1}]], B, seed=2,
                              block_size=S)
    for k in range(step + 5):
        assert {name for name, _ in read(only.batch(k), names)} == {"a" if k < step else "b"}, k
    phases = [(0, {"a": 3, "b": 1}), (step, {"a": 1, "b": 1, "c": 2})]
    src = MixtureBatchSource(datasets({"a": 999, "b": 999, "c": 999}), [list(p) for p in phases], B, seed=2, block_size=S)
    rows = run_rows(src, step + 30, names)
    shapes = []
    for lo, hi, w in blocks(phases, B, S, len(rows)):
        if hi <= len(rows):
            assert dict(Counter(n for n, _ in rows[lo:hi])) == levanter_counts(w, names, hi - lo), (lo, hi)
            shapes.append(hi - lo)
    assert (step * B % S == 0) == (set(shapes) == {S})  # a short block only where the phase starts inside one


def test_the_levanter_yaml_runs_its_phases_at_their_steps(tmp_path):
    cfg = load_config(write(tmp_path, LEVANTER_YAML)).data
    sizes = {"web": 50_000, "code": 20_000, "books": 9_000}
    src = mixture_source(cfg, datasets(sizes), 32, seed=0, process_index=0, process_count=1)
    names = list(sizes)
    assert {n for n, _ in read(src.batch(4999), names)} <= {"web", "code"}
    rows = [r for k in range(5000, 5000 + 2 * 2048 // 32) for r in read(src.batch(k), names)]
    first_block = Counter(n for n, _ in rows[:2048])  # the phase's blocks start at its first row
    assert dict(first_block) == levanter_counts({"web": 0.5, "code": 0.3, "books": 0.2}, names, 2048)
    # the block before it is the first phase's short one: 5000 x 32 rows = 78 blocks + 256 rows
    before = [r for k in range(5000 - 8, 5000) for r in read(src.batch(k), names)]
    assert dict(Counter(n for n, _ in before)) == levanter_counts({"web": 0.8, "code": 0.2}, names, 256)


def first_repeat(rows: list[tuple[str, int]], name: str, size: int) -> int | None:
    """The position where component ``name`` draws its (size + 1)-th row, if it does."""
    seen = 0
    for pos, (n, _) in enumerate(rows):
        if n == name:
            if seen == size:
                return pos
            seen += 1
    return None


def test_stop_strategies_lengths_and_wrap_around():
    sizes, w, B, S = {"a": 30, "b": 200, "c": 45}, {"a": 1, "b": 2, "c": 1}, 8, 16
    names = list(sizes)
    restart = MixtureBatchSource(datasets(sizes), w, B, seed=9, block_size=S)
    assert restart.num_steps is None
    rows = run_rows(restart, 200, names)
    runs_out = {n: first_repeat(rows, n, sizes[n]) for n in names}
    assert None not in runs_out.values()
    for n in names:  # restart: each epoch of a component is a permutation of its rows, new each epoch
        mine = [r for m, r in rows if m == n]
        epochs = [mine[i:i + sizes[n]] for i in range(0, len(mine) - sizes[n] + 1, sizes[n])]
        assert len(epochs) >= 2
        assert all(sorted(e) == list(range(sizes[n])) for e in epochs), n
        assert epochs[0] != epochs[1], n
    for strategy, end in (("first_exhausted", min(runs_out.values())), ("all_exhausted", max(runs_out.values()))):
        src = MixtureBatchSource(datasets(sizes), w, B, seed=9, block_size=S, stop_strategy=strategy)
        assert src.length()[0] == end, strategy
        assert src.num_steps == end // B
        got = run_rows(src, src.num_steps, names)
        assert got == rows[: src.num_steps * B]  # the same rows as restart's, up to the end
        with pytest.raises(IndexError, match="past the mixture's end"):
            src.batch(src.num_steps)
        if strategy == "first_exhausted":
            assert len(set(got)) == len(got)  # no component repeats a row
        else:  # every row of every component is read; the ones that ran out earlier wrapped
            assert set(rows[:end]) == {(n, r) for n in names for r in range(sizes[n])}
            assert len(set(rows[:end])) < end


def test_a_component_whose_weight_drops_to_zero_never_runs_out():
    sizes = {"a": 1000, "b": 50}
    w = [[0, {"a": 1, "b": 1}], [10, {"b": 1}]]
    rows = run_rows(MixtureBatchSource(datasets(sizes), w, 4, seed=0, block_size=8), 40, list(sizes))
    assert first_repeat(rows, "a", 1000) is None
    src = MixtureBatchSource(datasets(sizes), w, 4, seed=0, block_size=8, stop_strategy="all_exhausted")
    assert src.length() == (first_repeat(rows, "b", 50), "b")


def test_rows_at_gives_the_rows_of_global_indices():
    src = StepBatchSource(ArrayDataset(np.arange(37 * 3), 3), 5, seed=4)
    flat = np.concatenate([src.global_indices(k) for k in range(12)])
    np.testing.assert_array_equal(src.rows_at(np.arange(60)), flat)
    np.testing.assert_array_equal(src.rows_at([59, 3, 44]), flat[[59, 3, 44]])


# --- the config --------------------------------------------------------------------------------


LEVANTER_YAML = """\
data:
  cache_dir: cache/mix
  tokenizer: gpt2
  configs:
    web:   {train_urls: ["s3://b/web/train.{1..64}.jsonl.zst"], validation_urls: ["s3://b/web/val.jsonl.zst"]}
    code:  {id: some/hf-dataset, cache_dir: cache/code}
    books: {train_urls: ["books/*.parquet"]}
  train_weights:                # constant: {web: 0.7, code: 0.2, books: 0.1}; or phases by step:
    - [0,    {web: 0.8, code: 0.2}]
    - [5000, {web: 0.5, code: 0.3, books: 0.2}]
  stop_strategy: restart        # first_exhausted | all_exhausted | restart
  mixture_block_size: 2048
"""


def write(tmp_path: Path, text: str, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_the_levanter_shaped_yaml_loads(tmp_path):
    path = write(tmp_path, LEVANTER_YAML)
    data = load_config(path).data
    assert list(data.configs) == ["web", "code", "books"]
    assert data.configs["web"].train_urls == ("s3://b/web/train.{1..64}.jsonl.zst",)
    assert data.configs["web"].validation_urls == ("s3://b/web/val.jsonl.zst",)
    assert (data.configs["code"].hf_id, data.configs["code"].cache_dir) == ("some/hf-dataset", "cache/code")
    assert data.train_weights == ((0, {"web": 0.8, "code": 0.2}), (5000, {"web": 0.5, "code": 0.3, "books": 0.2}))
    assert (data.stop_strategy, data.mixture_block_size, data.cache_dir) == ("restart", 2048, "cache/mix")
    assert (data.tokenizer.kind, data.tokenizer.name_or_path) == ("hf", "gpt2")
    assert data.train_sources() == []
    again = write(tmp_path, dump_config(load_config(path)), "dumped.yaml")
    assert load_config(again) == load_config(path)
    const = load_config(path, ["--data.train_weights", "{web: 0.7, code: 0.2, books: 0.1}"]).data
    assert const.train_weights == {"web": 0.7, "code": 0.2, "books": 0.1}


def test_dotted_overrides_reach_into_components(tmp_path):
    path = write(tmp_path, LEVANTER_YAML)
    data = load_config(path, ["--data.configs.web.train_urls", "[a.jsonl, b.jsonl]",
                              "--data.configs.code.hf_id", "other/dataset",  # the file says `id:`
                              "--data.configs.new.validation_urls", "[v.jsonl]",
                              "--data.stop_strategy", "all_exhausted"]).data
    assert data.configs["web"].train_urls == ("a.jsonl", "b.jsonl")
    assert data.configs["code"].hf_id == "other/dataset"
    assert data.configs["new"].validation_urls == ("v.jsonl",)
    assert data.stop_strategy == "all_exhausted"


def problems_of(excinfo) -> dict[str, str]:
    err = excinfo.value
    found = err.problems if isinstance(err, ConfigProblems) else (err,)
    return {p.path: p.message for p in found}


BAD_YAML = """\
data:
  tokenizer: gpt2
  train_urls: [loose.jsonl]
  configs:
    web: {train_urls: [web.jsonl], min_length: -1}
    code: {id: some/code}
    books: {}
  train_weights:
    - [100, {web: 0.5, code: -1}]
    - [100, {web: 0, code: 0}]
    - [50, {cod: 1}]
  mixture_block_size: 0
"""


def test_every_problem_of_a_mixture_is_reported_at_once(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, BAD_YAML))
    assert set(problems_of(info)) == {
        "data.train_urls",  # a mixture's training data is in its components
        "data.configs.web.min_length",
        "data.configs.books",  # no data at all
        "data.mixture_block_size",
        "data.train_weights[0][0]",  # the first phase starts at 0
        "data.train_weights[0][1].code",  # negative
        "data.train_weights[1][0]",  # not increasing
        "data.train_weights[1][1]",  # no positive weight
        "data.train_weights[2][0]",  # not increasing
        "data.train_weights[2][1].cod",  # no such component
    }
    text = str(info.value)
    assert "did you mean 'code'" in text and "10 problems" in text and "\n" not in text


def test_problems_are_reported_for_dotted_overrides_too(tmp_path):
    path = write(tmp_path, LEVANTER_YAML)
    with pytest.raises(ConfigError) as info:
        load_config(path, ["--data.train_weights", "[[0, {web: 1}], [0, {books: 0.0001, web: 1}]]",
                           "--data.configs.books.train_urls", "[]", "--data.configs.code.hf_shard_rows", "0"])
    got = problems_of(info)
    assert set(got) == {"data.train_weights[1][0]", "data.train_weights[1][1].books", "data.configs.books",
                        "data.configs.code.hf_shard_rows"}
    smallest = next(size for size in range(1, 20_000) if int(0.0001 / 1.0001 * size) >= 1)
    assert f"raise mixture_block_size to at least {smallest}," in got["data.train_weights[1][1].books"]
    assert "weight in train_weights but no training data" in got["data.configs.books"]


@pytest.mark.parametrize("override, field", [
    (["--data.configs.web.tokenizer", "gpt2"], "data.configs.web.tokenizer"),  # shared by the components
    (["--data.train_weights", "[[0, {web: 1}, 3]]"], "data.train_weights[0]"),  # not a [step, weights] pair
    (["--data.train_weights", "[[zero, {web: 1}]]"], "data.train_weights[0][0]"),
    (["--data.train_weights", "{web: lots}"], "data.train_weights.web"),
])
def test_shape_problems_name_their_field(tmp_path, override, field):
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, LEVANTER_YAML), override)
    assert field in problems_of(info)


def test_mixture_fields_without_configs_are_refused_and_a_plain_config_is_unchanged(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(None, ["--data.train_weights", "{web: 1}", "--data.stop_strategy", "first_exhausted"])
    assert set(problems_of(info)) == {"data.train_weights", "data.stop_strategy"}
    plain = load_config(None, ["--data.train_urls", "[a.jsonl]"]).data
    assert (plain.configs, plain.train_weights, plain.stop_strategy, plain.mixture_block_size) == ({}, {}, "restart", 2048)
    assert plain == DataConfig(train_urls=("a.jsonl",))


def test_the_command_line_reports_every_problem_in_one_line(tmp_path):
    path = write(tmp_path, BAD_YAML)
    out = subprocess.run([sys.executable, "-m", "lm_pipeline.cli", "plan", "--config_path", str(path),
                          "--data.configs.books.train_urls", "[b.jsonl]"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: 9 problems:"), out.stderr
    for field in ("data.train_urls", "data.train_weights[2][1].cod", "data.mixture_block_size"):
        assert f"'{field}'" in lines[0]


def test_block_counts_need_no_float_luck():
    """The rows of a block always add up to the block, whatever the weights."""
    from lm_pipeline.data.mixture import block_counts

    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 6))
        w = {f"c{i}": float(x) for i, x in enumerate(rng.random(n) * 10)}
        size = int(rng.integers(n * 4, 5000))
        counts = block_counts(w, list(w), size)
        assert sum(counts) == size and all(c >= math.floor(w[k] / sum(w.values()) * size) for k, c in zip(w, counts, strict=True))


def test_a_source_field_of_the_section_itself_is_refused_in_a_mixture(tmp_path):
    """Set on the section, a source's field would be read by no component: refused, naming it."""
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, LEVANTER_YAML), ["--data.validation_urls", "[v.jsonl]", "--data.text_key", "body",
                                                     "--data.on_invalid", "skip"])
    got = problems_of(info)
    assert set(got) == {"data.validation_urls", "data.text_key", "data.on_invalid"}
    assert "configs.<name>.text_key" in got["data.text_key"]
