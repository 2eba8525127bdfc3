"""``lm-pipeline lineage``: an artifact's chain of inputs, read from the store's manifests.

A store is built by hand (``ArtifactStore.commit``, no training): raw_shards -> tokenizer ->
token_cache -> train_ckpt -> hf_export, plus decoy artifacts of the same stages committed later
(the newest of a stage is never the right input), and a fingerprint prefix two artifacts share.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lm_pipeline.steps.lineage import (
    AmbiguousFingerprint,
    IncompleteArtifact,
    UnknownArtifact,
    format_lineage,
    lineage,
    resolve,
)
from lm_pipeline.store import ArtifactStore

ROOT = Path(__file__).resolve().parents[1]


def _fp(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()[:16]


def _sha(name: str) -> str:
    return hashlib.sha256(f"content of {name}".encode()).hexdigest()


RS, TK, TC, TR, EX = _fp("raw_shards"), _fp("tokenizer"), _fp("token_cache"), _fp("train_ckpt"), _fp("hf_export")
# decoys sharing the prefix "deadbeef": a later tokenizer and a later run on another token cache
TK2, TC2, TR2 = "deadbeef00000001", _fp("token_cache-2"), "deadbeef00000002"
CHAIN = [("hf_export", EX), ("train_ckpt", TR), ("token_cache", TC), ("tokenizer", TK), ("raw_shards", RS)]
SHARDS = {"train": ["code/train-00000.jsonl", "code/train-00001.jsonl"], "validation": ["code/val-00000.jsonl"]}


def _commit(store: ArtifactStore, stage: str, fp: str, config, inputs, summary=None, **extra) -> str:
    art = store.artifact(stage, fp)
    Path(art.path).mkdir(parents=True, exist_ok=True)
    store.commit(art, {"config": config, "inputs": inputs, "code_version": 1, "summary": summary or {}, **extra})
    return art.path


def _build(root: Path) -> ArtifactStore:
    store = ArtifactStore(str(root))
    shards = {split: [{"name": n, "url": f"/data/{n}", "fingerprint": _sha(n), "records": 10 + i, "valid": 10 + i,
                       "skipped": {}} for i, n in enumerate(names)] for split, names in SHARDS.items()}
    _commit(store, "raw_shards", RS, {"train_urls": ["/data/code/train-*.jsonl"], "text_key": "content"},
            {f"{split}/{n}": _sha(n) for split, names in SHARDS.items() for n in names},
            {"num_shards": 3, "records": 33}, shards=shards)
    _commit(store, "tokenizer", TK, {"kind": "bpe", "vocab_size": 384}, {"raw_shards": RS}, {"vocab_size": 384})
    _commit(store, "token_cache", TC, {}, {"raw_shards": RS, "tokenizer": TK}, {"train_tokens": 12345},
            tokenizer_path=f"{root}/tokenizer/{TK}")
    run = _commit(store, "train_ckpt", TR, {"model": {"type": "gpt2", "num_layers": 3, "hidden_dim": 64},
                                            "optimizer": {"learning_rate": 0.001}, "packing": "concat"},
                  {"token_cache": TC}, {"final_step": 6, "train/loss": 4.25}, run_dir=f"{root}/train_ckpt/{TR}")
    step = Path(run) / "step-6"
    (step / "tokenizer").mkdir(parents=True)  # a checkpoint carries its tokenizer: not the tokenizer stage
    (step / "tokenizer" / "tokenizer.json").write_text("{}")
    _commit(store, "hf_export", EX, {"dtype": "bfloat16", "max_shard_size": "2GB"}, {"train_ckpt": TR, "step": 6},
            {"step": 6, "files": ["config.json"]}, checkpoint=str(step), step=6)
    # decoys, committed after the real chain: the newest artifact of a stage is not the input
    _commit(store, "tokenizer", TK2, {"kind": "bpe", "vocab_size": 999}, {"raw_shards": RS})
    _commit(store, "token_cache", TC2, {}, {"raw_shards": RS, "tokenizer": TK2})
    _commit(store, "train_ckpt", TR2, {"model": {"num_layers": 9}}, {"token_cache": TC2})
    return store


@pytest.fixture
def store(tmp_path) -> ArtifactStore:
    return _build(tmp_path / "artifacts")


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``lm-pipeline ARGS`` through the command line's entry point (as tests/test_cli.py runs it)."""
    code = "import sys\nfrom lm_pipeline.cli import main\nsys.argv = ['lm-pipeline', *sys.argv[1:]]\nraise SystemExit(main())\n"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120, cwd=cwd,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def _blocks(text: str) -> list[tuple[tuple[str, str], str]]:
    """((stage, fingerprint), block text) of each step of the text output, in order."""
    out = []
    for block in text.strip().split("\n\n"):
        stage, fp = block.splitlines()[0].split()[:2]
        out.append(((stage, fp), block))
    return out


