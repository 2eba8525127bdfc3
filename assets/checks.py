"""Asset checks: every artifact a later stage reads is checked after it is materialized.

One check per artifact, on every experiment's asset (the results, measured values included, are
the check's metadata in the UI):

* ``token_cache`` / ``token_ids_and_counts`` (blocking): every token id is below the vocabulary
  size, each split's arrays hold exactly the documents, tokens and bytes its ledger commits, the
  ledger's shards add up to its totals, every shard has as many documents as ``raw_shards``
  kept valid records, and the materialization reports the ledger's counts. A cache that fails
  never reaches a training run;
* ``train_ckpt`` / ``final_loss`` (blocking): the run's final training loss is finite (else an
  error: a diverged run is not evaluated nor exported) and below the unigram baseline of its
  training tokens (else a warning: the run learnt less than token frequencies);
* ``eval_report`` / ``bpb_vs_unigram``: the evaluation's bits per byte is finite (else an error)
  and below the unigram baseline's on the same tokens (else a warning);
* ``hf_export`` / ``loads_in_transformers``: the export loads with ``transformers`` and its
  logits equal those of the checkpoint it was made from, within 1e-4 (relative to the largest
  logit, at least 1).

Each check reads the artifact of its asset's latest materialization (its data version is the
artifact's fingerprint). The checks themselves are plain functions of the artifact
(:func:`token_cache_outcome`, ...), so they can be run on any artifact of the store.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import dagster as dg
import numpy as np

from assets.deployment import Deployment, Node
from resources import ArtifactStoreResource

#: Logits of an export may differ from its checkpoint's by this much, relative to max(1, max |logit|).
LOGITS_TOLERANCE = 1e-4
#: At most this many training tokens are counted for the unigram baseline of a run.
UNIGRAM_TOKENS = 1 << 24
_CHUNK = 1 << 22

ERROR, WARN = dg.AssetCheckSeverity.ERROR, dg.AssetCheckSeverity.WARN


@dataclass
class Outcome:
    """What a check found: passed or not, how bad, why (one line), and what it measured."""

    passed: bool
    description: str
    severity: dg.AssetCheckSeverity = ERROR
    metadata: dict[str, Any] = field(default_factory=dict)

    def result(self) -> dg.AssetCheckResult:
        return dg.AssetCheckResult(passed=self.passed, severity=self.severity, description=self.description,
                                   metadata=_metadata(self.metadata))


def _metadata(values: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in values.items():
        if isinstance(v, bool):
            out[k] = dg.MetadataValue.bool(v)
        elif isinstance(v, int):
            out[k] = dg.MetadataValue.int(v)
        elif isinstance(v, float):
            out[k] = dg.MetadataValue.float(v) if math.isfinite(v) else dg.MetadataValue.text(str(v))
        elif isinstance(v, (dict, list)):
            out[k] = dg.MetadataValue.json(v)
        elif v is not None:
            out[k] = dg.MetadataValue.text(str(v))
    return out


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))


# ------------------------------------------------------------------ token_cache


def token_cache_outcome(path: str, manifest: Mapping[str, Any], raw_manifest: Mapping[str, Any] | None = None) -> Outcome:
    """Check the token cache at ``path`` (its ``manifest``; ``raw_manifest``: the raw shards it was
    built from, whose valid records each shard's documents must equal)."""
    from lm_pipeline.data.cache import open_cache
    from lm_pipeline.data.cache.storage import CacheRoot, open_array

    problems: list[str] = []
    measured: dict[str, Any] = {}
    summary = (manifest.get("summary") or {}).get("splits") or {}
    raw_valid = {s["name"]: int(s["valid"]) for shards in ((raw_manifest or {}).get("shards") or {}).values()
                 for s in shards if "name" in s and "valid" in s}
    vocab = None
    for split in sorted(summary):
        try:
            cache = open_cache(f"{path}/{split}")
        except Exception as e:
            problems.append(f"{split}: {e}")
            continue
        vocab = int(cache.settings["vocab_size"])
        docs, tokens, nbytes = cache.num_docs, cache.num_tokens, cache.num_bytes
        root = CacheRoot(cache.location)
        stored = {name: int(open_array(root, name).shape[0]) for name in ("tokens", "doc_offsets", "doc_bytes")}
        offsets = cache.doc_offsets
        top = 0
        for start in range(0, tokens, _CHUNK):
            chunk = cache.read_tokens(start, min(start + _CHUNK, tokens))
            if len(chunk):
                top = max(top, int(chunk.max()))
        measured[split] = {"docs": docs, "tokens": tokens, "bytes": nbytes, "max_token_id": top,
                           "vocab_size": vocab, "stored_rows": stored}
        if tokens and top >= vocab:
            problems.append(f"{split}: token id {top} is not below the vocabulary size {vocab}")
        if stored["tokens"] < tokens or stored["doc_offsets"] < docs + 1 or stored["doc_bytes"] < docs:
            problems.append(f"{split}: the arrays hold fewer rows than the ledger commits ({stored} for "
                            f"{docs} docs, {tokens} tokens)")
        elif len(offsets) != docs + 1 or int(offsets[0]) != 0 or int(offsets[-1]) != tokens or np.any(np.diff(offsets) < 0):
            problems.append(f"{split}: the document offsets do not cover the ledger's {tokens} tokens in {docs} documents")
        elif int(cache.doc_bytes.sum()) != nbytes:
            problems.append(f"{split}: the documents hold {int(cache.doc_bytes.sum())} bytes, the ledger {nbytes}")
        per_shard = cache.shards
        sums = {k: sum(int(s[k]) for s in per_shard) for k in ("docs", "tokens", "bytes")}
        if sums != {"docs": docs, "tokens": tokens, "bytes": nbytes}:
            problems.append(f"{split}: the ledger's shards add up to {sums}, its totals are "
                            f"{ {'docs': docs, 'tokens': tokens, 'bytes': nbytes} }")
        for s in per_shard:
            want = raw_valid.get(s["name"])
            if want is not None and int(s["docs"]) != want:
                problems.append(f"{split}: shard {s['name']} has {s['docs']} documents, raw_shards kept {want} records")
        reported = summary.get(split) or {}
        got = {"num_docs": docs, "num_tokens": tokens, "num_bytes": nbytes}
        if {k: reported.get(k) for k in got} != got:
            problems.append(f"{split}: the materialization reports {({k: reported.get(k) for k in got})}, the ledger {got}")
    if not summary:
        problems.append("the manifest lists no split")
    if problems:
        return Outcome(False, "; ".join(problems[:5]), ERROR, {"splits": measured, "problems": problems})
    return Outcome(True, f"every token id below {vocab}; every split's counts equal its ledger", ERROR,
                   {"splits": measured})


# ------------------------------------------------------------------ train_ckpt


def unigram_loss(train_cache: str | list[str], limit: int = UNIGRAM_TOKENS) -> tuple[float, int]:
    """The loss (nats per token) of the add-one smoothed unigram model of a training cache (or of
    a mixture's component caches together) on its own tokens (at most ``limit`` of each, from the
    start), and how many tokens it counted: the baseline a training run's loss must beat
    (:mod:`lm_pipeline.eval.unigram`'s model)."""
    from lm_pipeline.data.cache import open_cache

    caches = [open_cache(c) for c in (train_cache if isinstance(train_cache, list) else [train_cache])]
    vocab = int(caches[0].settings["vocab_size"])
    counts = np.zeros(vocab, np.int64)
    n = 0
    for cache in caches:
        size = min(cache.num_tokens, limit)
        n += size
        for start in range(0, size, _CHUNK):
            toks = cache.read_tokens(start, min(start + _CHUNK, size)).astype(np.int64)
            counts += np.bincount(np.minimum(toks, vocab - 1), minlength=vocab)[:vocab]
    logp = np.log(counts + 1.0) - math.log(n + vocab)
    return float(-(counts * logp).sum() / max(n, 1)), int(n)


def mixture_index_outcome(store, manifest: Mapping[str, Any]) -> Outcome:
    """A mixture's ``token_cache`` index: every component's cache it names is complete (each is
    checked on its own asset)."""
    comps = manifest.get("components") or {}
    missing = [n for n, c in comps.items() if store.manifest("token_cache", c["fingerprint"]) is None]
    if missing or not comps:
        return Outcome(False, f"the mixture's component caches {missing} are not complete", ERROR, {"components": comps})
    return Outcome(True, f"the {len(comps)} component caches are complete (each checked on its own asset)", ERROR,
                   {"components": comps})


def _train_caches(path: str, manifest: Mapping[str, Any]) -> str | list[str]:
    comps = manifest.get("components")
    return f"{path}/train" if not comps else [f"{c['path']}/train" for c in comps.values()]


def train_ckpt_outcome(manifest: Mapping[str, Any], train_cache: str | list[str] | None) -> Outcome:
    """Check a training run (its ``manifest``) against the unigram baseline of ``train_cache``."""
    s = manifest.get("summary") or {}
    loss = s.get("train/loss")
    meta: dict[str, Any] = {"final_step": s.get("final_step"), "final_loss": loss, "eval_loss": s.get("eval/loss")}
    if not _finite(loss):
        return Outcome(False, f"the final training loss is {loss} (not finite): the run diverged", ERROR, meta)
    if train_cache is None:
        return Outcome(False, "no training cache to compute the unigram baseline from", WARN, meta)
    baseline, counted = unigram_loss(train_cache)
    meta.update(unigram_loss=baseline, unigram_tokens=counted, loss_vs_unigram=float(loss) / baseline)
    if float(loss) >= baseline:
        return Outcome(False, f"final training loss {float(loss):.4f} is not below the unigram baseline "
                              f"{baseline:.4f} of its training tokens", WARN, meta)
    return Outcome(True, f"final training loss {float(loss):.4f} < unigram baseline {baseline:.4f}", ERROR, meta)


# ------------------------------------------------------------------ eval_report


def eval_report_outcome(manifest: Mapping[str, Any]) -> Outcome:
    """Check an evaluation report: its bits per byte against the unigram baseline's."""
    rows = manifest.get("rows") or []
    micro = next((r for r in rows if r.get("kind") == "micro"), manifest.get("summary") or {})
    bpb, uni = micro.get("bpb"), micro.get("unigram_bpb")
    meta = {"bpb": bpb, "unigram_bpb": uni, "loss": micro.get("loss"), "unigram_loss": micro.get("unigram_loss"),
            "step": micro.get("step")}
    if not _finite(bpb):
        return Outcome(False, f"bits per byte is {bpb} (not finite)", ERROR, meta)
    if not _finite(uni):
        return Outcome(True, "no unigram baseline in the report (eval.unigram_baseline is off): bpb not compared",
                       WARN, meta)
    meta["bpb_vs_unigram"] = float(bpb) / float(uni)
    if float(bpb) >= float(uni):
        return Outcome(False, f"bits per byte {float(bpb):.4f} is not below the unigram baseline's {float(uni):.4f}",
                       WARN, meta)
    return Outcome(True, f"bits per byte {float(bpb):.4f} < unigram baseline {float(uni):.4f}", ERROR, meta)


# ------------------------------------------------------------------ hf_export


def export_logits(path: str, ids: np.ndarray) -> np.ndarray:
    """The logits of the ``transformers`` model at ``path`` for token ids ``ids`` [B, T], float32."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor(ids, dtype=torch.long)).logits.float().numpy()


def model_logits(model, ids: np.ndarray, dtype: str | None = None) -> np.ndarray:
    """The logits of a JAX model for ``ids``, in float32 with its weights rounded to ``dtype`` first
    (the export's dtype), at the highest matmul precision."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    from lm_pipeline.train.trainer import cast_floating

    if dtype in ("bfloat16", "float16"):
        model = cast_floating(model, jnp.dtype(dtype))
    model = cast_floating(model, jnp.float32)
    with jax.default_matmul_precision("highest"):
        return np.asarray(eqx.filter_jit(lambda m, x: m(x))(model, jnp.asarray(ids, jnp.int32)), np.float32)


def hf_export_outcome(path: str, checkpoint: str | None, *, model=None, tokens: int = 16) -> Outcome:
    """Load the export at ``path`` with ``transformers`` and compare its logits with those of the
    checkpoint it was made from (or ``model``, a JAX model) on fixed random token ids (an export on
    an object store is read from a local copy)."""
    import json
    import os

    from lm_pipeline import fs

    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return Outcome(False, "torch and transformers are not installed (the 'hf' extra): the export is not checked",
                       WARN)
    try:
        local = fs.local_copy(path)
        with open(os.path.join(local, "config.json"), encoding="utf-8") as f:
            hf_cfg = json.load(f)
        vocab = int(hf_cfg["vocab_size"])
        seq = int(hf_cfg.get("n_positions") or hf_cfg.get("max_position_embeddings") or tokens)
        ids = np.random.default_rng(0).integers(0, vocab, (2, min(tokens, seq)), dtype=np.int64)
        theirs = export_logits(local, ids)
    except Exception as e:
        return Outcome(False, f"the export does not load in transformers: {type(e).__name__}: {str(e).splitlines()[0]}",
                       ERROR, {"path": path})
    if model is None:
        if checkpoint is None:
            return Outcome(False, "the export's manifest names no checkpoint to compare with", ERROR, {"path": path})
        from lm_pipeline.eval.loading import load_model_from_checkpoint

        model = load_model_from_checkpoint(checkpoint).model
    ours = model_logits(model, ids, hf_cfg.get("dtype") or hf_cfg.get("torch_dtype"))[..., :vocab]
    if ours.shape != theirs.shape:
        return Outcome(False, f"logits of shape {theirs.shape} in transformers, {ours.shape} from the checkpoint", ERROR,
                       {"path": path, "checkpoint": checkpoint})
    diff = float(np.abs(ours - theirs).max())
    scale = max(1.0, float(np.abs(theirs).max()))
    meta = {"path": path, "checkpoint": checkpoint, "max_abs_logit_diff": diff, "max_abs_logit": scale,
            "relative_diff": diff / scale, "tolerance": LOGITS_TOLERANCE, "token_ids": list(ids.shape),
            "model_type": hf_cfg.get("model_type")}
    if not math.isfinite(diff) or diff / scale > LOGITS_TOLERANCE:
        return Outcome(False, f"logits differ from the checkpoint's by {diff:.3g} (relative {diff / scale:.3g} > "
                              f"{LOGITS_TOLERANCE:g})", ERROR, meta)
    return Outcome(True, f"loads in transformers; logits within {diff / scale:.2g} of the checkpoint's "
                         f"(tolerance {LOGITS_TOLERANCE:g})", ERROR, meta)


# ------------------------------------------------------------------ the Dagster checks


def _artifact(context, store, key: dg.AssetKey, stage: str) -> tuple[str, str, dict[str, Any]] | Outcome:
    """(fingerprint, path, manifest) of the artifact of ``key``'s latest materialization."""
    event = context.instance.get_latest_materialization_event(key)
    m = event.asset_materialization if event is not None else None
    fp = (m.tags or {}).get("dagster/data_version") if m is not None else None
    if fp is None:
        return Outcome(False, f"{key.to_user_string()} has no materialization to check", ERROR)
    manifest = store.manifest(stage, fp)
    if manifest is None:
        return Outcome(False, f"{stage} {fp} (the latest materialization) is not complete in the store", ERROR,
                       {"fingerprint": fp})
    return fp, store.locate(stage, fp).path, manifest


def _upstream(store, manifest: Mapping[str, Any], stage: str) -> tuple[str, dict[str, Any]] | None:
    fp = (manifest.get("inputs") or {}).get(stage)
    up = store.manifest(stage, fp) if fp else None
    return (store.locate(stage, fp).path, up) if up is not None else None


CHECKS = {
    "token_cache": ("token_ids_and_counts", True,
                    "Every token id below the vocabulary size; each split's arrays, ledger, shards and reported "
                    "counts agree, and each shard has as many documents as raw_shards kept records. Blocking."),
    "train_ckpt": ("final_loss", True,
                   "The final training loss is finite (else an error, blocking evaluation and export) and below the "
                   "unigram baseline of the training tokens (else a warning)."),
    "eval_report": ("bpb_vs_unigram", False,
                    "Bits per byte finite (else an error) and below the unigram baseline's (else a warning)."),
    "hf_export": ("loads_in_transformers", False,
                  f"The export loads in transformers and its logits match the checkpoint's within {LOGITS_TOLERANCE:g}."),
}


def _check(node: Node):
    name, blocking, description = CHECKS[node.stage]

    @dg.asset_check(asset=node.key, name=name, blocking=blocking, description=description)
    def _run(context, store: ArtifactStoreResource) -> dg.AssetCheckResult:
        artifacts = store.store()
        found = _artifact(context, artifacts, node.key, node.stage)
        if isinstance(found, Outcome):
            return found.result()
        fp, path, manifest = found
        if node.stage == "token_cache" and manifest.get("components"):  # a mixture's index
            outcome = mixture_index_outcome(artifacts, manifest)
        elif node.stage == "token_cache":
            raw = _upstream(artifacts, manifest, "raw_shards")
            outcome = token_cache_outcome(path, manifest, raw[1] if raw else None)
        elif node.stage == "train_ckpt":
            cache = _upstream(artifacts, manifest, "token_cache")
            outcome = train_ckpt_outcome(manifest, _train_caches(*cache) if cache else None)
        elif node.stage == "eval_report":
            outcome = eval_report_outcome(manifest)
        else:
            outcome = hf_export_outcome(path, manifest.get("checkpoint") or (manifest.get("summary") or {}).get("checkpoint"))
        outcome.metadata.setdefault("fingerprint", fp)
        context.log.info(f"{node.key.to_user_string()} {fp}: {name} {'passed' if outcome.passed else 'failed'}: "
                         f"{outcome.description}")
        return outcome.result()

    return _run


def asset_checks(dep: Deployment) -> list:
    """The checks of every experiment's token cache, training run, evaluation report and export."""
    return [_check(node) for node in dep.nodes() if node.stage in CHECKS]
