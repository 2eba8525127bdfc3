"""Where an artifact came from: its chain of inputs back to the raw shards, from the manifests.

An artifact's manifest names its upstream artifacts (``inputs``: stage -> fingerprint; other
keys are sources: shard content hashes, a hub tokenizer, a checkpoint step). Following them
through the store gives its lineage, e.g. for an export::

    hf_export -> train_ckpt -> token_cache -> tokenizer -> raw_shards

:func:`resolve` turns what a user has in hand (a path anywhere inside an artifact, a fingerprint
or a unique prefix of one) into a store address; :func:`lineage` reads the chain;
:func:`format_lineage` renders it for people. Only manifests are read (no JAX, no data).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Sequence
from typing import Any

import yaml

from lm_pipeline import fs
from lm_pipeline.steps.mixture import input_stage
from lm_pipeline.steps.stages import stage_table
from lm_pipeline.store import MANIFEST, ArtifactStore, open_store

__all__ = ["MIN_PREFIX", "AmbiguousFingerprint", "IncompleteArtifact", "LineageError", "UnknownArtifact",
           "broken_links", "format_lineage", "lineage", "resolve", "to_json"]

#: The shortest fingerprint prefix :func:`resolve` accepts.
MIN_PREFIX = 6

_HEX = re.compile(r"^[0-9a-f]+$")


class LineageError(ValueError):
    """An argument that names no single complete artifact; the message says what to do."""


class UnknownArtifact(LineageError):
    """No artifact matches (the message names the store searched)."""


class AmbiguousFingerprint(LineageError):
    """A fingerprint prefix matches several artifacts (``matches``: their ``stage/fingerprint``)."""

    def __init__(self, message: str, matches: Sequence[str]):
        super().__init__(message)
        self.matches = list(matches)


class IncompleteArtifact(LineageError):
    """The artifact's directory exists but it has no manifest: being built, or its build stopped."""


# -- resolving an argument ----------------------------------------------------------------------------


def _how_to_build(stage: str) -> str:
    """What (re)builds ``stage``: the first command-line subcommand that builds it, else its asset."""
    table = stage_table()

    def upstream(name: str) -> set[str]:
        st = table.get(name)
        return set() if st is None else {u for up in st.upstream for u in (up, *upstream(up))}

    for s in table.values():
        if s.command and (s.name == stage or stage in upstream(s.name)):
            return f"`lm-pipeline {s.command[0]} --config_path <its experiment's config>`"
    return f"materialize the Dagster asset {stage}"


def _incomplete(store: ArtifactStore, stage: str, fp: str) -> IncompleteArtifact:
    path = store.locate(stage, fp).path
    return IncompleteArtifact(
        f"{path} is incomplete: it has no {MANIFEST} (it is being built now, or its build was interrupted); "
        f"wait for the build to finish, or re-run what builds it ({_how_to_build(stage)}), then ask again")


def _looks_like_path(arg: str) -> bool:
    return "/" in arg or arg in (".", "..") or fs.exists(arg)  # a URL has a "/" too


def _addresses(path: str) -> list[tuple[str, str, str]]:
    """(store root, stage, fingerprint) of every ``<root>/<stage>/<fingerprint>`` the normalized
    local path or URL ``path`` lies in or is, deepest first (any names: the caller picks)."""
    out = []
    fp_dir = path
    while (stage_dir := fs.parent(fp_dir)) != fp_dir and (root := fs.parent(stage_dir)) != stage_dir:
        out.append((root, fs.basename(stage_dir), fs.basename(fp_dir)))
        fp_dir = stage_dir
    return out


