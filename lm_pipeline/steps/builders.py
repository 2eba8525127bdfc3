"""What each stage does: one build function per stage of the table (:mod:`lm_pipeline.steps.stages`).

Each is ``build(ctx, inputs, **options)`` (:mod:`lm_pipeline.steps.stage`): it takes the artifacts
it reads from ``inputs`` (built on first use) and hands ``ctx.run`` a writer
``write(path) -> (summary, manifest extras)`` that fills the artifact's directory. ``run`` returns
at once on a cache hit.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lm_pipeline.steps import mixture
from lm_pipeline.steps.result import StageResult

if TYPE_CHECKING:
    from lm_pipeline.config import RunConfig
    from lm_pipeline.steps.stage import BuildContext, Inputs

log = logging.getLogger(__name__)


def data_summary(manifest: dict[str, Any]) -> str:
    """One line on what a raw_shards artifact kept and skipped, from its manifest:
    ``kept 119 of 126 records (train 113, validation 6); skipped 7: invalid_json×5, empty×2``."""
    kept: dict[str, int] = {}
    records = 0
    reasons: dict[str, int] = {}
    partial = []
    for split, rows in (manifest.get("shards") or {}).items():
        for r in rows:
            kept[split] = kept.get(split, 0) + int(r.get("valid") or 0)
            records += int(r.get("records") or 0)
            for reason, n in (r.get("skipped") or {}).items():
                reasons[reason] = reasons.get(reason, 0) + int(n)
            if r.get("damaged"):
                partial.append(str(r.get("name")))
    skipped = sum(reasons.values())
    line = f"kept {sum(kept.values())} of {records} records ({', '.join(f'{k} {v}' for k, v in kept.items())})"
    line += f"; skipped {skipped}" + (": " + ", ".join(f"{k}×{v}" for k, v in sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0])))
                                     if skipped else "")
    if partial:
        line += f"; corrupt, read up to the damage (the records before it kept): {', '.join(partial[:5])}" + (
            f" and {len(partial) - 5} more" if len(partial) > 5 else "")
    return line


def raw_shards(ctx: BuildContext, inputs: Inputs) -> StageResult:
    """Validate every shard under the configured policy; record per-shard counts (a mixture:
    each component's, :func:`lm_pipeline.steps.mixture.raw_shards`)."""
    if ctx.components():
        return mixture.raw_shards(ctx, inputs)

    def write(path: str):
        from lm_pipeline.data.sources import scan_shards

        splits: dict[str, list[dict[str, Any]]] = {}
        totals = {"records": 0, "valid": 0, "skipped": 0}
        for split, shards in ctx.shards().items():
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

    res = ctx.run(write)
    if not res.hit:
        line = data_summary(res.manifest)
        (log.warning if res.summary.get("skipped") else log.info)("raw_shards %s: %s", res.fingerprint, line)
    return res


def tokenizer(ctx: BuildContext, inputs: Inputs) -> StageResult:
    """Train the BPE on the training shards, or fetch the configured HF tokenizer."""
    inputs["raw_shards"]  # the shards validated (and their counts recorded) first

    def write(path: str):
        from lm_pipeline.data.sources import iter_shard_texts
        from lm_pipeline.data.tokenizer import build_tokenizer

        tok = ctx.cfg.data.tokenizer
        if tok.kind == "bpe":
            info = build_tokenizer(tok, path, iter_shard_texts(mixture.training_shards(ctx.shards())),
                                   progress=None if ctx.progress else False)  # a bar on a terminal only
        else:
            info = build_tokenizer(tok, path)
        return {"vocab_size": info.vocab_size, "eos_id": info.eos_id, "bos_id": info.bos_id}, {}

    return ctx.run(write)


def cache_summary(splits: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The token cache manifest's summary from per-split counts."""
    return {"splits": splits, "train_tokens": splits["train"].get("num_tokens") if "train" in splits else 0}


def ledger_counts(ledger: dict[str, Any]) -> dict[str, Any]:
    """Docs, tokens, bytes and shards committed to a token cache ledger."""
    c = ledger.get("committed", {})
    return {"num_docs": c.get("docs"), "num_tokens": c.get("tokens"), "num_bytes": c.get("bytes"),
            "num_shards": c.get("shards")}


def token_cache(ctx: BuildContext, inputs: Inputs) -> StageResult:
    """Tokenize every split into its own token cache under this artifact (in this process; the
    fan-out over shard groups is :mod:`lm_pipeline.steps.fanout`); a mixture: each component's
    (:func:`lm_pipeline.steps.mixture.token_cache`)."""
    if ctx.components():
        return mixture.token_cache(ctx, inputs)
    tok = inputs["tokenizer"]

    def write(path: str):
        from lm_pipeline.data.cache import build_cache
        from lm_pipeline.data.chat import source_chat

        data = ctx.cfg.data
        chat = source_chat(data, tok.path)  # a chat source: conversations rendered, a loss mask kept
        all_shards = ctx.shards()
        built = {}
        # The validation sets first (small): a run that trains while the cache builds
        # (data.shuffle: era) evaluates them whole, and reads the training split as it grows.
        for split in sorted(all_shards, key=lambda name: name == "train"):
            ledger = build_cache(f"{path}/{split}", all_shards[split], tok.path, num_workers=data.num_workers,
                                 shard_group_size=data.shard_group_size, progress=ctx.progress, chat=chat)
            built[split] = ledger_counts(ledger)
        return cache_summary({split: built[split] for split in all_shards}), {"tokenizer_path": tok.path,
                                                                              "built_by": "single"}

    return ctx.run(write)


def _tokenizer_files(tok_dir: str) -> dict[str, Path | bytes]:
    """The tokenizer's own files, for a checkpoint's ``tokenizer/``: never the store's manifest
    (a copied manifest.json would make a partial downstream artifact look complete). By path: the
    files themselves, or local copies of those on an object store."""
    from lm_pipeline import fs
    from lm_pipeline.store import MANIFEST

    names = sorted(name for name, is_dir in fs.listdir(tok_dir)
                   if not is_dir and name != MANIFEST and not name.startswith("."))
    return {f"tokenizer/{name}": Path(fs.local_copy(fs.join(tok_dir, name))) for name in names}


def continuation_hint(ctx: BuildContext) -> str | None:
    """When this run starts from step 0 while a run of the same config but for another number of
    steps exists in the store: how to continue that one instead (one line), else None."""

    def without_steps(conf: Any) -> Any:
        conf = json.loads(json.dumps(conf, default=str))
        for section in ("trainer",):
            if isinstance(conf.get(section), dict):
                conf[section] = {k: v for k, v in conf[section].items() if k not in ("num_train_steps", "train_tokens",
                                                                                    "num_epochs")}
        return conf

    addr = ctx.address()
    want = without_steps(addr.config)
    for m in reversed(ctx.store.complete(ctx.stage.name)):
        if m.get("fingerprint") == addr.fingerprint or m.get("inputs") != addr.inputs \
                or without_steps(m.get("config") or {}) != want:
            continue
        final = (m.get("summary") or {}).get("final_checkpoint") or m.get("run_dir")
        steps = (m.get("summary") or {}).get("final_step")
        return (f"train_ckpt: starting a new run from step 0; a run of this config trained to step {steps} is at "
                f"{m.get('run_dir')} -- to continue it instead (its weights and optimizer state, the schedule "
                f"recomputed for the new length), add --trainer.load_checkpoint_path {final}")
    return None


def train_while_caching(ctx: BuildContext, inputs: Inputs) -> bool:
    """Whether ``train_ckpt`` trains while the token cache is built in the background: with
    ``data.shuffle: era``, when the cache is not complete (and the run is not), the packing is
    ``concat`` and the run's length does not need the data's size."""
    cfg = ctx.cfg
    if cfg.data.shuffle != "era" or ctx.complete() or inputs.complete("token_cache"):
        return False
    if ctx.components():
        log.info("data.shuffle: era with a mixture: building the components' token caches before training")
        return False
    if cfg.data.chat is not None:
        log.info("data.shuffle: era with a chat source: building the token cache first (conversations are packed "
                 "whole, from the whole cache)")
        return False
    if cfg.data.packing != "concat":
        log.warning("data.shuffle: era trains while the token cache builds with data.packing: concat only "
                    "(%s rows are derived from the whole cache): building the cache first", cfg.data.packing)
        return False
    tc = cfg.trainer
    if tc.num_train_steps is None and tc.train_tokens is None and tc.num_epochs is not None:
        log.info("trainer.num_epochs needs the training data's size: building the token cache before training")
        return False
    return True


class _BackgroundCache:
    """The ``token_cache`` input built on a thread while training reads the committed prefix of
    its training split (:class:`~lm_pipeline.data.loader.GrowingCacheDataset`)."""

    def __init__(self, inputs: Inputs):
        import threading

        self.inputs = inputs
        self.result: StageResult | None = None
        self.error: BaseException | None = None
        inputs.address("token_cache")  # computed here, not concurrently on the thread
        self.thread = threading.Thread(target=self._build, name="lm-pipeline-token-cache", daemon=True)
        self.thread.start()

    def _build(self) -> None:
        try:
            self.result = self.inputs["token_cache"]
        except BaseException as e:  # reported by join(); the reader sees the thread stop
            self.error = e
            log.error("token_cache (built in the background): %s", " ".join(str(e).split()) or type(e).__name__)

    def alive(self) -> bool:
        return self.thread.is_alive()

    def join(self) -> StageResult:
        """Wait for the cache to be complete (its manifest written); raise what stopped it."""
        self.thread.join()
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result


def open_datasets(cfg: RunConfig, cache: StageResult):
    """(train dataset, {validation set: dataset}, tokenizer dir, vocab size) of a complete token
    cache, packed as ``cfg`` says. A mixture's: {component: train dataset} and its components'
    validation sets as ``<component>/<set>``."""
    from lm_pipeline.data.loader import open_dataset
    from lm_pipeline.data.tokenizer import tokenizer_info

    seq_len, packing = cfg.model.seq_len, cfg.data.packing
    splits = cache.manifest.get("summary", {}).get("splits") or {}
    if mixture.component_caches(cache) is not None:
        train, evals = mixture.open_component_datasets(cfg, cache)
    else:
        from lm_pipeline.data.chat import chat_pack

        pack = chat_pack(cfg.data)  # a chat source: how its conversations are packed (not in its cache)
        train = open_dataset(f"{cache.path}/train", seq_len, packing, chat_pack=pack)
        evals = {name: open_dataset(f"{cache.path}/{name}", seq_len, packing, chat_pack=pack)
                 for name in splits if name != "train"}
    tok_dir = cache.manifest["tokenizer_path"]
    return train, evals, tok_dir, tokenizer_info(tok_dir).vocab_size


def _datasets_while_caching(ctx: BuildContext, inputs: Inputs, builder: _BackgroundCache | None):
    """(train dataset, {validation set: dataset}, tokenizer dir, vocab size) of a token cache
    being built: the validation sets once complete (they are built first), the training split as
    it grows (``concat`` rows of its committed prefix)."""
    from lm_pipeline.data.encode import tokenizer_info as cache_tokenizer_info
    from lm_pipeline.data.loader import GrowingCacheDataset, open_dataset
    from lm_pipeline.data.tokenizer import tokenizer_info

    tok_dir = inputs["tokenizer"].path
    info = cache_tokenizer_info(tok_dir)  # what the cache's ledger records
    where = inputs.path("token_cache")
    seq_len = ctx.cfg.model.seq_len
    alive = builder.alive if builder is not None else None

    def growing(split: str) -> GrowingCacheDataset:
        return GrowingCacheDataset(f"{where}/{split}", seq_len, "concat",
                                   expected_tokenizer_fingerprint=info.fingerprint, builder_alive=alive)

    evals = {}
    for name in ctx.shards():
        if name != "train":
            growing(name).wait_complete()
            evals[name] = open_dataset(f"{where}/{name}", seq_len, "concat")
    log.info("train_ckpt: training while the token cache is built at %s (data.shuffle: era, %d rows an era)",
             where, ctx.cfg.data.era_length)
    return growing("train"), evals, tok_dir, tokenizer_info(tok_dir).vocab_size


def _training_data(ctx: BuildContext, inputs: Inputs, background: bool):
    """(train dataset, validation sets, tokenizer dir, vocab size, the background cache builder or None)."""
    from lm_pipeline.steps.pipeline import process_index

    if not background:
        return (*open_datasets(ctx.cfg, inputs["token_cache"]), None)
    builder = _BackgroundCache(inputs) if process_index(ctx.cfg) == 0 else None
    try:
        return (*_datasets_while_caching(ctx, inputs, builder), builder)
    except BaseException:
        if builder is not None and builder.error is not None:
            raise builder.error from None
        raise


def train_ckpt(ctx: BuildContext, inputs: Inputs, hooks: Sequence = ()) -> StageResult:
    """Train (resuming from the run's latest checkpoint); the manifest marks the run finished.

    With ``data.shuffle: era`` and the token cache not complete, the cache is built on a
    background thread (by process 0 of a multi-process run) while the run trains on its committed
    prefix (:func:`train_while_caching`); the batches, and so the run, are those of the complete
    cache. The run's manifest is written once the cache is complete too."""
    background = train_while_caching(ctx, inputs)
    inputs["tokenizer" if background else "token_cache"]  # before any thread: one builder of each stage

    def write(path: str):
        from lm_pipeline.hf import export_hook
        from lm_pipeline.hf.start import hf_source_config
        from lm_pipeline.train.checkpoint import latest_checkpoint
        from lm_pipeline.train.run import train
        from lm_pipeline.train.trainer import StepInfo

        train_ds, evals, tok_dir, vocab, builder = _training_data(ctx, inputs, background)
        run_dir, run_id = ctx.run_dir(), ctx.run_id()
        if latest_checkpoint(run_dir) is None and not ctx.cfg.trainer.load_checkpoint_path:
            hint = continuation_hint(ctx)
            if hint:
                log.warning("%s", hint)
        # Levanter's hf_save_steps: export every N steps, and once more at the end.
        hf_hook = export_hook(ctx.export_config, run_dir=run_dir, tokenizer_dir=tok_dir, run_id=run_id,
                              hf_source=hf_source_config(ctx.cfg) if ctx.export_config.hf_save_steps else None)
        try:
            res = train(ctx.cfg, train_data=train_ds, vocab_size=vocab, eval_data=evals,
                        eval_bytes_per_token={n: d.bytes_per_token for n, d in evals.items()},
                        run_id=run_id, run_dir=run_dir, extra_checkpoint_files=_tokenizer_files(tok_dir),
                        hooks=[*hooks, *([hf_hook] if hf_hook else [])])
        except BaseException:
            if builder is not None and builder.error is not None:  # the cause, rather than the stalled reader
                raise builder.error from None
            raise
        finally:
            if background:
                train_ds.close()  # a prefetch thread still waiting for rows stops
        if builder is not None:
            builder.join()  # the run's lineage names a complete cache
        if hf_hook and res.final_step % hf_hook.every:
            hf_hook.fn(StepInfo(res.final_step, res.state, res.metrics))
        final = latest_checkpoint(run_dir) or (res.checkpoints[-1] if res.checkpoints else None)
        summary = {"final_step": res.final_step, "final_checkpoint": final, "resumed_from": res.resumed_from,
                   **{k: v for k, v in res.metrics.items() if isinstance(v, (int, float))}}
        return summary, {"run_dir": run_dir, "run_id": run_id, "final_checkpoint": final,
                         "checkpoints": res.checkpoints, "eval_history": res.eval_history,
                         "train_seconds": res.train_seconds, "resumed_from": res.resumed_from}

    return ctx.run(write)


def eval_report(ctx: BuildContext, inputs: Inputs, checkpoint: str | None = None) -> StageResult:
    """Evaluate a checkpoint (default: the run's final one) on every validation set, with the
    unigram baseline; the report is written as Parquet + JSON under the artifact."""
    ckpt, step = inputs.checkpoint(checkpoint)
    cache = inputs["token_cache"]

    def write(path: str):
        from lm_pipeline.eval import evaluate_checkpoint, write_report

        _, evals, _, _ = open_datasets(ctx.cfg, cache)
        ev = ctx.eval_config
        t0 = time.perf_counter()
        df = evaluate_checkpoint(ckpt, evals, batch_size=ev.batch_size, max_eval_batches=ev.max_eval_batches,
                                 compute_dtype=ev.compute_dtype,
                                 train_cache=mixture.train_caches(cache) if ev.unigram_baseline else None)
        files = write_report(df, path)
        rows = json.loads(df.to_json(orient="records", double_precision=15))
        micro = next((r for r in rows if r.get("kind") == "micro"), {})
        summary = {"step": step, "checkpoint": ckpt, "eval_seconds": round(time.perf_counter() - t0, 3),
                   **{k: micro.get(k) for k in ("loss", "perplexity", "bpb", "unigram_loss", "unigram_bpb", "tokens")}}
        return summary, {"checkpoint": ckpt, "step": step, "report": files, "rows": rows}

    return ctx.run(write, step=step)


def hf_export(ctx: BuildContext, inputs: Inputs, checkpoint: str | None = None, *,
              sample_prompt: str | None = "import ", sample_tokens: int = 48) -> StageResult:
    """Export a checkpoint (default: the run's final one) as a ``transformers`` model directory
    (the artifact directory itself); a short sample of its text (temperature 0.8, top-k 40,
    seed 0: reproducible) is recorded in the manifest."""
    ckpt, step = inputs.checkpoint(checkpoint)

    def write(path: str):
        from lm_pipeline.hf import export_hf

        ex = ctx.export_config
        t0 = time.perf_counter()
        export_hf(ckpt, path, dtype=ex.dtype, max_shard_size=ex.max_shard_size, overwrite=True,
                  progress=None if ctx.progress else False)
        files = sorted(p.name for p in Path(path).iterdir() if p.is_file())  # ``path``: local (staged)
        size = sum((Path(path) / f).stat().st_size for f in files)
        summary: dict[str, Any] = {"step": step, "checkpoint": ckpt, "files": files, "bytes": size,
                                   "export_seconds": round(time.perf_counter() - t0, 3)}
        if sample_prompt is not None:
            summary.update(_sample(ckpt, sample_prompt, sample_tokens, ctx.cfg.model.seq_len))
        return summary, {"checkpoint": ckpt, "step": step}

    # export_hf writes a local directory: on an object store it is written in a local staging
    # directory and uploaded before the manifest (``ctx.run``'s ``staged``).
    return ctx.run(write, step=step, staged=True)


def _sample(ckpt: str, prompt: str, tokens: int, seq_len: int) -> dict[str, Any]:
    from lm_pipeline.generate import generate_text

    room = seq_len - len(prompt.encode("utf-8")) - 1  # tokens <= bytes (+BOS)
    out: dict[str, Any] = {"sample_prompt": prompt}
    try:
        out["sample"] = generate_text(ckpt, prompt, max(1, min(tokens, room)), temperature=0.8, top_k=40, seed=0)
    except Exception as e:  # a sample is a nicety; never fail the export for it
        log.warning("hf_export: sample generation failed: %s", e)
    return out
