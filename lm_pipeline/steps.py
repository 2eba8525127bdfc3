"""The pipeline's stages as content-addressed steps (no Dagster here).

raw_shards -> tokenizer -> token_cache -> train_ckpt -> eval_report, hf_export

Each stage's fingerprint is a hash of (its semantic config, its code version, its inputs'
fingerprints); its output lives at ``<store root>/<stage>/<fingerprint>/`` and is complete when
its manifest exists. A complete stage is a cache hit: it does no work. The Dagster assets and
the command line both call these functions.

Two hashes per stage:

* :meth:`Pipeline.address` -- the *fingerprint*: config + code version + the inputs' fingerprints,
  down to the content hashes of the raw shards. It names the artifact. Computing it reads the
  data's bytes (hashes), but does no stage's work.
* :meth:`Pipeline.config_version` -- the same chain over config and code versions only (no data
  is read). Dagster uses it as the asset's ``code_version``, known when the definitions load, so
  a config edit marks exactly the stages whose fingerprint it changes as stale.

The token cache can be built in one call (:meth:`Pipeline.token_cache`) or fanned out over shard
groups (:meth:`Pipeline.token_cache_groups`, :meth:`Pipeline.token_cache_part` per group, in any
process and order, then :meth:`Pipeline.token_cache_commit`); both give byte-identical caches.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lm_pipeline.config import RunConfig
from lm_pipeline.fingerprint import fingerprint, hash_json, semantic_view
from lm_pipeline.schema import ConfigError
from lm_pipeline.store import Artifact, ArtifactStore, StorageError, storage_error

log = logging.getLogger(__name__)

# Bump a stage's code version when its output format or semantics change (tokenizer 2: BPE
# training cuts words longer than lm_pipeline.data.tokenizer.MAX_TRAIN_WORD characters).
CODE_VERSIONS = {"raw_shards": 1, "tokenizer": 2, "token_cache": 1, "train_ckpt": 1, "eval_report": 1, "hf_export": 1}
STAGES = ("raw_shards", "tokenizer", "token_cache", "train_ckpt", "eval_report", "hf_export")
#: Stages whose fingerprint depends on which checkpoint of the run they read.
CHECKPOINT_STAGES = ("eval_report", "hf_export")


@dataclass
class StageResult:
    """What a stage produced: its address, whether it was a cache hit, and its manifest."""

    stage: str
    fingerprint: str
    path: str
    hit: bool
    manifest: dict[str, Any]
    seconds: float = 0.0

    @property
    def summary(self) -> dict[str, Any]:
        return {"stage": self.stage, "fingerprint": self.fingerprint, "seconds": round(self.seconds, 3),
                **self.manifest.get("summary", {})}


@dataclass
class _Address:
    stage: str
    fingerprint: str
    config: Any
    inputs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class CacheGroup:
    """One unit of the token cache fan-out: a group of consecutive shards of one split."""

    split: str
    index: int
    shards: tuple[str, ...]  # shard names, in order

    @property
    def key(self) -> str:
        """A stable identifier made of ``[A-Za-z0-9_]`` (usable as a Dagster mapping key)."""
        return f"{re.sub(r'[^A-Za-z0-9_]', '_', self.split)}_{self.index:05d}"

    def to_dict(self) -> dict[str, Any]:
        return {"split": self.split, "index": self.index, "shards": list(self.shards)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CacheGroup:
        return cls(d["split"], int(d["index"]), tuple(d["shards"]))


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, Mapping):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out or {prefix: {}}
    return {prefix: obj}


def diff_fields(old: Any, new: Any) -> list[str]:
    """Dotted keys whose values differ, as ``key: old -> new``."""
    a, b = _flatten(old), _flatten(new)
    lines = []
    for k in sorted(set(a) | set(b)):
        if a.get(k, "<absent>") != b.get(k, "<absent>"):
            lines.append(f"{k}: {json.dumps(a.get(k, '<absent>'), default=str)} -> {json.dumps(b.get(k, '<absent>'), default=str)}")
    return lines


def _sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def complete_checkpoints(run_dir: str) -> list[dict[str, Any]]:
    """The complete ``step-N`` checkpoints directly under ``run_dir``, by step: ``{step, path, kind}``."""
    from lm_pipeline import atomic
    from lm_pipeline.train.checkpoint import IncompleteCheckpointError, read_metadata

    if atomic.is_local(run_dir):
        try:
            names = os.listdir(atomic.local_path(run_dir))
        except (FileNotFoundError, NotADirectoryError):
            return []
    else:
        fs, inner = atomic.get_fs(run_dir)
        try:
            fs.invalidate_cache(inner)
            names = [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(inner, detail=False)]
        except FileNotFoundError:
            return []
    out = []
    for name in names:
        m = re.fullmatch(r"step-(\d+)", name)
        if not m:
            continue
        path = atomic.join(run_dir, name)
        try:
            marker = read_metadata(path)
        except (IncompleteCheckpointError, FileNotFoundError):
            continue
        out.append({"step": int(marker.get("step", m.group(1))), "path": path, "kind": marker.get("kind", "permanent")})
    return sorted(out, key=lambda c: c["step"])


def merge_cache_parts(out_dir: str, parts: Sequence[tuple[Sequence[Any], str]], tokenizer_dir: str) -> dict[str, Any]:
    """Write the token cache of all parts' shards at ``out_dir`` from per-group part caches.

    ``parts``: ``(shards of the group, part cache dir)`` in shard order. See
    :func:`lm_pipeline.data.cache.merge_cache_parts`.
    """
    from lm_pipeline.data.cache import merge_cache_parts as merge

    return merge(out_dir, parts, tokenizer_dir)


def _tokenizer_files(tok_dir: str) -> dict[str, Path]:
    """The tokenizer's own files, for a checkpoint's ``tokenizer/``: never the store's manifest
    (a copied manifest.json would make a partial downstream artifact look complete)."""
    from lm_pipeline.store import MANIFEST

    return {f"tokenizer/{p.name}": p for p in sorted(Path(tok_dir).iterdir())
            if p.is_file() and p.name != MANIFEST and not p.name.startswith(".")}


class Pipeline:
    """The stages of one experiment over one artifact store."""

    def __init__(self, cfg: RunConfig, store: ArtifactStore | None = None, *, progress: bool = True,
                 eval_config: Any = None, export_config: Any = None):
        self.cfg = cfg
        self.store = store or ArtifactStore(cfg.store.root)
        self.progress = progress
        self._eval_config = eval_config
        self._export_config = export_config
        self._shards: dict[str, list] | None = None
        self._addr: dict[tuple[str, Any], _Address] = {}

    # ---------------------------------------------------------------- settings

    @property
    def eval_config(self):
        """The evaluation settings: given, else the config's ``eval:`` section, else the defaults."""
        if self._eval_config is not None:
            return self._eval_config
        found = getattr(self.cfg, "eval", None)
        if found is not None:
            return found
        from lm_pipeline.eval import EvalConfig

        return EvalConfig()

    @property
    def export_config(self):
        """The Hugging Face export settings: given, else the config's ``export:``, else defaults."""
        if self._export_config is not None:
            return self._export_config
        found = getattr(self.cfg, "export", None)
        if found is not None:
            return found
        from lm_pipeline.hf import ExportConfig

        return ExportConfig()

    # ---------------------------------------------------------------- addressing

    def preflight(self) -> None:
        """Checks that need the runtime (device count) but no compute: fail before any work."""
        import jax

        self.cfg.trainer.check_devices(jax.device_count())

    @property
    def builtin_root(self) -> str:
        return f"{self.store.root}/builtin"

    def shards(self) -> dict[str, list]:
        """Shards per split: 'train' and each validation set (resolved once)."""
        if self._shards is None:
            from lm_pipeline.data.sources import resolve_shards, validation_sets

            data = self.cfg.data
            if not data.train_sources():
                raise ConfigError("data", "no training data: set data.train_urls, data.hf_id or data.builtin")
            root = self.builtin_root if data.builtin else None
            out = {"train": resolve_shards(data, "train", builtin_root=root)}
            out.update(validation_sets(data, builtin_root=root))
            self._shards = out
        return self._shards

    def _source_config(self) -> dict[str, Any]:
        view = semantic_view(self.cfg.data)
        view.pop("tokenizer", None)
        view.pop("packing", None)
        return view

    def _stage_config(self, stage: str) -> tuple[Any, tuple[str, ...]]:
        """(semantic config of ``stage``, the upstream stages whose fingerprints are its inputs)."""
        cfg = self.cfg
        if stage == "raw_shards":
            return self._source_config(), ()
        if stage == "tokenizer":
            tok = cfg.data.tokenizer
            conf = semantic_view(tok)
            if tok.kind == "bpe":
                return conf, ("raw_shards",)
            local = Path(tok.name_or_path or "") / "tokenizer.json"
            if local.is_file():  # a local tokenizer is named by its content, never its path
                conf = {k: v for k, v in conf.items() if k != "name_or_path"}
            return conf, ()
        if stage == "token_cache":
            return {}, ("raw_shards", "tokenizer")
        if stage == "train_ckpt":
            return ({"model": semantic_view(cfg.model), "trainer": semantic_view(cfg.trainer),
                     "optimizer": semantic_view(cfg.optimizer), "packing": cfg.data.packing}, ("token_cache",))
        if stage == "eval_report":
            return semantic_view(self.eval_config), ("train_ckpt", "token_cache")
        if stage == "hf_export":
            return semantic_view(self.export_config), ("train_ckpt",)
        raise ValueError(f"unknown stage {stage!r}; stages: {', '.join(STAGES)}")

    def _tokenizer_source(self) -> dict[str, str]:
        tok = self.cfg.data.tokenizer
        local = Path(tok.name_or_path or "") / "tokenizer.json"
        return {"tokenizer.json": _sha256_file(local)} if local.is_file() else {"hub": f"{tok.name_or_path}@{tok.revision}"}

    def final_step(self) -> int | str:
        """The step of the run's final checkpoint: from the finished run, else from the config."""
        manifest = self.store.manifest("train_ckpt", self.address("train_ckpt").fingerprint)
        if manifest is not None and manifest.get("summary", {}).get("final_step") is not None:
            return int(manifest["summary"]["final_step"])
        try:
            return self.cfg.trainer.resolve_num_steps(None, self.cfg.model.seq_len)
        except ConfigError:  # num_epochs: needs the data's size
            return "final"

    def address(self, stage: str, step: int | None = None) -> _Address:
        """A stage's fingerprint and what went into it (computed without doing the stage's work).

        ``step`` (eval_report, hf_export): the checkpoint step they read; default the final one.
        """
        if stage in CHECKPOINT_STAGES and step is None:
            step_key: Any = self.final_step()
        else:
            step_key = step if stage in CHECKPOINT_STAGES else None
        if (stage, step_key) in self._addr:
            return self._addr[(stage, step_key)]
        conf, upstream = self._stage_config(stage)
        inputs: dict[str, Any] = {up: self.address(up).fingerprint for up in upstream}
        if stage == "raw_shards":
            inputs = {f"{split}/{s.name}": s.fingerprint for split, shards in self.shards().items() for s in shards}
        elif stage == "tokenizer" and self.cfg.data.tokenizer.kind != "bpe":
            inputs = self._tokenizer_source()
        if stage in CHECKPOINT_STAGES:
            inputs["step"] = step_key
        addr = _Address(stage, fingerprint(stage, conf, CODE_VERSIONS[stage], inputs), conf, inputs)
        self._addr[(stage, step_key)] = addr
        return addr

    def config_version(self, stage: str) -> str:
        """Hash of the stage's semantic config, code version and its upstream stages' config
        versions: what the fingerprint covers, minus the data's content. No data is read."""
        conf, upstream = self._stage_config(stage)
        inputs = {up: self.config_version(up) for up in upstream}
        if stage == "tokenizer" and self.cfg.data.tokenizer.kind != "bpe":
            inputs.update(self._tokenizer_source())
        return hash_json({"stage": stage, "config": conf, "code_version": CODE_VERSIONS[stage], "inputs": inputs})

    def config_versions(self) -> dict[str, str]:
        return {stage: self.config_version(stage) for stage in STAGES}

    def _path(self, stage: str) -> str:
        return self.store.artifact(stage, self.address(stage).fingerprint).path

    def cached(self, stage: str, step: int | None = None) -> StageResult | None:
        """The stage's result if it is complete (a cache hit), else None. Does no work."""
        t0 = time.perf_counter()
        addr = self.address(stage, step)
        manifest = self.store.manifest(stage, addr.fingerprint)
        if manifest is None:
            return None
        path = self.store.artifact(stage, addr.fingerprint).path
        return StageResult(stage, addr.fingerprint, path, True, manifest, time.perf_counter() - t0)

    def _run(self, stage: str, build, step: int | None = None) -> StageResult:
        addr = self.address(stage, step)
        art = self.store.artifact(stage, addr.fingerprint)
        t0 = time.perf_counter()
        manifest = self.store.manifest(stage, addr.fingerprint)
        if manifest is not None:
            log.info("%s %s: cache hit (%s)", stage, addr.fingerprint, art.path)
            return StageResult(stage, addr.fingerprint, art.path, True, manifest, time.perf_counter() - t0)
        try:
            with self.store.lock(art):
                manifest = self.store.manifest(stage, addr.fingerprint)  # another writer may have finished
                if manifest is not None:
                    return StageResult(stage, addr.fingerprint, art.path, True, manifest, time.perf_counter() - t0)
                log.info("%s %s: building at %s", stage, addr.fingerprint, art.path)
                summary, extra = build(art.path)
                manifest = self.store.commit(art, {"config": addr.config, "inputs": addr.inputs,
                                                   "code_version": CODE_VERSIONS[stage], "summary": summary,
                                                   "seconds": round(time.perf_counter() - t0, 3), **extra})
        except StorageError:
            raise
        except Exception as e:
            clear = storage_error(e, f"{stage} {addr.fingerprint}", art.path)
            if clear is None:
                raise
            raise clear from e
        return StageResult(stage, addr.fingerprint, art.path, False, manifest, time.perf_counter() - t0)

    # ---------------------------------------------------------------- stages

    def raw_shards(self) -> StageResult:
        """Validate every shard under the configured policy; record per-shard counts."""

        def build(path: str):
            from lm_pipeline.data.sources import scan_shards

            splits: dict[str, list[dict[str, Any]]] = {}
            totals = {"records": 0, "valid": 0, "skipped": 0}
            for split, shards in self.shards().items():
                reports = scan_shards(shards)
                rows = []
                for s in shards:
                    r = reports[s.name].to_dict()
                    rows.append({"name": s.name, "url": s.url, "fingerprint": s.fingerprint, **r})
                    totals["records"] += r.get("records", 0)
                    totals["valid"] += r.get("valid", 0)
                    totals["skipped"] += sum((r.get("skipped") or {}).values())
                splits[split] = rows
            summary = {"num_shards": sum(len(v) for v in splits.values()), **totals, "splits": sorted(splits)}
            return summary, {"shards": splits}

        return self._run("raw_shards", build)

    def tokenizer(self) -> StageResult:
        """Train the BPE on the training shards, or fetch the configured HF tokenizer."""
        self.raw_shards()

        def build(path: str):
            from lm_pipeline.data.sources import iter_shard_texts
            from lm_pipeline.data.tokenizer import build_tokenizer

            tok = self.cfg.data.tokenizer
            texts = iter_shard_texts(self.shards()["train"]) if tok.kind == "bpe" else None
            info = build_tokenizer(tok, path, texts, progress=self.progress) if texts is not None else build_tokenizer(tok, path)
            return {"vocab_size": info.vocab_size, "eos_id": info.eos_id, "bos_id": info.bos_id}, {}

        return self._run("tokenizer", build)

    @staticmethod
    def _cache_summary(splits: dict[str, dict[str, Any]]) -> dict[str, Any]:
        return {"splits": splits, "train_tokens": splits["train"].get("num_tokens")}

    @staticmethod
    def _ledger_counts(ledger: Mapping[str, Any]) -> dict[str, Any]:
        c = ledger.get("committed", {})
        return {"num_docs": c.get("docs"), "num_tokens": c.get("tokens"), "num_bytes": c.get("bytes"),
                "num_shards": c.get("shards")}

    def token_cache(self) -> StageResult:
        """Tokenize every split into its own token cache under this artifact (in this process)."""
        tok = self.tokenizer()

        def build(path: str):
            from lm_pipeline.data.cache import build_cache

            data = self.cfg.data
            splits = {}
            for split, shards in self.shards().items():
                ledger = build_cache(f"{path}/{split}", shards, tok.path, num_workers=data.num_workers,
                                     shard_group_size=data.shard_group_size, progress=self.progress)
                splits[split] = self._ledger_counts(ledger)
            return self._cache_summary(splits), {"tokenizer_path": tok.path, "built_by": "single"}

        return self._run("token_cache", build)

    # -- fan-out: groups built anywhere, then one commit ------------------------------------

    def token_cache_groups(self) -> list[CacheGroup]:
        """The shard groups of every split (``data.shard_group_size`` consecutive shards each)."""
        size = self.cfg.data.shard_group_size
        groups = []
        for split, shards in self.shards().items():
            for i in range(0, max(len(shards), 1), size):
                groups.append(CacheGroup(split, i // size, tuple(s.name for s in shards[i : i + size])))
        return groups

    def _parts_root(self) -> str:
        return f"{self.store.root}/token_cache/.parts-{self.address('token_cache').fingerprint}"

    def _group_shards(self, group: CacheGroup) -> list:
        by_name = {s.name: s for s in self.shards()[group.split]}
        missing = [n for n in group.shards if n not in by_name]
        if missing:
            raise ValueError(f"token cache group {group.key}: unknown shards {missing[:3]} (the data changed?)")
        return [by_name[n] for n in group.shards]

    def token_cache_part(self, group: CacheGroup) -> dict[str, Any]:
        """Tokenize one group into its own part cache (idempotent; safe to run concurrently)."""
        from lm_pipeline.data.cache import build_cache

        tok = self.tokenizer()
        fp = self.address("token_cache").fingerprint
        part_dir = f"{self._parts_root()}/{group.split}/{group.index:05d}"
        shards = self._group_shards(group)
        t0 = time.perf_counter()
        lock = Artifact("token_cache", f"{fp}-part-{group.key}", part_dir)
        with self.store.lock(lock):
            ledger = build_cache(part_dir, shards, tok.path, num_workers=1, shard_group_size=max(len(shards), 1),
                                 progress=False, overwrite=True)
        return {"group": group.key, "path": part_dir, **self._ledger_counts(ledger),
                "seconds": round(time.perf_counter() - t0, 3)}

    def token_cache_commit(self, built: Sequence[Mapping[str, Any]] = ()) -> StageResult:
        """Assemble the token cache from the groups' parts (building any part that is missing) and
        commit it; the parts are removed afterwards. A complete cache is a hit."""
        tok = self.tokenizer()

        def build(path: str):
            splits = {}
            groups = self.token_cache_groups()
            for split in self.shards():
                parts = []
                for group in (g for g in groups if g.split == split):
                    info = self.token_cache_part(group)  # a hit on the part's ledger if already built
                    parts.append((self._group_shards(group), info["path"]))
                ledger = merge_cache_parts(f"{path}/{split}", parts, tok.path)
                splits[split] = self._ledger_counts(ledger)
            return self._cache_summary(splits), {"tokenizer_path": tok.path, "built_by": "fan-out",
                                                 "groups": len(groups), "parts_built": len(built)}

        res = self._run("token_cache", build)
        self._remove_parts()
        return res

    def _remove_parts(self) -> None:
        from lm_pipeline import atomic

        root = self._parts_root()
        if atomic.is_local(root):
            shutil.rmtree(atomic.local_path(root), ignore_errors=True)
        else:
            fs, inner = atomic.get_fs(root)
            with contextlib.suppress(FileNotFoundError):
                fs.rm(inner, recursive=True)

    # -- training ------------------------------------------------------------------------------

    def datasets(self, cache: StageResult | None = None):
        """(train dataset, {validation set: dataset}, tokenizer dir, vocab size) from the cache."""
        from lm_pipeline.data.loader import open_dataset
        from lm_pipeline.data.tokenizer import tokenizer_info

        cache = cache or self.token_cache()
        seq_len, packing = self.cfg.model.seq_len, self.cfg.data.packing
        train = open_dataset(f"{cache.path}/train", seq_len, packing)
        evals = {name: open_dataset(f"{cache.path}/{name}", seq_len, packing)
                 for name in self.shards() if name != "train"}
        tok_dir = cache.manifest["tokenizer_path"]
        return train, evals, tok_dir, tokenizer_info(tok_dir).vocab_size

    def run_id(self) -> str:
        """The training run's id: ``trainer.id`` if set, else the train_ckpt fingerprint."""
        from lm_pipeline.train.config import check_run_id

        rid = self.cfg.trainer.id  # checked again: a config built without validation may carry any id
        return check_run_id(rid) if rid is not None else self.address("train_ckpt").fingerprint

    def run_dir(self) -> str:
        """Where the training run lives: the store address, or ``checkpointer.base_path/<run id>``."""
        base = self.cfg.trainer.checkpointer.base_path
        if base:
            return f"{base.rstrip('/')}/{self.run_id()}"
        return self._path("train_ckpt")

    def train_ckpt(self, hooks: Sequence = ()) -> StageResult:
        """Train (resuming from the run's latest checkpoint); the manifest marks the run finished."""
        cache = self.token_cache()

        def build(path: str):
            from lm_pipeline.hf import export_hook
            from lm_pipeline.train.run import train
            from lm_pipeline.train.trainer import StepInfo

            train_ds, evals, tok_dir, vocab = self.datasets(cache)
            run_dir = self.run_dir()
            # Levanter's hf_save_steps: export every N steps, and once more at the end.
            hf_hook = export_hook(self.export_config, run_dir=run_dir, tokenizer_dir=tok_dir)
            res = train(self.cfg, train_data=train_ds, vocab_size=vocab, eval_data=evals,
                        eval_bytes_per_token={n: d.bytes_per_token for n, d in evals.items()},
                        run_id=self.run_id(), run_dir=run_dir,
                        extra_checkpoint_files=_tokenizer_files(tok_dir),
                        hooks=[*hooks, *([hf_hook] if hf_hook else [])])
            if hf_hook and res.final_step % hf_hook.every:
                hf_hook.fn(StepInfo(res.final_step, res.state, res.metrics))
            final = res.checkpoints[-1] if res.checkpoints else None
            from lm_pipeline.train.checkpoint import latest_checkpoint

            final = latest_checkpoint(run_dir) or final
            summary = {"final_step": res.final_step, "final_checkpoint": final,
                       "resumed_from": res.resumed_from,
                       **{k: v for k, v in res.metrics.items() if isinstance(v, (int, float))}}
            return summary, {"run_dir": run_dir, "run_id": self.run_id(), "final_checkpoint": final,
                             "checkpoints": res.checkpoints, "eval_history": res.eval_history,
                             "train_seconds": res.train_seconds, "resumed_from": res.resumed_from}

        return self._run("train_ckpt", build)

    # -- checkpoint consumers ----------------------------------------------------------------------

    def _checkpoint(self, checkpoint: str | None) -> tuple[str, int]:
        """(complete checkpoint dir, its step): the given one, else the finished run's final one."""
        from lm_pipeline.train.checkpoint import latest_checkpoint, read_metadata

        if checkpoint is None:
            run = self.train_ckpt()
            checkpoint = run.manifest.get("final_checkpoint") or latest_checkpoint(run.manifest.get("run_dir", run.path))
            if checkpoint is None:
                raise FileNotFoundError(f"training run {run.path} has no complete checkpoint")
        found = latest_checkpoint(checkpoint)
        if found is None:
            raise FileNotFoundError(f"no complete checkpoint at or under {checkpoint}")
        return found, int(read_metadata(found)["step"])

    def eval_report(self, checkpoint: str | None = None) -> StageResult:
        """Evaluate a checkpoint (default: the run's final one) on every validation set, with the
        unigram baseline; the report is written as Parquet + JSON under the artifact."""
        ckpt, step = self._checkpoint(checkpoint)
        cache = self.token_cache()

        def build(path: str):
            from lm_pipeline.eval import evaluate_checkpoint, write_report

            _, evals, _, _ = self.datasets(cache)
            ev = self.eval_config
            t0 = time.perf_counter()
            df = evaluate_checkpoint(ckpt, evals, batch_size=ev.batch_size, max_eval_batches=ev.max_eval_batches,
                                     compute_dtype=ev.compute_dtype,
                                     train_cache=f"{cache.path}/train" if ev.unigram_baseline else None)
            files = write_report(df, path)
            rows = json.loads(df.to_json(orient="records", double_precision=15))
            micro = next((r for r in rows if r.get("kind") == "micro"), {})
            summary = {"step": step, "checkpoint": ckpt, "eval_seconds": round(time.perf_counter() - t0, 3),
                       **{k: micro.get(k) for k in ("loss", "perplexity", "bpb", "unigram_loss", "unigram_bpb", "tokens")}}
            return summary, {"checkpoint": ckpt, "step": step, "report": files, "rows": rows}

        return self._run("eval_report", build, step=step)

    def hf_export(self, checkpoint: str | None = None, *, sample_prompt: str | None = "import ",
                  sample_tokens: int = 48) -> StageResult:
        """Export a checkpoint (default: the run's final one) as a ``transformers`` model directory
        (the artifact directory itself); a short sample of its text (temperature 0.8, top-k 40,
        seed 0: reproducible) is recorded in the manifest."""
        ckpt, step = self._checkpoint(checkpoint)

        def build(path: str):
            from lm_pipeline.hf import export_hf

            ex = self.export_config
            t0 = time.perf_counter()
            export_hf(ckpt, path, dtype=ex.dtype, max_shard_size=ex.max_shard_size, overwrite=True,
                      progress=None if self.progress else False)
            files = sorted(p.name for p in Path(path).iterdir() if p.is_file())
            size = sum((Path(path) / f).stat().st_size for f in files)
            summary: dict[str, Any] = {"step": step, "checkpoint": ckpt, "files": files, "bytes": size,
                                       "export_seconds": round(time.perf_counter() - t0, 3)}
            if sample_prompt is not None:
                from lm_pipeline.generate import generate_text

                room = self.cfg.model.seq_len - len(sample_prompt.encode("utf-8")) - 1  # tokens <= bytes (+BOS)
                try:
                    summary["sample_prompt"] = sample_prompt
                    summary["sample"] = generate_text(ckpt, sample_prompt, max(1, min(sample_tokens, room)),
                                                      temperature=0.8, top_k=40, seed=0)
                except Exception as e:  # a sample is a nicety; never fail the export for it
                    log.warning("hf_export: sample generation failed: %s", e)
            return summary, {"checkpoint": ckpt, "step": step}

        return self._run("hf_export", build, step=step)

    # ---------------------------------------------------------------- plan

    def plan(self) -> list[dict[str, Any]]:
        """Per stage: hit or miss, and for a miss what changed since the stage's last artifact."""
        rows = []
        for stage in STAGES:
            addr = self.address(stage)
            hit = self.store.is_complete(stage, addr.fingerprint)
            row: dict[str, Any] = {"stage": stage, "fingerprint": addr.fingerprint, "hit": hit, "changes": []}
            if not hit:
                previous = self.store.complete(stage)
                if previous:
                    last = previous[-1]
                    row["compared_with"] = last["fingerprint"]
                    row["changes"] = diff_fields({"config": last.get("config"), "inputs": last.get("inputs"),
                                                  "code_version": last.get("code_version")},
                                                 {"config": addr.config, "inputs": addr.inputs,
                                                  "code_version": CODE_VERSIONS[stage]})
                else:
                    row["changes"] = ["no earlier artifact of this stage"]
            rows.append(row)
        return rows

    def plan_text(self) -> str:
        lines = []
        for row in self.plan():
            status = "hit " if row["hit"] else "MISS"
            lines.append(f"{status} {row['stage']:<12} {row['fingerprint']}")
            if not row["hit"] and row.get("compared_with"):
                lines.append(f"       changed since {row['compared_with']}:")
            lines.extend(f"         {c}" for c in row["changes"])
        return "\n".join(lines)