def _from_path(arg: str, store_root: str | None, stages: Sequence[str]) -> tuple[ArtifactStore, str, str]:
    path = fs.norm(arg)
    if not fs.exists(path):
        # "<stage>/<fingerprint or prefix>": an address in the given store
        raw = [p for p in arg.strip("/").split("/") if p]
        if store_root is not None and len(raw) == 2 and raw[0] in stages:
            return _from_fingerprint(raw[1], store_root, (raw[0],))
        raise UnknownArtifact(f"{arg}: no such file or directory (give a path inside an artifact, "
                              f"<store>/<stage>/<fingerprint>/..., or a fingerprint)")
    # Every "<stage>/<hex>" pair of the path, deepest first; the first with its own manifest is the
    # artifact (a checkpoint's tokenizer/tokenizer.json is no tokenizer artifact: not hex, no manifest).
    candidates = [(open_store(root), stage, fp) for root, stage, fp in _addresses(path)
                  if stage in stages and _HEX.match(fp)]
    for store, stage, fp in candidates:
        if store.manifest(stage, fp) is not None:
            return store, stage, fp
    if candidates:
        store, stage, fp = candidates[0]
        raise _incomplete(store, stage, fp)
    # A run directory outside the store (trainer.checkpointer.base_path): its train_ckpt manifest
    # in the given store records it.
    if store_root is not None and "train_ckpt" in stages:
        store = open_store(store_root)
        for m in store.complete("train_ckpt"):
            run_dir = m.get("run_dir")
            if isinstance(run_dir, str) and run_dir:
                run = fs.norm(run_dir)
                if path == run or path.startswith(run.rstrip("/") + "/"):
                    return store, "train_ckpt", m["fingerprint"]
    raise UnknownArtifact(
        f"{arg} is not inside an artifact: expected <store>/<stage>/<fingerprint>/... with a stage among "
        f"{', '.join(stages)}" + (f" (nor a run directory recorded in store {store_root})" if store_root else ""))


def _from_fingerprint(arg: str, store_root: str, stages: Sequence[str]) -> tuple[ArtifactStore, str, str]:
    key = arg.lower()
    if not _HEX.match(key) or len(key) < MIN_PREFIX:
        raise UnknownArtifact(f"{arg!r} is neither a path nor a fingerprint (hexadecimal, at least "
                              f"{MIN_PREFIX} characters)")
    store = open_store(store_root)
    matches = []
    for stage in stages:
        for name, is_dir in fs.listdir(f"{store.root}/{stage}"):
            if is_dir and not name.startswith(".") and name.startswith(key):
                matches.append((stage, name))
    if not matches:
        where = "" if fs.exists(store.root) else " (that directory does not exist)"
        raise UnknownArtifact(
            f"no artifact with fingerprint {arg} in store {store.root}{where}; searched {', '.join(stages)}. "
            "Pass the store that holds it (--store ROOT, or --config_path of its experiment), or a path "
            "inside the artifact")
    exact = [m for m in matches if m[1] == key]
    if len(matches) > 1 and len(exact) != 1:
        listed = [f"{s}/{f}" for s, f in sorted(matches)]
        raise AmbiguousFingerprint(
            f"fingerprint prefix {arg} is ambiguous in store {store.root}: it matches {', '.join(listed)}; "
            "give more characters (or <stage>/<fingerprint>)", listed)
    stage, fp = exact[0] if exact else matches[0]
    if store.manifest(stage, fp) is None:
        raise _incomplete(store, stage, fp)
    return store, stage, fp


def resolve(arg: str, store_root: str | None = None,
            stages: Sequence[str] | None = None) -> tuple[ArtifactStore, str, str]:
    """(store, stage, fingerprint) of the complete artifact that ``arg`` names.

    ``arg``: a path or URL inside an artifact (the artifact directory, a checkpoint's ``step-N``, a
    file in it; the store is the parent of ``<stage>/<fingerprint>``), a run directory outside the
    store that ``store_root``'s train_ckpt manifests record, ``<stage>/<fingerprint>`` in
    ``store_root``, or a fingerprint or unique prefix of at least :data:`MIN_PREFIX` hex digits,
    searched in every stage directory of ``store_root``. Raises :class:`LineageError` (unknown,
    ambiguous, incomplete) with a message that says what to do.
    """
    stages = tuple(stage_table()) if stages is None else stages
    arg = arg.strip()
    if not arg:
        raise UnknownArtifact("no artifact given: pass a path inside an artifact or a fingerprint")
    if _looks_like_path(arg):
        return _from_path(arg, store_root, stages)
    if store_root is None:
        raise UnknownArtifact(f"{arg}: a fingerprint needs the store to search (--store ROOT or --config_path)")
    return _from_fingerprint(arg, store_root, stages)


