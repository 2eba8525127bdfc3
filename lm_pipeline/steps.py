"""The pipeline's stages as content-addressed steps (no Dagster here).

raw_shards -> tokenizer -> token_cache -> train_ckpt (-> eval_report, hf_export)

Each stage's fingerprint is a hash of (its semantic config, its code version, its inputs'
fingerprints); its output lives at ``<store root>/<stage>/<fingerprint>/`` and is complete when
its manifest exists. A complete stage is a cache hit: it does no work. The Dagster assets and
the command line both call these functions.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lm_pipeline.config import RunConfig
from lm_pipeline.fingerprint import fingerprint, semantic_view
from lm_pipeline.schema import ConfigError
from lm_pipeline.store import ArtifactStore

log = logging.getLogger(__name__)

# Bump a stage's code version when its output format or semantics change.
CODE_VERSIONS = {"raw_shards": 1, "tokenizer": 1, "token_cache": 1, "train_ckpt": 1}
STAGES = ("raw_shards", "tokenizer", "token_cache", "train_ckpt")


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
    inputs: dict[str, str] = field(default_factory=dict)


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


class Pipeline:
    """The stages of one experiment over one artifact store."""

    def __init__(self, cfg: RunConfig, store: ArtifactStore | None = None, *, progress: bool = True):
        self.cfg = cfg
        self.store = store or ArtifactStore(cfg.store.root)
        self.progress = progress
        self._shards: dict[str, list] | None = None
        self._addr: dict[str, _Address] = {}

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

    def address(self, stage: str) -> _Address:
        """A stage's fingerprint and what went into it (computed without doing the stage's work)."""
        if stage in self._addr:
            return self._addr[stage]
        cfg = self.cfg
        if stage == "raw_shards":
            inputs = {f"{split}/{s.name}": s.fingerprint for split, shards in self.shards().items() for s in shards}
            conf: Any = self._source_config()
        elif stage == "tokenizer":
            tok = cfg.data.tokenizer
            conf = semantic_view(tok)
            if tok.kind == "bpe":
                inputs = {"raw_shards": self.address("raw_shards").fingerprint}
            else:
                local = Path(tok.name_or_path or "") / "tokenizer.json"
                # Hash a local tokenizer's content, never its path, so moving it changes nothing.
                inputs = {"tokenizer.json": _sha256_file(local)} if local.is_file() else {"hub": f"{tok.name_or_path}@{tok.revision}"}
                conf = {k: v for k, v in conf.items() if k != "name_or_path" or not local.is_file()}
        elif stage == "token_cache":
            conf = {}
            inputs = {"raw_shards": self.address("raw_shards").fingerprint, "tokenizer": self.address("tokenizer").fingerprint}
        elif stage == "train_ckpt":
            conf = {"model": semantic_view(cfg.model), "trainer": semantic_view(cfg.trainer),
                    "optimizer": semantic_view(cfg.optimizer), "packing": cfg.data.packing}
            inputs = {"token_cache": self.address("token_cache").fingerprint}
        else:
            raise ValueError(f"unknown stage {stage!r}")
        addr = _Address(stage, fingerprint(stage, conf, CODE_VERSIONS[stage], inputs), conf, inputs)
        self._addr[stage] = addr
        return addr

    def _path(self, stage: str) -> str:
        return self.store.artifact(stage, self.address(stage).fingerprint).path

    def _run(self, stage: str, build) -> StageResult:
        addr = self.address(stage)
        art = self.store.artifact(stage, addr.fingerprint)
        t0 = time.perf_counter()
        manifest = self.store.manifest(stage, addr.fingerprint)
        if manifest is not None:
            log.info("%s %s: cache hit (%s)", stage, addr.fingerprint, art.path)
            return StageResult(stage, addr.fingerprint, art.path, True, manifest, time.perf_counter() - t0)
        with self.store.lock(art):
            manifest = self.store.manifest(stage, addr.fingerprint)  # another writer may have finished
            if manifest is not None:
                return StageResult(stage, addr.fingerprint, art.path, True, manifest, time.perf_counter() - t0)
            log.info("%s %s: building at %s", stage, addr.fingerprint, art.path)
            summary, extra = build(art.path)
            manifest = self.store.commit(art, {"config": addr.config, "inputs": addr.inputs,
                                               "code_version": CODE_VERSIONS[stage], "summary": summary,
                                               "seconds": round(time.perf_counter() - t0, 3), **extra})
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

    def token_cache(self) -> StageResult:
        """Tokenize every split into its own token cache under this artifact."""
        tok = self.tokenizer()

        def build(path: str):
            from lm_pipeline.data.cache import build_cache

            data = self.cfg.data
            splits = {}
            for split, shards in self.shards().items():
                ledger = build_cache(f"{path}/{split}", shards, tok.path, num_workers=data.num_workers,
                                     shard_group_size=data.shard_group_size, progress=self.progress)
                splits[split] = {k: ledger.get(k) for k in ("num_docs", "num_tokens", "num_bytes") if k in ledger}
            summary = {"splits": splits, "train_tokens": splits["train"].get("num_tokens")}
            return summary, {"tokenizer_path": tok.path}

        return self._run("token_cache", build)

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

    def run_dir(self) -> str:
        """Where the training run lives: the store address, or ``checkpointer.base_path/<run id>``."""
        base = self.cfg.trainer.checkpointer.base_path
        fp = self.address("train_ckpt").fingerprint
        if base:
            return f"{base.rstrip('/')}/{self.cfg.trainer.id or fp}"
        return self._path("train_ckpt")

    def train_ckpt(self, hooks: Sequence = ()) -> StageResult:
        """Train (resuming from the run's latest checkpoint); the manifest marks the run finished."""
        cache = self.token_cache()

        def build(path: str):
            from lm_pipeline.train.run import train

            train_ds, evals, tok_dir, vocab = self.datasets(cache)
            run_dir = self.run_dir()
            res = train(self.cfg, train_data=train_ds, vocab_size=vocab, eval_data=evals,
                        eval_bytes={n: d.num_bytes for n, d in evals.items()},
                        run_id=self.cfg.trainer.id or self.address("train_ckpt").fingerprint, run_dir=run_dir,
                        extra_checkpoint_files={"tokenizer": Path(tok_dir)}, hooks=hooks)
            final = res.checkpoints[-1] if res.checkpoints else None
            from lm_pipeline.train.checkpoint import latest_checkpoint

            final = latest_checkpoint(run_dir) or final
            summary = {"final_step": res.final_step, "final_checkpoint": final,
                       **{k: v for k, v in res.metrics.items() if isinstance(v, (int, float))}}
            return summary, {"run_dir": run_dir, "final_checkpoint": final, "checkpoints": res.checkpoints,
                             "eval_history": res.eval_history, "train_seconds": res.train_seconds}

        return self._run("train_ckpt", build)

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

