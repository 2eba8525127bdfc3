"""The token cache fanned out over shard groups: groups built anywhere, in any order, then one commit.

:func:`groups` splits every split's shards into groups of ``data.shard_group_size``;
:func:`build_part` tokenizes one group into its own part cache (idempotent, safe to run
concurrently); :func:`commit` merges the parts into the ``token_cache`` artifact (building any
missing part) and removes them. The result is byte-identical to the single-process build.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lm_pipeline import fs
from lm_pipeline.steps.builders import cache_summary, ledger_counts
from lm_pipeline.steps.result import StageResult
from lm_pipeline.store import Artifact

if TYPE_CHECKING:
    from lm_pipeline.steps.pipeline import Pipeline


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


def groups(pipe: Pipeline) -> list[CacheGroup]:
    """The shard groups of every split (``data.shard_group_size`` consecutive shards each)."""
    size = pipe.cfg.data.shard_group_size
    out = []
    for split, shards in pipe.shards().items():
        for i in range(0, max(len(shards), 1), size):
            out.append(CacheGroup(split, i // size, tuple(s.name for s in shards[i : i + size])))
    return out


def _parts_root(pipe: Pipeline) -> str:
    return f"{pipe.store.stage_dir('token_cache')}/.parts-{pipe.address('token_cache').fingerprint}"


def _group_shards(pipe: Pipeline, group: CacheGroup) -> list:
    by_name = {s.name: s for s in pipe.shards()[group.split]}
    missing = [n for n in group.shards if n not in by_name]
    if missing:
        raise ValueError(f"token cache group {group.key}: unknown shards {missing[:3]} (the data changed?)")
    return [by_name[n] for n in group.shards]


def build_part(pipe: Pipeline, group: CacheGroup) -> dict[str, Any]:
    """Tokenize one group into its own part cache: ``{group, path, counts..., seconds}``."""
    from lm_pipeline.data.cache import build_cache

    tok = pipe.tokenizer()
    fp = pipe.address("token_cache").fingerprint
    part_dir = f"{_parts_root(pipe)}/{group.split}/{group.index:05d}"
    shards = _group_shards(pipe, group)
    t0 = time.perf_counter()
    with pipe.store.lock(Artifact("token_cache", f"{fp}-part-{group.key}", part_dir)):
        from lm_pipeline.data.chat import source_chat

        ledger = build_cache(part_dir, shards, tok.path, num_workers=1, shard_group_size=max(len(shards), 1),
                             progress=False, overwrite=True, chat=source_chat(pipe.cfg.data, tok.path))
    return {"group": group.key, "path": part_dir, **ledger_counts(ledger), "seconds": round(time.perf_counter() - t0, 3)}


def commit(pipe: Pipeline, built: Sequence[Mapping[str, Any]] = ()) -> StageResult:
    """Assemble the token cache from the groups' parts (building any part that is missing) and
    commit it; the parts are removed afterwards. A complete cache is a hit. ``built``: the parts
    already built in this run (counted in the manifest)."""
    from lm_pipeline.data.cache import merge_cache_parts

    tok = pipe.tokenizer()

    def write(path: str):
        splits = {}
        all_groups = groups(pipe)
        for split in pipe.shards():
            parts = []
            for group in (g for g in all_groups if g.split == split):
                info = build_part(pipe, group)  # a hit on the part's ledger if already built
                parts.append((_group_shards(pipe, group), info["path"]))
            from lm_pipeline.data.chat import source_chat

            chat = source_chat(pipe.cfg.data, tok.path)
            splits[split] = ledger_counts(merge_cache_parts(f"{path}/{split}", parts, tok.path, chat=chat))
        return cache_summary(splits), {"tokenizer_path": tok.path, "built_by": "fan-out",
                                       "groups": len(all_groups), "parts_built": len(built)}

    res = pipe.run("token_cache", write)
    with contextlib.suppress(OSError):  # best effort: leftover parts cost space, never correctness
        fs.rmtree(_parts_root(pipe))
    return res