# -- the chain ------------------------------------------------------------------------------------------


def _shards(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """The raw shards a raw_shards manifest records: split, name, url, fingerprint, counts. A shard's
    fingerprint is its content's identity (:func:`lm_pipeline.data.sources.shard.shard_fingerprint`: a
    hash over its bytes' sha256 and the reader's settings), not the file's sha256sum."""
    out = []
    recorded = manifest.get("shards")
    if isinstance(recorded, dict):
        for split, rows in recorded.items():
            for r in rows if isinstance(rows, list) else []:
                if isinstance(r, dict):
                    out.append({"split": split, "name": r.get("name") or r.get("shard"), "url": r.get("url"),
                                "fingerprint": r.get("fingerprint"), "records": r.get("records"), "valid": r.get("valid")})
    if not out:  # older manifests: the content hashes are the inputs "<split>/<name>"
        for key, value in (manifest.get("inputs") or {}).items():
            if "/" in key and isinstance(value, str):
                split, name = key.split("/", 1)
                out.append({"split": split, "name": name, "url": None, "fingerprint": value, "records": None,
                            "valid": None})
    return out


def _step(store: ArtifactStore, stage: str, fp: str, stages: Sequence[str]) -> dict[str, Any]:
    art = store.locate(stage, fp)
    m = store.manifest(stage, fp)
    step: dict[str, Any] = {"stage": stage, "fingerprint": fp, "path": art.path}
    if m is None:
        step["status"] = "incomplete" if fs.exists(art.path) else "missing"
        return step
    inputs = m.get("inputs") or {}
    step.update({"status": "complete", "created": m.get("created"), "code_version": m.get("code_version"),
                 "config": m.get("config"), "inputs": inputs,
                 "upstream": {k: v for k, v in inputs.items() if input_stage(k, stages) and isinstance(v, str)},
                 "summary": m.get("summary") or {}})
    for key in ("checkpoint", "step", "run_dir", "tokenizer_path"):
        if key in m:
            step[key] = m[key]
    if stage == "raw_shards":
        step["shards"] = _shards(m)
    return step


def _upstream(step: dict[str, Any], stages: Sequence[str]) -> list[tuple[str, str]]:
    """(stage, fingerprint) of each artifact a step read (a mixture's components: their token caches)."""
    return [(input_stage(k, stages), v) for k, v in step.get("upstream", {}).items()]


def lineage(store: ArtifactStore | str, stage: str, fingerprint: str,
            stages: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """The artifact and every artifact it was made from, each after all that read it.

    Each step: ``stage``, ``fingerprint``, ``path``, ``status`` (``complete``; ``missing``: not in
    the store; ``incomplete``: no manifest), ``read_by`` (``stage/fingerprint`` of the steps that
    list it as an input; empty for the first), and for complete ones ``created``,
    ``code_version``, ``config``, ``inputs`` (the manifest's, sources included), ``upstream``
    (the inputs that are artifacts: stage -> fingerprint), ``summary``, the manifest's
    ``checkpoint``/``step``/``run_dir``/``tokenizer_path`` where it has them, and for raw_shards
    ``shards`` (split, name, url, fingerprint, records, valid). A missing or incomplete step has no
    upstream: the chain stops there. Order: the artifact first; a step comes after every step
    that reads it, later stages (in ``stages`` order) first among those ready together:
    ``hf_export, train_ckpt, token_cache, tokenizer, raw_shards``.
    """
    stages = tuple(stage_table()) if stages is None else stages
    store = open_store(store)
    found: dict[tuple[str, str], dict[str, Any]] = {}
    readers: dict[tuple[str, str], list[tuple[str, str]]] = {}
    todo = [(stage, fingerprint)]
    while todo:
        key = todo.pop()
        if key in found:
            continue
        step = found[key] = _step(store, *key, stages)
        for up in _upstream(step, stages):
            readers.setdefault(up, []).append(key)
            todo.append(up)
    rank = {name: i for i, name in enumerate(stages)}
    waiting = {key: len(readers.get(key, [])) for key in found}
    ready = [(stage, fingerprint)]
    order: list[tuple[str, str]] = []
    while ready:
        ready.sort(key=lambda k: (rank.get(k[0], -1), k[1]))
        key = ready.pop()  # the latest stage first
        order.append(key)
        for up in _upstream(found[key], stages):
            waiting[up] -= 1
            if waiting[up] == 0:
                ready.append(up)
    out = []
    for key in order:
        step = found[key]
        step["read_by"] = [f"{s}/{f}" for s, f in readers.get(key, [])]
        out.append(step)
    return out


def broken_links(steps: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The steps of a lineage that are not complete artifacts (missing or incomplete)."""
    return [s for s in steps if s.get("status") != "complete"]


# -- text ---------------------------------------------------------------------------------------------


def _scalar(value: Any) -> str:
    """A value as YAML flow text (what ``--section.field VALUE`` reads back)."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    text = yaml.safe_dump(value, default_flow_style=True, width=math.inf, allow_unicode=True).strip()
    return text.removesuffix("\n...").removesuffix("...").strip()


def _flatten(value: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(value, dict) and value:
        out = []
        for k, v in value.items():
            out.extend(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return [(prefix, value)]


def _short(value: Any, limit: int = 80) -> str:
    text = f"{value:.6g}" if isinstance(value, float) and math.isfinite(value) else _scalar(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def format_lineage(steps: Sequence[dict[str, Any]]) -> str:
    """The lineage as text: per step its stage, fingerprint, created time, path, inputs, config
    (one ``dotted.key: value`` line per field), a summary line, and the shard files of raw_shards."""
    lines: list[str] = []
    for i, s in enumerate(steps):
        if i:
            lines.append("")
        status = s.get("status")
        head = f"{s['stage']} {s['fingerprint']}"
        if status == "complete":
            lines.append(f"{head}  created {s.get('created')}")
        else:
            why = ("MISSING: not in the store" if status == "missing"
                   else f"MISSING: incomplete, no {MANIFEST} (being built, or its build was interrupted)")
            lines.append(f"{head}  {why}")
        lines.append(f"  path: {s['path']}")
        if s.get("read_by"):
            lines.append(f"  read by: {', '.join(s['read_by'])}")
        if status != "complete":
            continue
        ups = [f"{k} {v}" for k, v in s.get("upstream", {}).items()]
        if "step" in s.get("inputs", {}):
            ups.append(f"checkpoint step {s['inputs']['step']}")
        if ups:
            lines.append(f"  inputs: {', '.join(ups)}")
        sources = {k: v for k, v in s.get("inputs", {}).items()
                   if k not in s.get("upstream", {}) and k != "step" and not (s["stage"] == "raw_shards" and s.get("shards"))}
        for k, v in sources.items():
            lines.append(f"  source: {k} {v}")
        for key in ("checkpoint", "run_dir"):
            if s.get(key):
                lines.append(f"  {key.replace('_', ' ')}: {s[key]}")
        lines.append(f"  code version: {s.get('code_version')}")
        config = _flatten(s.get("config"))
        if config == [("", {})] or config == [("", None)]:
            lines.append("  config: {}")
        else:
            lines.append("  config:")
            lines.extend(f"    {k}: {_scalar(v)}" if k else f"    {_scalar(v)}" for k, v in config)
        summary = [f"{k}={_short(v, 40)}" for k, v in (s.get("summary") or {}).items()
                   if isinstance(v, (int, float, str, bool)) or v is None]
        if summary:
            lines.append(f"  summary: {' '.join(summary)}")
        if s.get("shards"):
            lines.append(f"  shards ({len(s['shards'])}):")
            for sh in s["shards"]:
                count = f"  {sh['records']} records" if sh.get("records") is not None else ""
                lines.append(f"    {sh['split']}  {sh['name']}  fingerprint {sh['fingerprint']}{count}")
    return "\n".join(lines)


def to_json(steps: Sequence[dict[str, Any]]) -> str:
    """The lineage as JSON (what ``lm-pipeline lineage --json`` prints)."""
    return json.dumps(list(steps), indent=2, default=str)
