"""Security: weights load only from safetensors / TensorStore / JSON (never pickle), no
``trust_remote_code``, planted secrets never reach any output, and artifact paths from configs
cannot leave the store root."""

from __future__ import annotations

import dataclasses
import pickle
import re
import secrets

import pytest
from conftest import REPO, artifact_dir, copy_store, final_params, run_stage

from lm_pipeline.config import load_config
from lm_pipeline.schema import ConfigError
from lm_pipeline.steps import Pipeline
from lm_pipeline.store import ArtifactStore

SOURCES = {p: p.read_text() for p in sorted((REPO / "lm_pipeline").rglob("*.py"))}


@pytest.mark.reliability("security")
def test_no_code_path_unpickles_or_trusts_remote_code(note):
    bad = {
        r"\bpickle\.loads?\(": "pickle.load", r"\btorch\.load\(": "torch.load", r"allow_pickle\s*=\s*True": "allow_pickle",
        r"trust_remote_code\s*=\s*True": "trust_remote_code=True", r"\bjoblib\.load\(": "joblib.load",
        r"\bdill\.loads?\(": "dill.load", r"\bcloudpickle\.loads?\(": "cloudpickle.load",
        r"\byaml\.(unsafe_)?load\((?![^)]*SafeLoader)": "yaml.load without SafeLoader",
    }
    found = [f"{p.relative_to(REPO)}:{text[: m.start()].count(chr(10)) + 1}: {what}"
             for p, text in SOURCES.items() for rx, what in bad.items() for m in re.finditer(rx, text)]
    assert found == []
    note(f"{len(SOURCES)} modules scanned for pickle/torch/joblib/dill loads, allow_pickle, "
         "trust_remote_code=True, unsafe YAML: none")


@pytest.mark.faults
@pytest.mark.reliability("security")
def test_loading_checkpoints_and_exports_never_unpickles(experiment, monkeypatch, note):
    from lm_pipeline.eval import load_model_from_checkpoint
    from lm_pipeline.hf import UnsafeCheckpointError, read_safetensors_dir
    from lm_pipeline.train.checkpoint import latest_checkpoint

    def refuse(*a, **k):
        raise AssertionError("something tried to unpickle")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    run = artifact_dir(experiment.reference, "train_ckpt")
    assert len(final_params(run)) > 1  # Orbax/TensorStore + JSON marker only
    load_model_from_checkpoint(latest_checkpoint(str(run)))
    export = artifact_dir(experiment.reference, "hf_export")
    assert read_safetensors_dir(export)
    fake = experiment.root / "pickled_model"
    fake.mkdir(exist_ok=True)
    (fake / "pytorch_model.bin").write_bytes(b"\x80\x04K\x01.")  # a pickle, never opened
    with pytest.raises(UnsafeCheckpointError, match="refusing to unpickle"):
        read_safetensors_dir(fake)
    note("checkpoint restore, eval model load and safetensors import ran with pickle.load/loads/Unpickler "
         "replaced by a trap: never called; a pickle-only model dir was refused with a message")


@pytest.mark.faults
@pytest.mark.reliability("security")
def test_planted_secrets_never_reach_any_output(experiment, tmp_path, note):
    planted = {name: f"planted-{name.lower()}-{secrets.token_hex(12)}" for name in
               ("WANDB_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                "AWS_SESSION_TOKEN", "GOOGLE_APPLICATION_CREDENTIALS", "AZURE_STORAGE_KEY", "GCS_OAUTH_TOKEN")}
    store = copy_store(experiment.reference, tmp_path / "store",
                       drop=("tokenizer", "token_cache", "train_ckpt", "eval_report", "hf_export"))
    logs = tmp_path / "logs"
    env = {**planted, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
    outputs = []
    for stage, cli in (("train_ckpt", True), ("eval_report", False), ("hf_export", False)):
        res = run_stage(experiment, store, stage, cli=cli, env=env, overrides=("--trainer.log_dir", str(logs)))
        assert res.returncode == 0, res.output[-3000:]
        outputs.append(res.output)
    scanned, leaks = 0, []
    for path in [p for root in (tmp_path,) for p in root.rglob("*") if p.is_file()]:
        data = path.read_bytes()
        scanned += 1
        leaks += [f"{path.relative_to(tmp_path)}: {k}" for k, v in planted.items() if v.encode() in data]
    leaks += [f"stdout/stderr: {k}" for k, v in planted.items() for out in outputs if v in out]
    assert scanned > 20 and leaks == []
    note(f"{len(planted)} secrets planted in the environment of a full run (train CLI, eval, export): "
         f"{scanned} output files (manifests, configs, checkpoints, logs, metrics, reports, exports) "
         "and all console output grepped: 0 hits")


@pytest.mark.reliability("security")
def test_artifact_paths_from_configs_cannot_escape_the_store(tmp_path, note):
    store = ArtifactStore(str(tmp_path / "store"))
    tried = 0
    for stage, fp in (("..", "x"), ("tokenizer", ".."), ("tokenizer", "../../etc"), ("a/b", "x"), ("tokenizer", "")):
        with pytest.raises(ValueError, match="invalid artifact address"):
            store.artifact(stage, fp)
        tried += 1
    for rid in ("../escape", "..", "a/../../b", "/abs", "x/y"):
        with pytest.raises(ConfigError, match="trainer.id"):  # refused when the config is loaded
            load_config(None, {"trainer.id": rid, "store.root": str(tmp_path / "store"),
                               "trainer.checkpointer.base_path": str(tmp_path / "runs")})
        cfg = load_config(None, {"store.root": str(tmp_path / "store"),
                                 "trainer.checkpointer.base_path": str(tmp_path / "runs")})
        # ... and by the pipeline, for a config built without validation
        cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, id=rid))
        with pytest.raises(ConfigError, match="trainer.id"):
            Pipeline(cfg, progress=False).run_dir()
        tried += 1
    assert not (tmp_path / "escape").exists() and sorted(p.name for p in tmp_path.iterdir()) == []
    note(f"{tried} escaping addresses and run ids (.., ../.., absolute, nested): all refused before any "
         "directory was created")
