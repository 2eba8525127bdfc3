"""Helpers for the Dagster pipeline tests: a tiny experiment over a few small local shards.

Imported as ``from helpers import pipeline as pt`` by the Dagster, steps and CLI tests.
"""

from __future__ import annotations

import json
import os
import sys
import sysconfig
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]

# Small, stable modules of the standard library as the test corpus.
_MODULES = ("textwrap.py", "json/decoder.py", "json/encoder.py", "shlex.py", "fnmatch.py", "glob.py",
            "bisect.py", "heapq.py", "colorsys.py", "keyword.py", "string.py", "base64.py")


def write_corpus(root: Path, num_train: int = 4, docs_per_shard: int = 3) -> dict[str, list[str]]:
    """JSONL shards of stdlib source: ``num_train`` training shards and one validation shard."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for name in _MODULES:
        p = stdlib / name
        if p.is_file():
            texts.append(p.read_text(encoding="utf-8")[:6000])
    assert len(texts) >= 6, "the test corpus needs a few stdlib modules"
    root.mkdir(parents=True, exist_ok=True)
    train = []
    i = 0
    for s in range(num_train):
        path = root / f"train-{s:02d}.jsonl"
        with open(path, "w", encoding="utf-8") as f:
            for _ in range(docs_per_shard):
                f.write(json.dumps({"text": texts[i % len(texts)] + f"\n# doc {i}\n"}) + "\n")
                i += 1
        train.append(str(path))
    val = root / "validation-00.jsonl"
    with open(val, "w", encoding="utf-8") as f:
        for j in range(2):
            f.write(json.dumps({"text": texts[(j * 5 + 1) % len(texts)][::-1][:3000]}) + "\n")
    return {"train": train, "validation": [str(val)]}


def tiny_config(tmp: Path, **sections: Any) -> dict[str, Any]:
    """A tiny experiment (raw dict) over the corpus in ``tmp/data``; ``sections`` update it."""
    corpus = write_corpus(tmp / "data") if not (tmp / "data").exists() else {
        "train": sorted(str(p) for p in (tmp / "data").glob("train-*.jsonl")),
        "validation": [str(tmp / "data" / "validation-00.jsonl")]}
    cfg: dict[str, Any] = {
        "data": {"train_urls": corpus["train"], "validation_urls": corpus["validation"], "shard_group_size": 1,
                 "num_workers": 1, "tokenizer": {"kind": "bpe", "vocab_size": 300}, "packing": "concat"},
        "model": {"type": "gpt2", "seq_len": 32, "hidden_dim": 32, "num_heads": 2, "num_layers": 1,
                  "gradient_checkpointing": False},
        "trainer": {"seed": 0, "num_train_steps": 6, "train_batch_size": 4, "mp": "f32", "steps_per_eval": 3,
                    "max_eval_batches": 2, "log_every": 2, "progress": False, "log_dir": str(tmp / "logs"),
                    "checkpointer": {"save_interval": "10m", "keep": [{"every": 3}]}},
        "optimizer": {"learning_rate": 1.0e-3, "warmup": 0.0},
        "store": {"root": str(tmp / "store")},
    }
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    return cfg


def write_config(tmp: Path, name: str = "tiny.yaml", **sections: Any) -> Path:
    path = tmp / name
    path.write_text(yaml.safe_dump(tiny_config(tmp, **sections), sort_keys=False), encoding="utf-8")
    return path


def subprocess_env(tmp: Path, experiment: Path, *, overrides: str = "", mode: str = "in_process",
                   dagster_home: Path | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "LM_PIPELINE_EXPERIMENT": str(experiment),
        "LM_PIPELINE_OVERRIDES": overrides,
        "LM_PIPELINE_TRAIN_MODE": mode,
        "PYTHONPATH": os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "JAX_PLATFORMS": "cpu",
        "TOKENIZERS_PARALLELISM": "false",
    })
    if dagster_home is not None:
        dagster_home.mkdir(parents=True, exist_ok=True)
        env["DAGSTER_HOME"] = str(dagster_home)
    for name in [k for k in env if k.startswith("LM_PIPELINE_FAULTPOINT")]:
        env.pop(name)
    return env


def python() -> str:
    return sys.executable


TINY_LLAMA = {"type": "llama", "seq_len": 32, "hidden_dim": 32, "intermediate_dim": 64, "num_heads": 2,
              "num_kv_heads": 1, "num_layers": 1, "gradient_checkpointing": False}


def write_experiments(tmp: Path, experiments: dict[str, dict[str, Any]] | None = None) -> Path:
    """A folder of experiment files over the corpus of ``tmp/data`` and one store: by default
    ``gpt`` (the tiny GPT-2) and ``llama`` (a tiny Llama), which share data and tokenizer.
    ``experiments``: name -> sections updating :func:`tiny_config`."""
    experiments = {"gpt": {}, "llama": {"model": TINY_LLAMA}} if experiments is None else experiments
    folder = tmp / "experiments"
    folder.mkdir(parents=True, exist_ok=True)
    for name, sections in experiments.items():
        (folder / f"{name}.yaml").write_text(yaml.safe_dump(tiny_config(tmp, **sections), sort_keys=False),
                                             encoding="utf-8")
    return folder


def store_files(root: Path) -> dict[str, tuple[int, int]]:
    """(size, mtime in ns) of every file under a store, by relative path, the XLA compilation cache
    left out: equal before and after a run means the run wrote, added and removed no artifact file."""
    files = (p for p in root.rglob("*") if p.is_file() and "_xla_cache" not in p.relative_to(root).parts)
    return {str(p.relative_to(root)): (st.st_size, st.st_mtime_ns) for p in files for st in (p.stat(),)}