# -- the library ----------------------------------------------------------------------------------------


def test_chain_of_an_export_follows_the_recorded_inputs_in_order(store):
    steps = lineage(store, "hf_export", EX)
    assert [(s["stage"], s["fingerprint"]) for s in steps] == CHAIN
    by = {s["stage"]: s for s in steps}
    assert all(s["status"] == "complete" for s in steps)
    assert by["train_ckpt"]["config"]["model"]["num_layers"] == 3  # not the decoy run's 9
    assert by["tokenizer"]["config"]["vocab_size"] == 384  # not the decoy tokenizer's 999
    assert by["token_cache"]["upstream"] == {"raw_shards": RS, "tokenizer": TK}
    assert by["hf_export"]["upstream"] == {"train_ckpt": TR} and by["hf_export"]["inputs"]["step"] == 6
    assert by["raw_shards"]["read_by"] == [f"token_cache/{TC}", f"tokenizer/{TK}"]
    assert by["raw_shards"]["path"] == f"{store.root}/raw_shards/{RS}"
    assert by["raw_shards"]["created"] < by["hf_export"]["created"]
    assert [(s["split"], s["name"], s["fingerprint"]) for s in by["raw_shards"]["shards"]] == [
        (split, n, _sha(n)) for split, names in SHARDS.items() for n in names]


def test_a_token_cache_reads_its_tokenizer_and_shards_not_the_newest(store):
    assert [(s["stage"], s["fingerprint"]) for s in lineage(store, "train_ckpt", TR2)] == [
        ("train_ckpt", TR2), ("token_cache", TC2), ("tokenizer", TK2), ("raw_shards", RS)]


def test_a_hub_tokenizer_reads_no_shards_and_still_comes_before_them(store):
    hub, cache = _fp("hub-tokenizer"), _fp("hub-cache")
    _commit(store, "tokenizer", hub, {"kind": "hf", "name_or_path": "gpt2"}, {"hub": "gpt2@main"})
    _commit(store, "token_cache", cache, {}, {"raw_shards": RS, "tokenizer": hub})
    steps = lineage(store, "token_cache", cache)
    assert [(s["stage"], s["fingerprint"]) for s in steps] == [
        ("token_cache", cache), ("tokenizer", hub), ("raw_shards", RS)]
    assert steps[1]["upstream"] == {} and steps[1]["inputs"] == {"hub": "gpt2@main"}
    assert "  source: hub gpt2@main" in format_lineage(steps).split("\n\n")[1]


@pytest.mark.parametrize("arg", ["export_dir", "step_dir", "checkpoint_tokenizer_file", "fingerprint", "prefix",
                                 "stage_slash_prefix"])
def test_resolve_paths_fingerprints_and_prefixes(store, arg):
    root = store.root
    given, expected = {
        "export_dir": (f"{root}/hf_export/{EX}/", ("hf_export", EX)),
        "step_dir": (f"{root}/train_ckpt/{TR}/step-6", ("train_ckpt", TR)),
        "checkpoint_tokenizer_file": (f"{root}/train_ckpt/{TR}/step-6/tokenizer/tokenizer.json", ("train_ckpt", TR)),
        "fingerprint": (EX, ("hf_export", EX)),
        "prefix": (TC[:7], ("token_cache", TC)),
        "stage_slash_prefix": ("train_ckpt/deadbeef", ("train_ckpt", TR2)),
    }[arg]
    found, stage, fp = resolve(given, root)
    assert (stage, fp) == expected and found.root == root


