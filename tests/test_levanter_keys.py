"""Levanter's config keys: every problem of a file in one message, Levanter's own keys named with
what they do and what to do, a suggestion only for a near-miss spelling, keys that change nothing
here accepted with one log line, and a wandb tracker that cannot start refused before any data work.

The configs are written here in the shapes of Levanter's ``config/*.yaml``."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import pipeline as pt

from lm_pipeline.config import load_config
from lm_pipeline.schema import ConfigError, ConfigProblems
from lm_pipeline.train.trackers import WandbConfig, tracker_problems

#: Five keys Levanter's configs use that are refused here, and the field each must be named by.
FIVE = {
    "model": {"type": "gpt2", "hidden_dim": 32, "num_heads": 2, "num_layers": 1, "use_layer_norm_weight": False,
              "rope": {"type": "yarn", "factor": 2.0}},
    "optimizer": {"cooldown": 0.1, "haps": [1000], "weight_decay_modules": ["attn"], "learning_rate": 1e-3},
}
FIVE_PATHS = ("model.use_layer_norm_weight", "model.rope", "optimizer.cooldown", "optimizer.haps",
              "optimizer.weight_decay_modules")


def _cli(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lm_pipeline.cli", *args], capture_output=True, text=True,
                          env=env, timeout=120)


def test_five_refused_keys_are_one_line_naming_all_five_with_exit_2(tmp_path):
    path = tmp_path / "five.yaml"
    path.write_text(yaml.safe_dump(FIVE), encoding="utf-8")
    res = _cli(["train", "--config_path", str(path), "--store.root", str(tmp_path / "store")])
    assert res.returncode == 2, res.stderr
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in res.stderr, res.stderr
    assert errors[0].startswith("error: 5 problems:"), errors[0]
    for key in FIVE_PATHS:
        assert f"Levanter's `{key}` (" in errors[0] and "is not supported here:" in errors[0], key
    assert not (tmp_path / "store").exists()  # refused before any work


def test_problems_of_all_sections_are_reported_together():
    raw = {"model": {"num_layerz": 2, "hidden_dim": "wide"}, "trainer": {"num_train_steps": "many"},
           "data": {"min_length": [1]}}
    with pytest.raises(ConfigProblems) as err:
        load_config(None, {f"{s}.{k}": v for s, section in raw.items() for k, v in section.items()})
    paths = {p.path for p in err.value.problems}
    assert paths == {"model.num_layerz", "model.hidden_dim", "trainer.num_train_steps", "data.min_length"}
    assert "did you mean 'num_layers'" in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("key, wrong", [("model.cach_dir", None), ("data.cache_optionz", "cache_dir"),
                                        ("data.train_weightz", "train_urls"), ("model.warmup_ratio", None)])
def test_no_suggestion_for_a_different_word(key, wrong):
    with pytest.raises(ConfigError) as err:
        load_config(None, {key: 1})
    if wrong is not None:
        assert f"did you mean {wrong!r}" not in str(err.value)
    assert "unknown key" in str(err.value)


def test_a_typo_gets_its_suggestion():
    with pytest.raises(ConfigError, match="did you mean 'seq_len'"):
        load_config(None, {"model.seq_lne": 64})


def test_keys_without_effect_are_accepted_with_one_log_line_and_change_no_fingerprint(caplog):
    from lm_pipeline import levanter
    from lm_pipeline.fingerprint import semantic_view

    levanter._NOTED.clear()
    tuning = {"data.cache_options": {"batch_size": 1024, "num_shard_groups": 64},
              "trainer.ray": {"auto_start_cluster": False}, "trainer.require_accelerator": False,
              "trainer.jax_config": {"jax_threefry_partitionable": True}, "trainer.profiler_perfetto_link": False,
              "trainer.shutdown_at_exit": False, "trainer.checkpointer.append_run_id_to_base_path": False}
    with caplog.at_level("INFO", logger="lm_pipeline.config"):
        cfg = load_config(None, dict(tuning))
        load_config(None, dict(tuning))  # a second load logs nothing again
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == len(tuning), lines
    for key in tuning:
        assert sum(f"Levanter's `{key}` (" in line and "has no effect here:" in line for line in lines) == 1, key
    assert semantic_view(cfg) == semantic_view(load_config(None))


def _no_wandb_key(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update({"NETRC": str(tmp / "no-netrc"), "HOME": str(tmp / "home"), "WANDB_DIR": str(tmp / "wandb")})
    return env


def test_wandb_without_a_key_is_refused_before_any_data_work(tmp_path):
    pytest.importorskip("wandb")
    path = pt.write_config(tmp_path, trainer={"tracker": [{"type": "wandb", "project": "levanter"}]})
    res = _cli(["train", "--config_path", str(path)], env=_no_wandb_key(tmp_path))
    assert res.returncode == 2, res.stderr
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in res.stderr, res.stderr
    assert "trainer.tracker[0]" in errors[0] and "WANDB_MODE=offline" in errors[0]
    assert not (tmp_path / "store" / "raw_shards").exists()  # no data work


def test_wandb_offline_or_with_a_key_passes_the_check(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for k in [k for k in os.environ if k.startswith("WANDB_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    online = WandbConfig(project="p")
    assert [w for w, _ in tracker_problems([online])] == ["trainer.tracker[0]"]
    assert tracker_problems([WandbConfig(project="p", mode="offline")]) == []
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert tracker_problems([online]) == []
    monkeypatch.delenv("WANDB_MODE")
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password abc123\n")
    assert tracker_problems([online]) == []


def test_fp8_is_refused_before_any_compute_naming_the_field_and_the_device(tmp_path):
    from lm_pipeline.train.quantization import QuantizationConfig

    path = tmp_path / "fp8.yaml"
    path.write_text(yaml.safe_dump({"model": {"type": "gpt2", "hidden_dim": 32, "num_heads": 2, "num_layers": 1},
                                    "trainer": {"quantization": {"fp8": True}}}), encoding="utf-8")
    res = _cli(["train", "--config_path", str(path), "--store.root", str(tmp_path / "store")],
               env={**os.environ, "JAX_PLATFORMS": "cpu"})
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert res.returncode == 2 and len(errors) == 1 and "Traceback" not in res.stderr, res.stderr
    assert "trainer.quantization.fp8" in errors[0] and "device is cpu" in errors[0]
    assert not (tmp_path / "store").exists()
    assert QuantizationConfig(fp8=True).device_problem("NVIDIA H100 80GB HBM3", True) is None
    assert "NVIDIA A100" in str(QuantizationConfig(fp8=True).device_problem("NVIDIA A100-SXM4-80GB", False))
    targets = QuantizationConfig(fp8=True, targets=("mlp",)).device_problem("NVIDIA H100 80GB HBM3", True)
    assert "trainer.quantization.targets" in str(targets)
    assert QuantizationConfig().device_problem("cpu", False) is None
    assert load_config(None, {"trainer.quantization": None}).trainer.quantization is None


def test_the_training_guide_lists_each_levanter_key_with_what_happens_to_it():
    from lm_pipeline.levanter import LEVANTER_KEYS

    text = (Path(__file__).resolve().parents[1] / "docs" / "training.md").read_text(encoding="utf-8")
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    for key in LEVANTER_KEYS:
        status = {"mapped": "mapped", "no_effect": "no effect", "refused": "refused"}[key.status]
        assert any(row.startswith(f"| `{key.path}`") and f"| {status} |" in row for row in rows), key.path
    assert "runs as it is" not in text


def test_levanter_model_families_not_here_are_named_as_levanters():
    with pytest.raises(ConfigError) as err:
        load_config(None, {"model.type": "gpt2_hyena", "model.hyena": {"filter_order": 16}})
    assert str(err.value).startswith("config field 'model.type': Levanter's `model.type: gpt2_hyena` (")
    assert "use one of gpt2, llama" in str(err.value)
