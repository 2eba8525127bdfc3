"""Levanter's documented configs, as its guides write them, run here.

``tests/fixtures/seed_configs/`` holds every YAML example of Levanter's configuration guide and
its "training on your own data" guide, copied as written (the ``!include`` example split into its
two files), and the guides' command lines are the override lists below. Each file loads as
written (MPT fails in one line naming the supported families; the Llama example needs the hub,
so it loads with ``initialize_from_hf`` pointed at a local directory). With its data URLs,
tokenizer, buckets and hub ids replaced by local files and its model shrunk by overrides, each
trains 3 steps through the pipeline, and what the file asked for is checked on the result:
tracker files, checkpoint policy, the cache in ``cache_dir``, the Hugging Face export, the
Hugging Face dataset, the starting weights.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from helpers import pipeline as pt

from lm_pipeline.config import load_config
from lm_pipeline.schema import ConfigError

FIXTURES = Path(__file__).parent / "fixtures" / "seed_configs"
INCLUDED = {"data.yaml"}  # pulled in by config-guide-include.yaml, not a run config by itself
SEEDS = sorted(p.name for p in FIXTURES.glob("*.yaml") if p.name not in INCLUDED)
NEEDS_HUB = {"own-data-llama.yaml"}  # initialize_from_hf: a hub repo, replaced by a local directory
REFUSED = {"own-data-mpt.yaml"}

#: The training guides' command lines (config/gpt2_small.yaml there: the configuration guide's
#: GPT-2 example here), as override lists, and a field each must set.
COMMANDS = {
    "bigger-model": ("--model.num_heads 20 --model.num_layers 36 --model.hidden_dim 1280 "
                     "--trainer.num_train_steps 10000", lambda c: (c.model.num_heads, c.model.num_layers,
                                                                   c.model.hidden_dim) == (20, 36, 1280)),
    "resume": ("--trainer.load_checkpoint_path checkpoints/gpt2/wandb_run_name "
               "--trainer.checkpointer.base_path checkpoints/gpt2/ --trainer.checkpointer.save_interval 20m",
               lambda c: c.trainer.checkpointer.save_interval == "20m"
               and c.trainer.load_checkpoint_path == "checkpoints/gpt2/wandb_run_name"),
    "eval-cadence": ("--trainer.steps_per_eval 500", lambda c: c.trainer.steps_per_eval == 500),
    "parallelism": ("--trainer.batch_size 256 --trainer.per_device_parallelism 64 "
                    "--trainer.eval_per_device_parallelism 64",
                    lambda c: (c.trainer.train_batch_size, c.trainer.per_device_parallelism,
                               c.trainer.per_device_eval_parallelism) == (256, 64, 64)),
    "wandb-names": ("--trainer.wandb.project my_project --trainer.wandb.name my_run --trainer.wandb.id asdf1234 "
                    "--trainer.wandb,group my_new_exp_group",
                    lambda c: (c.trainer.tracker[0].project, c.trainer.tracker[0].name, c.trainer.tracker[0].id,
                               c.trainer.tracker[0].group) == ("my_project", "my_run", "asdf1234", "my_new_exp_group")),
    "wandb-resume": ("--trainer.load_checkpoint_path checkpoints/gpt2/wandb_run_name --trainer.wandb.resume True "
                     "--trainer.wandb.id asdf1234",
                     lambda c: c.trainer.tracker[0].resume is True and c.trainer.tracker[0].id == "asdf1234"),
}


def _raw(name: str) -> dict[str, Any]:
    """The file as YAML, its include resolved (what the guide's reader sees)."""
    from lm_pipeline.config import _load_yaml

    return _load_yaml(FIXTURES / name) or {}


def test_the_fixtures_are_the_guides_examples():
    """Every example is here (15 blocks, one of them two files) and none is empty."""
    assert len(SEEDS) == 15 and all((FIXTURES / n).read_text().strip() for n in [*SEEDS, *INCLUDED])


@pytest.mark.parametrize("name", [n for n in SEEDS if n not in NEEDS_HUB | REFUSED])
def test_seed_config_loads_as_written(name):
    cfg = load_config(FIXTURES / name)
    raw = _raw(name)
    # What the file sets is what the config holds, whichever spelling it used.
    data = raw.get("data") or {}
    if data.get("train_urls"):
        assert cfg.data.train_urls == tuple(data["train_urls"])
    if data.get("cache_dir"):
        assert cfg.data.cache_dir == data["cache_dir"]
    if isinstance(data.get("tokenizer"), str):
        assert (cfg.data.tokenizer.kind, cfg.data.tokenizer.name_or_path) == ("hf", data["tokenizer"])
    if "id" in data:
        assert cfg.data.hf_id == data["id"]
    for key, value in (raw.get("model") or {}).items():
        if key != "type":
            assert getattr(cfg.model, key) == value, key
    checkpointer = raw.get("checkpointer") or (raw.get("trainer") or {}).get("checkpointer")
    if checkpointer:
        keep = [(k.every, k.until) for k in cfg.trainer.checkpointer.keep]
        assert keep == [(k["every"], k.get("until")) for k in checkpointer["keep"]]
    if "hf_save_steps" in raw:
        assert (cfg.export.hf_save_steps, cfg.export.hf_save_path, cfg.export.hf_upload) == (
            raw["hf_save_steps"], raw["hf_save_path"], raw["hf_upload"])
    tracker = (raw.get("trainer") or {}).get("tracker") or (raw.get("trainer") or {}).get("wandb")
    if tracker is not None:
        written = tracker if isinstance(tracker, list) else [tracker]
        assert [t.type for t in cfg.trainer.tracker] == [t.get("type", "wandb") for t in written]


def test_mpt_fails_in_one_line_naming_the_supported_families():
    with pytest.raises(ConfigError) as e:
        load_config(FIXTURES / "own-data-mpt.yaml")
    text = str(e.value)
    assert "\n" not in text and "model.type" in text and "'mpt'" in text and "gpt2, llama" in text


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_guide_command_lines_override_the_config(command):
    args, check = COMMANDS[command]
    cfg = load_config(FIXTURES / "config-guide-gpt2-small-openwebtext.yaml", args.split())
    assert check(cfg), command


# --------------------------------------------------------------------------------------------
# Each example trains 3 steps, shrunk, on local data
# --------------------------------------------------------------------------------------------

SHRUNK_GPT2 = {"hidden_dim": 32, "num_heads": 2, "num_layers": 1, "seq_len": 32}


def _local_inputs(tmp: Path) -> dict[str, Any]:
    corpus = pt.write_corpus(tmp / "data")
    from helpers.data import tiny_tokenizer

    texts = [json.loads(line)["text"] for f in corpus["train"] for line in Path(f).read_text().splitlines()]
    tok = tiny_tokenizer(str(tmp / "gpt2-tokenizer"), vocab_size=300, texts=texts)
    return {"corpus": corpus, "tokenizer": tok, "texts": texts}


def _shrink(name: str, tmp: Path, local: dict[str, Any]) -> dict[str, Any]:
    """Overrides that keep what the example configures but run it here in seconds."""
    raw = _raw(name)
    data = raw.get("data") or {}
    over: dict[str, Any] = {"store.root": str(tmp / "store"), "trainer.num_train_steps": 3,
                            "trainer.train_batch_size": 4, "trainer.steps_per_eval": 3, "trainer.max_eval_batches": 1,
                            "trainer.log_dir": str(tmp / "logs"), "trainer.progress": False, "eval.max_eval_batches": 1}
    if "id" in data:  # a Hugging Face dataset: a local save_to_disk directory
        import datasets

        datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": local["texts"]})}).save_to_disk(
            str(tmp / "hf-dataset"))
        over["data.id"] = str(tmp / "hf-dataset")
    else:
        over["data.train_urls"] = local["corpus"]["train"]
    if data.get("validation_urls"):
        over["data.validation_urls"] = local["corpus"]["validation"]
    if data.get("cache_dir"):
        over["data.cache_dir"] = str(tmp / "cache")
    if isinstance(data.get("tokenizer"), str):
        over["data.tokenizer"] = local["tokenizer"]
    elif "initialize_from_hf" not in raw:
        over["data.tokenizer.vocab_size"] = 300
    if "initialize_from_hf" in raw:
        from lm_pipeline.hf.tiny import make_tiny_hf_model

        over["initialize_from_hf"] = make_tiny_hf_model(str(tmp / "hf-start"), raw["model"]["type"], seq_len=32)
    else:
        over.update({f"model.{k}": v for k, v in SHRUNK_GPT2.items()})
    trainer = raw.get("trainer") or {}
    pdp = trainer.get("per_device_parallelism")
    if isinstance(pdp, int) and pdp > 4:
        over["trainer.per_device_parallelism"] = 4
    checkpointer = trainer.get("checkpointer") or {}
    if "://" in str(checkpointer.get("base_path", "")):
        over["trainer.checkpointer.base_path"] = str(tmp / "checkpoints")
    if raw.get("hf_save_path"):
        over.update({"hf_save_path": str(tmp / "hf-exports"), "hf_save_steps": 3})
    return over