def test_a_run_directory_outside_the_store_is_found_through_its_manifest(store, tmp_path):
    run = tmp_path / "runs" / "my-run"  # trainer.checkpointer.base_path/<run id>
    (run / "step-4").mkdir(parents=True)
    _commit(store, "train_ckpt", _fp("external"), {}, {"token_cache": TC}, run_dir=str(run))
    found, stage, fp = resolve(str(run / "step-4"), store.root)
    assert (found.root, stage, fp) == (store.root, "train_ckpt", _fp("external"))
    with pytest.raises(UnknownArtifact, match="not inside an artifact"):
        resolve(str(tmp_path / "runs"), store.root)  # its parent is no run


def test_resolve_errors_say_what_to_do(store, tmp_path):
    with pytest.raises(AmbiguousFingerprint) as e:
        resolve("deadbeef", store.root)
    assert e.value.matches == [f"tokenizer/{TK2}", f"train_ckpt/{TR2}"]
    with pytest.raises(UnknownArtifact, match=f"no artifact with fingerprint 0123456 in store {store.root}"):
        resolve("0123456", store.root)
    with pytest.raises(UnknownArtifact, match="at least 6"):
        resolve(EX[:4], store.root)
    with pytest.raises(UnknownArtifact, match="not inside an artifact"):
        resolve(str(tmp_path), store.root)
    (Path(store.root) / "hf_export" / "abcdef0123456789").mkdir()
    with pytest.raises(IncompleteArtifact, match="incomplete.*being built"):
        resolve("abcdef01", store.root)


def test_object_store_roots():
    store = _build_memory("memory://lineage-test/store")
    found, stage, fp = resolve(f"{store.root}/train_ckpt/{TR}/step-6", None)
    assert (found.root, stage, fp) == (store.root, "train_ckpt", TR)
    found, stage, fp = resolve(EX[:8], store.root)
    assert [(s["stage"], s["fingerprint"]) for s in lineage(found, stage, fp)] == CHAIN


def _build_memory(root: str) -> ArtifactStore:
    """The same chain in an fsspec memory store (manifests only)."""
    store = ArtifactStore(root)
    for (stage, fp), up in zip(CHAIN, [*CHAIN[1:], None], strict=True):
        inputs = {"raw_shards": RS, "tokenizer": TK} if stage == "token_cache" else ({up[0]: up[1]} if up else {})
        store.commit(store.artifact(stage, fp), {"config": {}, "inputs": inputs, "code_version": 1, "summary": {}})
    from lm_pipeline import fs

    fs.makedirs(f"{root}/train_ckpt/{TR}/step-6")
    with fs.get_fs(root)[0].open(f"{root}/train_ckpt/{TR}/step-6/marker", "w") as f:
        f.write("x")
    return store


