"""Config loading: YAML + !include + dotted overrides, strict validation, Levanter aliases."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lm_pipeline.config import RunConfig, dump_config, load_config, parse_overrides
from lm_pipeline.models import Gpt2Config, LlamaConfig
from lm_pipeline.schema import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
    return p


def test_defaults_load():
    cfg = load_config()
    assert isinstance(cfg, RunConfig)
    assert isinstance(cfg.model, Gpt2Config)


def test_include_relative_to_including_file(tmp_path):
    write(tmp_path, "sub/model.yaml", "type: llama\nhidden_dim: 64\nnum_heads: 4\nnum_kv_heads: 2\nintermediate_dim: 128\nnum_layers: 2\nseq_len: 32\n")
    main = write(tmp_path, "sub/run.yaml", "model: !include model.yaml\ntrainer:\n  num_train_steps: 7\n")
    cfg = load_config(main)
    assert isinstance(cfg.model, LlamaConfig)
    assert cfg.model.num_kv_heads == 2
    assert cfg.trainer.num_train_steps == 7


def test_include_cycle_and_missing_file(tmp_path):
    a = write(tmp_path, "a.yaml", "data: !include b.yaml\n")
    write(tmp_path, "b.yaml", "x: !include a.yaml\n")
    with pytest.raises(ConfigError, match="include cycle"):
        load_config(a)
    m = write(tmp_path, "m.yaml", "data: !include nope.yaml\n")
    with pytest.raises(ConfigError, match="not found: .*nope.yaml"):
        load_config(m)


def test_include_relative_to_a_config_url_and_of_a_url(tmp_path):
    import uuid

    import fsspec

    mem = fsspec.filesystem("memory")
    root = f"memory://lmp-config-{uuid.uuid4().hex[:8]}"
    model = "type: llama\nhidden_dim: 64\nnum_heads: 4\nnum_kv_heads: 2\nintermediate_dim: 128\nnum_layers: 2\nseq_len: 32\n"
    mem.pipe_file(f"{root}/conf/model.yaml".removeprefix("memory://"), model.encode())
    mem.pipe_file(f"{root}/shared/trainer.yaml".removeprefix("memory://"), b"num_train_steps: 7\n")
    mem.pipe_file(f"{root}/conf/run.yaml".removeprefix("memory://"),
                  f"model: !include model.yaml\ntrainer: !include {root}/shared/trainer.yaml\n".encode())
    try:
        cfg = load_config(f"{root}/conf/run.yaml")  # model.yaml beside run.yaml, on the store
        assert isinstance(cfg.model, LlamaConfig) and cfg.trainer.num_train_steps == 7
        local = write(tmp_path, "run.yaml", f"model: !include {root}/conf/model.yaml\n")  # a URL from a local file
        assert isinstance(load_config(local).model, LlamaConfig)
        mem.pipe_file(f"{root}/conf/loop.yaml".removeprefix("memory://"), b"x: !include loop.yaml\n")
        with pytest.raises(ConfigError, match="include cycle"):
            load_config(f"{root}/conf/loop.yaml")
    finally:
        mem.rm(root.removeprefix("memory://"), recursive=True)


def test_overrides_parse_yaml_values():
    pairs = parse_overrides(["--model.num_heads", "20", "--trainer.checkpointer.save_interval=20m", "--optimizer.learning_rate", "6e-4"])
    assert pairs == [("model.num_heads", 20), ("trainer.checkpointer.save_interval", "20m"), ("optimizer.learning_rate", "6e-4")]
    cfg = load_config(None, ["--model.num_heads", "4", "--model.hidden_dim", "64", "--trainer.num_train_steps", "10000",
                             "--trainer.checkpointer.save_interval", "20m", "--optimizer.learning_rate", "6e-4"])
    assert cfg.model.num_heads == 4 and cfg.trainer.num_train_steps == 10000
    assert cfg.optimizer.learning_rate == pytest.approx(6e-4)


def test_levanter_aliases():
    cfg = load_config(None, [
        "--trainer.batch_size", "16",
        "--trainer.per_device_parallelism", "4",
        "--trainer.eval_per_device_parallelism", "8",
        "--trainer.wandb.project", "my_project",
        "--trainer.wandb.name", "my_run",
        "--trainer.wandb,group", "grp",
    ])
    assert cfg.trainer.train_batch_size == 16
    assert cfg.trainer.per_device_parallelism == 4
    assert cfg.trainer.per_device_eval_parallelism == 8
    (wandb,) = cfg.trainer.tracker
    assert (wandb.type, wandb.project, wandb.name, wandb.group) == ("wandb", "my_project", "my_run", "grp")


def test_tracker_list_and_type_selection(tmp_path):
    p = write(tmp_path, "r.yaml", "trainer:\n  tracker:\n    - type: tensorboard\n      logdir: tb\n    - type: wandb\n      project: p\n      mode: offline\n")
    cfg = load_config(p)
    assert [t.type for t in cfg.trainer.tracker] == ["tensorboard", "wandb"]


@pytest.mark.parametrize(
    "overrides, field, words",
    [
        (["--model.num_hedas", "4"], "model.num_hedas", "did you mean 'num_heads'"),
        (["--model.num_heads", "four"], "model.num_heads", "integer"),
        (["--model.hidden_dim", "100", "--model.num_heads", "3"], "model.hidden_dim", "divisible"),
        (["--trainer.train_batch_size", "10", "--trainer.per_device_parallelism", "4"], "trainer.train_batch_size", "divisible"),
        (["--model.type", "gtp2"], "model.type", "did you mean 'gpt2'"),
        (["--trainer.mp", "p=f32,c=bfloat17"], "trainer.mp", "dtype"),
        (["--trainer.checkpointer.save_interval", "20x"], "trainer.checkpointer.save_interval", ""),
        (["--optimizer.lr_schedule", "cosin"], "optimizer.lr_schedule", "did you mean 'cosine'"),
    ],
)
def test_bad_config_names_field(overrides, field, words):
    with pytest.raises(ConfigError) as exc:
        load_config(None, overrides)
    assert exc.value.path == field, str(exc.value)
    assert words in str(exc.value)


def test_dump_roundtrip(tmp_path):
    cfg = load_config(None, ["--model.type", "llama", "--model.hidden_dim", "64", "--model.num_heads", "4",
                             "--model.num_kv_heads", "1", "--model.intermediate_dim", "96", "--trainer.wandb.project", "p"])
    p = write(tmp_path, "dumped.yaml", dump_config(cfg))
    assert load_config(p) == cfg


def test_shipped_configs_load():
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        load_config(path)


def test_cli_bad_config_fails_before_any_compute(tmp_path):
    """A bad config exits with code 2 naming the field, before any artifact or device work.

    (How fast it fails is shown by timing the command, not asserted here: wall time in a unit
    test measures the machine's load.)
    """
    for args, field in [
        (["--model.num_hedas", "4"], "model.num_hedas"),
        (["--model.num_heads", "x"], "model.num_heads"),
        (["--model.hidden_dim", "100", "--model.num_heads", "3"], "model.hidden_dim"),
        (["--trainer.train_batch_size", "10", "--trainer.per_device_parallelism", "4"], "trainer.train_batch_size"),
    ]:
        proc = subprocess.run(
            [sys.executable, "-m", "lm_pipeline.cli", "train", "--config_path", str(ROOT / "configs/tiny_gpt2.yaml"),
             "--store.root", str(tmp_path / "store"), *args],
            capture_output=True, text=True, cwd=tmp_path, timeout=120,
        )
        assert proc.returncode == 2, proc.stderr
        assert field in proc.stderr
        assert "Traceback" not in proc.stderr
        assert not (tmp_path / "store").exists(), "work started before the config was rejected"



def test_run_length_from_epochs_or_tokens():
    cfg = load_config(None, {"trainer.num_epochs": 2, "trainer.train_batch_size": 8})
    assert cfg.trainer.resolve_num_steps(num_sequences=100, seq_len=64) == 25  # 2 * 100 / 8
    cfg = load_config(None, {"trainer.train_tokens": 10_000, "trainer.train_batch_size": 8})
    assert cfg.trainer.resolve_num_steps(num_sequences=100, seq_len=64) == 20  # ceil(10000 / 512)
    assert load_config().trainer.resolve_num_steps(None, 64) == 1000
    with pytest.raises(ConfigError, match="num_epochs"):
        load_config(None, {"trainer.num_epochs": 1, "trainer.num_train_steps": 5})


@pytest.mark.parametrize("text", ["model:\n  type: []\n", "model:\n  type: {a: 1}\n", "\x08"])
def test_found_by_the_fuzz_end_in_config_errors(tmp_path, text):
    """Cases tests/faults/test_config_fuzz.py found: a list as a type name, a control character."""
    with pytest.raises(ConfigError):
        load_config(write(tmp_path, "c.yaml", text))


@pytest.mark.parametrize("bad", ["../escape", "a/b", "", ".hidden", "x..y"])
def test_trainer_id_must_be_a_plain_name(bad):
    with pytest.raises(ConfigError, match="trainer.id.*plain name"):
        load_config(None, {"trainer.id": bad})
    assert load_config(None, {"trainer.id": "gpt2-small_run.1"}).trainer.id == "gpt2-small_run.1"


# --- parsing stays light: no JAX, Equinox or Optax -------------------------------------------


@pytest.fixture(scope="module")
def modules_after_parsing() -> list[str]:
    """Every module a fresh interpreter has loaded after parsing configs/tiny_gpt2.yaml."""
    code = (
        "import sys; from lm_pipeline.config import load_config; "
        f"load_config({str(ROOT / 'configs' / 'tiny_gpt2.yaml')!r}); print('\\n'.join(sorted(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    return out.stdout.split()


def test_parsing_imports_no_optimizer_evaluation_or_export_code(modules_after_parsing):
    assert [m for m in modules_after_parsing if m.split(".")[0] == "optax"] == []
    light = {"lm_pipeline.eval", "lm_pipeline.eval.config", "lm_pipeline.eval.harness_config", "lm_pipeline.hf",
             "lm_pipeline.hf.config"}
    heavy = [m for m in modules_after_parsing if m == "lm_pipeline.train.optim"
             or (m.startswith(("lm_pipeline.eval", "lm_pipeline.hf")) and m not in light)]
    assert heavy == []


def test_parsing_imports_no_jax_equinox_or_optax(modules_after_parsing):
    assert [m for m in modules_after_parsing if m.split(".")[0] in ("jax", "equinox", "optax")] == []


# --- Levanter's keys as the guides write them (issue #20 item 2) -------------------------------

# The guide's 1.4B GPT-2 block as written, less `data.cache_dir` (refused in one line on purpose).
SEED_1_4B = """\
data:
    train_urls:
      - "gs://path/to/train.{1..32}.jsonl.gz"
    validation_urls:
      - "gs://path/to/valid.{1..4}.jsonl.gz"
    tokenizer: "gpt2"
model:
  type: gpt2
  hidden_dim: 1536
  num_heads: 24
  num_layers: 48
  seq_len: 1024
  gradient_checkpointing: true
  scale_attn_by_inverse_layer_idx: true
trainer:
  wandb:
    project: "levanter"
    tags: ["gpt2"]
  mp: p=f32,c=bfloat16
  num_train_steps: 100000
  train_batch_size: 512
  per_device_parallelism: -1
  per_device_eval_parallelism: 8
  max_eval_batches: null
  checkpointer:
    base_path: "gs://path/to/checkpoints"
    save_interval: 15m
    keep:
      - every: 10000
optimizer:
  learning_rate: 1E-4
  weight_decay: 0.1
  min_lr_ratio: 0.1
hf_save_steps: 10000
hf_save_path: "gs://path/to/hf/checkpoints"
hf_upload: null
"""


def test_seed_1_4b_block_with_top_level_hf_keys_loads_shrunk_by_overrides(tmp_path):
    path = tmp_path / "gpt2_1536.yaml"
    path.write_text(SEED_1_4B)
    cfg = load_config(path, ["--model.hidden_dim", "64", "--model.num_heads", "4", "--model.num_layers", "2",
                             "--model.seq_len", "64", "--trainer.batch_size", "4"])
    assert (cfg.export.hf_save_steps, cfg.export.hf_save_path, cfg.export.hf_upload) == (
        10000, "gs://path/to/hf/checkpoints", None)
    assert (cfg.model.hidden_dim, cfg.model.num_layers, cfg.trainer.train_batch_size) == (64, 2, 4)
    # a set hf_upload is validated as a repo id; the CLI's top-level spelling replaces the file's
    assert load_config(path, ["--hf_upload", "org/name"]).export.hf_upload == "org/name"
    with pytest.raises(ConfigError, match="hf_upload.*repo id"):
        load_config(path, ["--hf_upload", "not a repo"])
    assert load_config(path, ["--export.hf_save_steps", "7"]).export.hf_save_steps == 7


def test_top_level_hf_key_and_export_key_in_one_file_fail(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("hf_save_steps: 3\nexport:\n  hf_save_steps: 4\n")
    with pytest.raises(ConfigError, match="hf_save_steps.*given twice"):
        load_config(path)
    # an override of either spelling replaces the file's value
    assert load_config(path, ["--hf_save_steps", "5"]).export.hf_save_steps == 5


@pytest.mark.parametrize("file_key,cli_key", [("train_batch_size", "batch_size"), ("batch_size", "train_batch_size"),
                                              ("train_batch_size", "train_batch_size")])
def test_cli_override_of_aliased_field_replaces_files_value(tmp_path, file_key, cli_key):
    path = tmp_path / "c.yaml"
    path.write_text(f"trainer:\n  {file_key}: 8\n  per_device_parallelism: 2\n")
    cfg = load_config(path, [f"--trainer.{cli_key}", "4", "--trainer.per_device_train_parallelism", "1"])
    assert cfg.trainer.train_batch_size == 4
    assert cfg.trainer.per_device_parallelism == 1


def test_two_spellings_in_one_file_still_fail(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("trainer:\n  train_batch_size: 8\n  batch_size: 4\n")
    with pytest.raises(ConfigError, match="trainer.batch_size.*given twice") as info:
        load_config(path)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("file_section, cli, check", [
    ({"trainer": {"use_amp": True, "amp_dtype": "float16"}}, ["--trainer.mp", "f32"], lambda c: c.trainer.mp == "f32"),
    ({"trainer": {"mp": "p=f32,c=bfloat16"}}, ["--trainer.use_amp", "false"], lambda c: c.trainer.mp == "f32"),
    ({"trainer": {"report_to": ["tensorboard"]}}, ["--trainer.tracker", "[]"], lambda c: c.trainer.tracker == ()),
    ({"trainer": {"save_steps": 100}}, ["--trainer.checkpointer.keep", "[{every: 5}]"],
     lambda c: [k.every for k in c.trainer.checkpointer.keep] == [5]),
    ({"trainer": {"checkpoint_dir": "a"}}, ["--trainer.checkpointer.base_path", "b"],
     lambda c: c.trainer.checkpointer.base_path == "b"),
    ({"model": {"hidden_dim": 64, "num_heads": 2, "d_ff": 128}}, ["--model.mlp_scale", "3"],
     lambda c: c.model.mlp_scale == 3),
    # dropout sets two fields: overriding one keeps the file's value for the other
    ({"model": {"dropout": 0.1}}, ["--model.resid_pdrop", "0.0"],
     lambda c: (c.model.resid_pdrop, c.model.embed_pdrop) == (0.0, 0.1)),
    ({"model": {"resid_pdrop": 0.2, "embed_pdrop": 0.3}}, ["--model.dropout", "0.1"],
     lambda c: (c.model.resid_pdrop, c.model.embed_pdrop) == (0.1, 0.1)),
    # use_amp and amp_dtype are two sources of mp: overriding one keeps the other
    ({"trainer": {"use_amp": True, "amp_dtype": "bfloat16"}}, ["--trainer.use_amp", "true"],
     lambda c: c.trainer.mp == "p=f32,c=bfloat16"),
    # Levanter's top-level checkpointer: block, edited by the guide's --trainer.checkpointer.* overrides
    ({"checkpointer": {"keep": [{"every": 1000}]}}, ["--trainer.checkpointer.base_path", "ckpts/"],
     lambda c: c.trainer.checkpointer.base_path == "ckpts/" and [k.every for k in c.trainer.checkpointer.keep] == [1000]),
    ({"checkpointer": {"save_interval": "15m"}}, ["--checkpointer.save_interval", "20m"],
     lambda c: c.trainer.checkpointer.save_interval == "20m"),
])
def test_cli_override_replaces_a_translated_llm_trainer_key_of_the_file(tmp_path, file_section, cli, check):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(file_section))
    assert check(load_config(path, cli))
