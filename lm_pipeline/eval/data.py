"""The token caches an evaluation reads: the pipeline's own where they fit, the rest built once.

``lm-pipeline eval`` scores a checkpoint on the config's validation sets, tokenized with the
checkpoint's tokenizer. What a set's token cache holds depends only on the set's shards (their
names and fingerprints, in order: the ledger's shard plan, see
:func:`lm_pipeline.data.cache.ledger.shard_plan`) and on the tokenizer (the sha256 of its
``tokenizer.json`` and the tokenization settings it implies). Both are recorded in every cache's
ledger, so a cache fits when its ledger says so (:func:`~lm_pipeline.data.cache.ledger.incompatibility`),
whichever artifact holds it. For each set, in order:

1. the config's token cache (``token_cache/<fingerprint>/``, the one the pipeline trains on): a
   checkpoint trained with this config has its tokenizer, so every set is found there;
2. an evaluation cache built before: ``<store.root>/eval_cache/<fingerprint>/cache``, addressed
   by the shard plan and the tokenizer (so a second evaluation is a cache hit);
3. any other complete token cache of the store (another experiment's, or one built for this
   tokenizer with ``lm-pipeline cache``);
4. else the set is tokenized now into a new evaluation cache (2.). Only validation sets are:
   the training data is never tokenized for an evaluation.

The unigram baseline counts the training split's tokens: it is taken from a token cache of the
training shards with the checkpoint's tokenizer (1. or 3.) and left out, with a warning saying
how to get one, when there is none.

The tokenizer is read the way the pipeline's ``tokenizer`` stage brings in a given one
(:func:`lm_pipeline.data.tokenizer.load_hf_tokenizer`, into a temporary directory), so its
settings are those a token cache built for it records.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lm_pipeline.config import RunConfig
    from lm_pipeline.data.chat import ChatSettings
    from lm_pipeline.data.encode import Shard, TokenizerInfo
    from lm_pipeline.data.loader import CacheDataset
    from lm_pipeline.steps import Pipeline

__all__ = ["EVAL_CACHE_STAGE", "EvalData", "eval_cache_fingerprint", "eval_datasets"]

log = logging.getLogger(__name__)

#: The store directory of evaluation caches: ``<store.root>/eval_cache/<fingerprint>/``.
EVAL_CACHE_STAGE = "eval_cache"
#: Bumped by hand when what an evaluation cache holds changes.
EVAL_CACHE_VERSION = 1
#: The token cache inside an evaluation cache's directory (beside its ``manifest.json``).
CACHE_SUBDIR = "cache"


@dataclass(frozen=True)
class EvalData:
    """What :func:`eval_datasets` found or built.

    ``datasets``: ``{validation set: dataset}``; ``locations``: each set's token cache;
    ``built``: the sets tokenized by this call; ``train_cache``: the training split's token cache
    for the unigram baseline (None: not asked for, or none with this tokenizer).
    """

    datasets: dict[str, CacheDataset]
    locations: dict[str, str]
    built: tuple[str, ...] = ()
    train_cache: str | None = None
    tokenizer_fingerprint: str = ""
    reused: dict[str, str] = field(default_factory=dict)  # set -> what held it ("token_cache <fp>", ...)


def eval_cache_fingerprint(info: TokenizerInfo, plan: Mapping[str, Any], chat: ChatSettings | None = None) -> str:
    """The address of a validation set's evaluation cache: its shard plan and the tokenizer; for
    a chat source also its chat settings (the ledger's ``settings.chat``: template, mask, ...)."""
    from lm_pipeline.data.cache import FORMAT_VERSION
    from lm_pipeline.fingerprint import fingerprint

    conf = {"shards": dict(plan), "tokenizer": info.fingerprint, "settings": info.settings(),
            "cache_format": FORMAT_VERSION}
    if chat is not None:  # a text set's address stays what it was
        conf["chat"] = chat.ledger()
    return fingerprint(EVAL_CACHE_STAGE, conf, EVAL_CACHE_VERSION, {})


def split_chat(cfg: RunConfig, split: str, tokenizer_dir: str) -> ChatSettings | None:
    """The chat settings of the source a split comes from (a mixture's ``<component>/<split>``:
    that component's), with the tokenizer at ``tokenizer_dir``; None for a text source."""
    from lm_pipeline.data.chat import source_chat
    from lm_pipeline.steps.mixture import component_config, is_mixture

    data = cfg.data
    if is_mixture(cfg) and "/" in split:
        data = component_config(cfg, split.split("/", 1)[0]).data
    return source_chat(data, tokenizer_dir)


@contextlib.contextmanager
def normalized_tokenizer(tokenizer_dir: str) -> Iterator[str]:
    """``tokenizer_dir`` brought in as the pipeline's ``tokenizer`` stage brings in a given
    tokenizer (``tokenizer.json`` byte for byte, its special tokens in ``tokenizer_config.json``),
    in a temporary directory that lives as long as the context."""
    from lm_pipeline.data.tokenizer import load_hf_tokenizer

    with tempfile.TemporaryDirectory(prefix="lm_pipeline_eval_tok_") as tmp:
        load_hf_tokenizer(tokenizer_dir, tmp)
        yield tmp


class _Finder:
    """Complete token caches that fit a shard plan with this tokenizer (see the module docstring)."""

    def __init__(self, pipe: Pipeline, info: TokenizerInfo):
        self.pipe = pipe
        self.info = info
        self._own: list[tuple[str, str]] | None = None
        self._others: list[tuple[str, str]] | None = None
        self._ledgers: dict[str, Mapping[str, Any] | None] = {}  # location -> ledger of a complete cache

    def _splits(self, fp: str, manifest: Mapping[str, Any]) -> list[tuple[str, str]]:
        path = self.pipe.store.locate("token_cache", fp).path
        names = (manifest.get("summary") or {}).get("splits") or {}
        return [(f"{path}/{name}", f"token_cache {fp} ({name})") for name in names]

    def own(self) -> list[tuple[str, str]]:
        """(split location, label) of the config's own token cache, when complete."""
        if self._own is None:
            res = self.pipe.cached("token_cache")
            self._own = [] if res is None else self._splits(res.fingerprint, res.manifest)
        return self._own

    def others(self) -> list[tuple[str, str]]:
        """(split location, label) of every other complete token cache of the store, newest first."""
        if self._others is None:
            own = {loc for loc, _ in self.own()}
            self._others = [s for m in reversed(self.pipe.store.complete("token_cache"))
                            for s in self._splits(str(m.get("fingerprint")), m) if s[0] not in own]
        return self._others

    def fits(self, location: str, plan: Mapping[str, Any], chat: ChatSettings | None = None) -> bool:
        """Whether the complete cache at ``location`` holds the plan's shards with this tokenizer
        (rendered with the chat settings ``chat`` for a chat source)."""
        from lm_pipeline.data.cache import CacheError, open_cache
        from lm_pipeline.data.cache.ledger import incompatibility

        if location not in self._ledgers:
            try:
                self._ledgers[location] = open_cache(location).ledger  # complete, readable by this code
            except CacheError:
                self._ledgers[location] = None
        ledger = self._ledgers[location]
        return ledger is not None and incompatibility(ledger, self.info, plan,
                                                         chat.ledger() if chat is not None else None) is None

    def eval_cache(self, plan: Mapping[str, Any], chat: ChatSettings | None = None) -> tuple[str, str] | None:
        fp = eval_cache_fingerprint(self.info, plan, chat)
        if self.pipe.store.manifest(EVAL_CACHE_STAGE, fp) is None:
            return None
        return f"{self.pipe.store.artifact(EVAL_CACHE_STAGE, fp).path}/{CACHE_SUBDIR}", f"{EVAL_CACHE_STAGE} {fp}"

    def find(self, plan: Mapping[str, Any], chat: ChatSettings | None = None, *,
             eval_caches: bool = True) -> tuple[str, str] | None:
        """(location, label) of a complete cache of the plan's shards with this tokenizer (and
        these chat settings), or None."""
        for loc, label in self.own():
            if self.fits(loc, plan, chat):
                return loc, label
        if eval_caches:
            hit = self.eval_cache(plan, chat)
            if hit is not None and self.fits(hit[0], plan, chat):
                return hit
        for loc, label in self.others():
            if self.fits(loc, plan, chat):
                return loc, label
        return None


def _build_eval_cache(pipe: Pipeline, name: str, shards: Sequence[Shard], tokenizer_dir: str,
                      info: TokenizerInfo, plan: Mapping[str, Any], chat: ChatSettings | None = None) -> str:
    """Tokenize one validation set into its evaluation cache (under the store's lock for its
    address: a second builder waits, then finds it complete); its location."""
    from lm_pipeline.data.cache import build_cache
    from lm_pipeline.steps.builders import ledger_counts
    from lm_pipeline.store import naming_storage_errors

    store = pipe.store
    fp = eval_cache_fingerprint(info, plan, chat)
    art = store.artifact(EVAL_CACHE_STAGE, fp)
    where = f"{art.path}/{CACHE_SUBDIR}"
    with naming_storage_errors(f"{EVAL_CACHE_STAGE} {fp}", art.path):
        with store.lock(art):
            if store.manifest(EVAL_CACHE_STAGE, fp) is None:
                log.info("eval: tokenizing validation set %r (%d shards) with the checkpoint's tokenizer into %s",
                         name, len(shards), where)
                data = pipe.cfg.data
                ledger = build_cache(where, shards, tokenizer_dir, num_workers=data.num_workers,
                                     shard_group_size=data.shard_group_size, progress=pipe.progress, chat=chat)
                conf = {"shards": dict(plan), "tokenizer": info.fingerprint,
                        **({"chat": chat.ledger()} if chat is not None else {})}
                store.commit(art, {"config": conf,
                                   "inputs": {}, "code_version": EVAL_CACHE_VERSION,
                                   "summary": {"validation_set": name, **ledger_counts(ledger)},
                                   "cache": where})
    return where


def eval_datasets(cfg: RunConfig, tokenizer_dir: str, *, seq_len: int, train: bool = False,
                  progress: bool = True) -> EvalData:
    """The config's validation sets as datasets of ``seq_len`` rows (``data.packing``), tokenized
    with the tokenizer at ``tokenizer_dir`` (a checkpoint's ``tokenizer/``, or a Hugging Face
    model directory): from the token caches that fit, building only the sets none holds (see the
    module docstring). ``train``: also find the training split's cache (the unigram baseline)."""
    from lm_pipeline.data.cache.ledger import shard_plan
    from lm_pipeline.data.encode import tokenizer_info
    from lm_pipeline.data.loader import open_dataset
    from lm_pipeline.steps import Pipeline
    from lm_pipeline.steps.mixture import training_splits

    pipe = Pipeline(cfg, progress=progress)
    shards = pipe.shards()
    with normalized_tokenizer(tokenizer_dir) as tok:
        info = tokenizer_info(tok)
        finder = _Finder(pipe, info)
        locations: dict[str, str] = {}
        packs: dict[str, bool | None] = {}  # a chat set's pack (how its rows are packed)
        reused: dict[str, str] = {}
        built: list[str] = []
        training = training_splits(shards)  # 'train', or a mixture's '<component>/train'
        for name, split in shards.items():
            if name in training:
                continue
            plan = shard_plan(split)
            chat = split_chat(cfg, name, tok)  # a chat set: rendered and masked as the training cache is
            packs[name] = chat.pack if chat is not None else None
            hit = finder.find(plan, chat)
            if hit is not None:
                locations[name], reused[name] = hit
                log.info("eval: validation set %r from %s", name, hit[1])
            else:
                locations[name] = _build_eval_cache(pipe, name, split, tok, info, plan, chat)
                built.append(name)
        train_cache = None
        if train:
            hits = [finder.find(shard_plan(shards[name]), split_chat(cfg, name, tok), eval_caches=False)
                    for name in training]
            hit = None if None in hits else (hits[0][0] if len(hits) == 1 else [h[0] for h in hits],
                                             ", ".join(h[1] for h in hits))
            if hit is None:
                log.warning("eval: no token cache of the training data with the checkpoint's tokenizer (%s…) in %s: "
                            "the unigram baseline is left out (the training data is not tokenized for an evaluation; "
                            "`lm-pipeline cache --config_path CONFIG --data.tokenizer %s` builds one)",
                            info.fingerprint[:16], pipe.store.root, tokenizer_dir)
            else:
                train_cache = hit[0]
                log.info("eval: unigram baseline from %s", hit[1])
    packing = cfg.data.packing
    datasets = {name: open_dataset(loc, seq_len, packing, expected_tokenizer_fingerprint=info.fingerprint,
                                   chat_pack=packs[name]) for name, loc in locations.items()}
    return EvalData(datasets, locations, tuple(built), train_cache, info.fingerprint, reused)