def test_lineage_imports_no_jax(store):
    code = ("import sys\nfrom lm_pipeline.steps.lineage import format_lineage, lineage, resolve\n"
            f"s, st, fp = resolve({EX!r}, {store.root!r})\nassert len(format_lineage(lineage(s, st, fp))) > 100\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'equinox', 'optax')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


# -- the command line -----------------------------------------------------------------------------------


@pytest.mark.parametrize("arg", ["export_dir", "step_dir", "fingerprint", "prefix"])
def test_cli_prints_the_chain_with_each_steps_config(store, tmp_path, arg):
    given = {"export_dir": f"artifacts/hf_export/{EX}", "step_dir": f"artifacts/train_ckpt/{TR}/step-6",
             "fingerprint": EX, "prefix": TR[:6]}[arg]
    done = cli("lineage", given, cwd=tmp_path)  # the default store.root is "artifacts"
    assert done.returncode == 0, done.stderr
    blocks = _blocks(done.stdout)
    expected = CHAIN if arg in ("export_dir", "fingerprint") else CHAIN[1:]
    assert [k for k, _ in blocks] == expected
    text = dict(blocks)
    # each step's own config, under that step
    if ("hf_export", EX) in text:
        assert "    dtype: bfloat16" in text[("hf_export", EX)] and "  inputs: train_ckpt" in text[("hf_export", EX)]
    assert "    model.num_layers: 3" in text[("train_ckpt", TR)]
    assert "    optimizer.learning_rate: 0.001" in text[("train_ckpt", TR)]
    assert "    vocab_size: 384" in text[("tokenizer", TK)] and "vocab_size: 384" not in text[("raw_shards", RS)]
    assert "    text_key: content" in text[("raw_shards", RS)]
    assert f"  inputs: raw_shards {RS}, tokenizer {TK}" in text[("token_cache", TC)]
    # a path names its store; a fingerprint is searched in the default store.root, "artifacts"
    root = "artifacts" if arg in ("fingerprint", "prefix") else f"{tmp_path}/artifacts"
    assert f"  path: {root}/token_cache/{TC}\n" in text[("token_cache", TC)]
    for split, names in SHARDS.items():
        for n in names:
            assert f"    {split}  {n}  fingerprint {_sha(n)}" in text[("raw_shards", RS)]


def test_cli_json_equals_the_library_result(store, tmp_path):
    done = cli("lineage", EX[:10], "--store", store.root, "--json", cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == lineage(store, "hf_export", EX)


def test_cli_store_from_the_config(store, tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"store:\n  root: {store.root}\n")
    done = cli("lineage", TK[:8], "--config_path", str(cfg), "--json", cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert [(s["stage"], s["fingerprint"]) for s in json.loads(done.stdout)] == CHAIN[3:]


def test_cli_marks_a_missing_upstream_and_fails(store, tmp_path):
    gone, half = _fp("token_cache-deleted"), _fp("tokenizer-half-built")
    _commit(store, "train_ckpt", _fp("orphan"), {}, {"token_cache": gone})
    _commit(store, "token_cache", _fp("half"), {}, {"raw_shards": RS, "tokenizer": half})
    (Path(store.root) / "tokenizer" / half).mkdir()  # no manifest: incomplete
    done = cli("lineage", _fp("orphan"), "--store", store.root, cwd=ROOT)
    assert done.returncode == 1
    blocks = _blocks(done.stdout)
    assert [k for k, _ in blocks] == [("train_ckpt", _fp("orphan")), ("token_cache", gone)]
    assert "MISSING" in blocks[1][1] and "MISSING" not in blocks[0][1]
    assert f"token_cache {gone}" in done.stderr and store.root in done.stderr

    done = cli("lineage", _fp("half"), "--store", store.root, "--json", cwd=ROOT)
    assert done.returncode == 1
    status = {(s["stage"], s["fingerprint"]): s["status"] for s in json.loads(done.stdout)}
    assert status == {("token_cache", _fp("half")): "complete", ("tokenizer", half): "incomplete",
                      ("raw_shards", RS): "complete"}
    assert f"tokenizer {half} (incomplete" in done.stderr


def test_cli_ambiguous_unknown_and_incomplete(store, tmp_path):
    done = cli("lineage", "deadbeef", "--store", store.root, cwd=ROOT)
    assert done.returncode == 1 and done.stdout == ""
    assert f"tokenizer/{TK2}" in done.stderr and f"train_ckpt/{TR2}" in done.stderr and "ambiguous" in done.stderr

    done = cli("lineage", "0123456789", "--store", str(tmp_path / "elsewhere"), cwd=ROOT)
    assert done.returncode == 1 and done.stdout == ""
    assert f"no artifact with fingerprint 0123456789 in store {tmp_path / 'elsewhere'}" in done.stderr
    assert "--store" in done.stderr

    (Path(store.root) / "train_ckpt" / "abcdef0123456789" / "step-2").mkdir(parents=True)
    done = cli("lineage", f"{store.root}/train_ckpt/abcdef0123456789/step-2", cwd=ROOT)
    assert done.returncode == 1 and "abcdef0123456789 is incomplete" in done.stderr


def test_format_lineage_text_shape(store):
    text = format_lineage(lineage(store, "token_cache", TC))
    assert text.splitlines()[0].startswith(f"token_cache {TC}  created ")
    assert "  config: {}" in text
