"""``lm-pipeline eval`` reads the token cache the run was trained on (issue 34, item 7).

A tiny run is trained through the command line; ``lm-pipeline eval`` then writes nothing into the
store (no new ``token_cache/<fingerprint>``, the same bytes on disk) and reports the numbers of the
former evaluation path, which tokenized the whole corpus into a second cache for the checkpoint's
tokenizer. A validation set that no cache holds is tokenized alone, into an evaluation cache
addressed by its shards and the tokenizer (a second evaluation is a hit); the training data never.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import pipeline as pt

from lm_pipeline.cli import main
from lm_pipeline.config import load_config

METRICS = ("loss", "bpb", "unigram_loss", "unigram_bpb", "tokens")


def _store_files(root: Path) -> dict[str, int]:
    """Every file of the store and its size."""
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*") if p.is_file()}


def _token_caches(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "token_cache").iterdir() if not p.name.startswith("."))


def _rows(out: Path) -> dict[str, dict]:
    rows = json.loads((out / "eval_report.json").read_text())
    rows = rows if isinstance(rows, list) else rows.get("rows", rows)
    return {r["dataset"]: r for r in rows}


def _old_eval(config: str, ckpt: str, **overrides):
    """The former ``lm-pipeline eval``: the config with the checkpoint's tokenizer given as a
    Hugging Face directory, its whole token cache built (training data included)."""
    from lm_pipeline.data.config import TokenizerConfig
    from lm_pipeline.eval import evaluate_checkpoint
    from lm_pipeline.steps import Pipeline

    cfg = load_config(config, overrides)
    tok = TokenizerConfig(kind="hf", name_or_path=os.path.join(ckpt, "tokenizer"))
    model = load_config(os.path.join(ckpt, "config.yaml")).model
    cfg = dataclasses.replace(cfg, model=model, data=dataclasses.replace(cfg.data, tokenizer=tok))
    pipe = Pipeline(cfg, progress=False)
    cache = pipe.token_cache()
    _, evals, _, _ = pipe.datasets(cache)
    ev = cfg.eval
    df = evaluate_checkpoint(ckpt, evals, batch_size=ev.batch_size, max_eval_batches=ev.max_eval_batches,
                             compute_dtype=ev.compute_dtype, store_root=cfg.store.root,
                             train_cache=f"{cache.path}/train")
    return {r["dataset"]: r for r in df.to_dict(orient="records")}


def _close(new: dict, old: dict, sets, metrics=METRICS) -> None:
    for name in sets:
        for m in metrics:
            a, b = new[name][m], old[name][m]
            assert a == pytest.approx(b, rel=0, abs=1e-6), (name, m, a, b)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("evaldata")
    cfg = pt.tiny_config(tmp)
    cfg["trainer"].update({"num_train_steps": 2, "steps_per_eval": 100, "checkpointer": {"save_interval": "10m"}})
    cfg["eval"] = {"batch_size": 2}
    config = tmp / "tiny.yaml"
    config.write_text(yaml.safe_dump(cfg))
    assert main(["train", "--config_path", str(config)]) == 0
    from lm_pipeline.steps import Pipeline

    ckpt = Pipeline(load_config(str(config)), progress=False).cached("train_ckpt").manifest["final_checkpoint"]
    return {"tmp": tmp, "config": str(config), "cfg": cfg, "ckpt": ckpt, "store": Path(cfg["store"]["root"])}


def test_eval_reads_the_training_token_cache_and_writes_nothing(run, tmp_path):
    store = run["store"]
    before, caches = _store_files(store), _token_caches(store)
    assert len(caches) == 1
    env = {**os.environ, "LM_PIPELINE_NO_TCMALLOC": "1"}
    out = subprocess.run([sys.executable, "-m", "lm_pipeline.cli", "eval", "--config_path", run["config"],
                          "--output_dir", str(tmp_path / "new")], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert f"from token_cache {caches[0]} (validation)" in out.stderr
    assert f"unigram baseline from token_cache {caches[0]} (train)" in out.stderr
    assert _store_files(store) == before  # no byte written: no cache, no tokenizer, no pointer
    assert _token_caches(store) == caches and not (store / "eval_cache").exists()
    new = _rows(tmp_path / "new")
    # the former path on a copy of the store: a second cache, training data included
    copy = tmp_path / "store-old"
    shutil.copytree(store, copy)
    ckpt = run["ckpt"].replace(str(store), str(copy))
    old = _old_eval(run["config"], ckpt, **{"store.root": str(copy)})
    assert len(_token_caches(copy)) == 2
    _close(new, old, ("validation", "_micro", "_macro"))
    assert all(math.isfinite(new["validation"][m]) for m in METRICS)


def test_a_missing_set_or_tokenizer_is_tokenized_alone_once(run, tmp_path, monkeypatch):
    """A store without a cache for the checkpoint's tokenizer and an extra validation set: only
    the validation sets are tokenized, into evaluation caches; a second evaluation is a hit."""
    import lm_pipeline.data.cache as cache_pkg

    extra = run["tmp"] / "extra.jsonl"
    extra.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n" * 20}) + "\n" for i in range(6)))
    cfg = json.loads(json.dumps(run["cfg"]))
    other = tmp_path / "other-store"
    cfg["store"]["root"] = str(other)
    cfg["data"]["validation"] = {"extra": [str(extra)]}
    cfg["data"]["tokenizer"] = {"kind": "bpe", "vocab_size": 280}  # not the checkpoint's
    config = tmp_path / "other.yaml"
    config.write_text(yaml.safe_dump(cfg))
    built: list[tuple[str, list[str]]] = []  # (where, shard urls) of every cache built
    real = cache_pkg.build_cache

    def spy(out, shards, *a, **k):
        shards = list(shards)
        built.append((str(out), [s.url for s in shards]))
        return real(out, shards, *a, **k)

    monkeypatch.setattr(cache_pkg, "build_cache", spy)
    train_urls = set(cfg["data"]["train_urls"])
    args = ["eval", "--config_path", str(config), "--checkpoint_path", run["ckpt"]]
    assert main([*args, "--output_dir", str(tmp_path / "a")]) == 0
    assert sorted(urls for _, urls in built) == sorted([[str(extra)], cfg["data"]["validation_urls"]]), built
    assert all(where.startswith(str(other / "eval_cache")) for where, _ in built)
    assert sorted(p.name for p in other.iterdir()) == ["eval_cache"]  # no token cache, no tokenizer
    first = _store_files(other)
    assert main([*args, "--output_dir", str(tmp_path / "b")]) == 0
    assert len(built) == 2 and _store_files(other) == first  # a hit: nothing tokenized or written
    a, b = _rows(tmp_path / "a"), _rows(tmp_path / "b")
    assert a["validation"]["unigram_bpb"] is None  # no baseline (NaN): no training cache with this tokenizer here
    _close(a, b, ("validation", "extra", "_micro"), ("loss", "bpb", "tokens"))
    old = _old_eval(str(config), run["ckpt"], **{"store.root": str(tmp_path / "old-store")})
    _close(a, old, ("validation", "extra", "_micro", "_macro"), ("loss", "bpb", "tokens"))
    # in the training store, 'validation' is read from the run's cache; only 'extra' is tokenized
    cfg["store"]["root"] = str(run["store"])
    config.write_text(yaml.safe_dump(cfg))
    before = _token_caches(run["store"])
    ours, built[:] = built[:2], []  # the former path's builds left out
    assert main([*args, "--output_dir", str(tmp_path / "c")]) == 0
    assert [urls for _, urls in built] == [[str(extra)]]
    assert built[0][0].startswith(str(run["store"] / "eval_cache"))
    assert _token_caches(run["store"]) == before
    assert not any(set(urls) & train_urls for _, urls in ours + built)  # the training data: never tokenized
    c = _rows(tmp_path / "c")
    _close(c, old, ("validation", "extra", "_micro", "_macro"), ("loss", "bpb", "tokens"))
    assert math.isfinite(c["validation"]["unigram_bpb"])