TRAINED = [n for n in SEEDS if n not in REFUSED]


@pytest.mark.slow
@pytest.mark.parametrize("name", TRAINED)
def test_seed_config_trains_three_steps_shrunk(name, tmp_path, tmp_path_factory, monkeypatch):
    from lm_pipeline.steps import Pipeline

    xla = tmp_path_factory.getbasetemp() / "seed-xla-cache"  # one compilation cache for all examples
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(xla))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-files"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "wandb-files").mkdir()
    monkeypatch.chdir(tmp_path)  # relative paths of the examples (tensorboard logdir: logs)
    local = _local_inputs(tmp_path)
    over = _shrink(name, tmp_path, local)
    cfg = load_config(FIXTURES / name, over)
    pipe = Pipeline(cfg, progress=False)
    res = pipe.train_ckpt()
    summary = res.manifest["summary"]
    assert summary["final_step"] == 3 and math.isfinite(summary["train/loss"]), summary
    raw = _raw(name)
    trainers = [t.type for t in cfg.trainer.tracker]
    run_id = res.manifest["run_id"]
    if "tensorboard" in trainers:
        events = list((tmp_path / "logs").glob(f"{run_id}/events.out.tfevents.*"))
        assert events, sorted(p.name for p in (tmp_path / "logs").rglob("*"))
    if "wandb" in trainers:
        assert list((tmp_path / "wandb-files").rglob("offline-run-*")), "no offline wandb run was written"
    if (raw.get("data") or {}).get("cache_dir"):
        cache = pipe.token_cache()
        assert cache.path == str(tmp_path / "cache" / cache.fingerprint)
        assert (tmp_path / "cache" / cache.fingerprint / "manifest.json").is_file()
    if raw.get("hf_save_path"):
        exported = sorted((tmp_path / "hf-exports").rglob("config.json"))
        assert exported, "hf_save_steps wrote no export"
    if "id" in (raw.get("data") or {}):
        shards = pipe.shards()["train"]
        assert shards and all("hf-dataset" in str(s.url) for s in shards)
    if "initialize_from_hf" in raw:
        assert cfg.model.type == raw["model"]["type"] and cfg.model.hidden_dim == 96  # the directory's shape
        assert str(res.manifest["inputs"].get("hf_weights", "")).startswith("sha256:"), res.manifest["inputs"]
    if raw.get("checkpointer"):
        assert [k.every for k in cfg.trainer.checkpointer.keep] == [1000, 5000, 10000]


def test_guide_resume_command_edits_a_top_level_checkpointer_block():
    """The guide's ``--trainer.checkpointer.*`` overrides over its top-level ``checkpointer:`` block:
    the block's keep policy stays, the overrides apply."""
    args, check = COMMANDS["resume"]
    cfg = load_config(FIXTURES / "config-guide-checkpointer-keep.yaml", args.split())
    assert check(cfg) and cfg.trainer.checkpointer.base_path == "checkpoints/gpt2/"
    assert [(k.every, k.until) for k in cfg.trainer.checkpointer.keep] == [(1000, 10000), (5000, 40000), (10000, None)]
