"""``Pipeline(config, store)``: the stages of one experiment over one artifact store.

It turns the stage table (:mod:`lm_pipeline.steps.stages`) into addresses and runs stages:

* :meth:`Pipeline.address` -- the *fingerprint*: config + code version + the inputs'
  fingerprints, down to the content hashes of the raw shards. It names the artifact. Computing it
  reads the data's bytes (hashes), but does no stage's work.
* :meth:`Pipeline.config_version` -- the same hash over config and code versions only (no data is
  read). Dagster uses it as the asset's ``code_version``, known when the definitions load, so a
  config edit marks exactly the stages whose fingerprint it changes as stale.

Both are computed once per stage and kept on the pipeline (and shared with
:meth:`Pipeline.with_config`, which swaps in a config that differs in non-semantic fields only).
:meth:`Pipeline.run` builds an artifact unless it is complete: the cache hit, the builders' lock
and the manifest written last live there.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

from lm_pipeline.config import RunConfig
from lm_pipeline.fingerprint import fingerprint, semantic_view
from lm_pipeline.schema import ConfigError
from lm_pipeline.steps import artifact, fanout, mixture
from lm_pipeline.steps.artifact import Writer
from lm_pipeline.steps.plan import plan as _plan
from lm_pipeline.steps.plan import plan_text as _plan_text
from lm_pipeline.steps.result import Address, StageResult
from lm_pipeline.steps.stage import BuildContext, Inputs, Stage
from lm_pipeline.steps.stages import stage_table
from lm_pipeline.store import ArtifactStore, open_store

log = logging.getLogger(__name__)

def process_index(cfg: RunConfig) -> int:
    """This process's index in a multi-process run, known before ``jax.distributed`` starts: the
    config's ``trainer.distributed.process_id``, else the launcher's ``SLURM_PROCID``, else 0."""
    pid = cfg.trainer.distributed.process_id
    if pid is not None:
        return int(pid)
    env = os.environ.get("SLURM_PROCID", "").strip()
    return int(env) if env.isdigit() and cfg.trainer.distributed.enabled else 0

class _Memo:
    """What a pipeline computes once: resolved shards, addresses, config versions."""

    def __init__(self) -> None:
        self.shards: dict[str, list] | None = None
        self.addresses: dict[tuple[str, Any], Address] = {}
        self.versions: dict[str, str] = {}
        self.components: dict[str, Pipeline] | None = None


class Pipeline:
    """The stages of one experiment over one artifact store.

    ``stages``: the stage table (default :data:`lm_pipeline.steps.STAGES`); ``eval_config`` and
    ``export_config`` replace the config's ``eval:`` and ``export:`` sections.
    """

    def __init__(self, cfg: RunConfig, store: ArtifactStore | None = None, *, progress: bool = True,
                 eval_config: Any = None, export_config: Any = None, stages: Sequence[Stage] | None = None):
        self.cfg = cfg
        # data.cache_dir keeps token caches outside the store (the store keeps pointers to them)
        self.store = open_store(store or cfg.store.root, {"token_cache": cfg.data.cache_dir})
        self.progress = progress
        self._eval_config = eval_config
        self._export_config = export_config
        self._memo = _Memo()
        self.stages: dict[str, Stage] = {}
        self.skipped: dict[str, str] = {}  # a stage that does not apply to this experiment -> why
        for name, st in stage_table(None if stages is None else tuple(stages)).items():
            why = next((f"it reads {up!r}, which does not apply" for up in st.upstream if up in self.skipped), None)
            why = why or (st.not_applicable(self) if st.not_applicable is not None else None)
            if why:
                self.skipped[name] = why
            else:
                self.stages[name] = st

    def with_config(self, cfg: RunConfig) -> Pipeline:
        """This pipeline with ``cfg``, which may differ in non-semantic fields only (runtime
        settings): the addresses are the same, so what was computed is shared, not recomputed."""
        if semantic_view(cfg) != semantic_view(self.cfg):
            raise ValueError("with_config: the new config differs in semantic fields (its addresses would differ)")
        other = Pipeline(cfg, self.store, progress=self.progress, eval_config=self._eval_config,
                         export_config=self._export_config, stages=tuple(self.stages.values()))
        other._memo = self._memo
        return other

    # ---------------------------------------------------------------- settings

    @property
    def eval_config(self) -> Any:
        """The evaluation settings: given, else the config's ``eval:`` section."""
        return self._eval_config if self._eval_config is not None else self.cfg.eval

    @property
    def export_config(self) -> Any:
        """The Hugging Face export settings: given, else the config's ``export:`` section."""
        return self._export_config if self._export_config is not None else self.cfg.export

    def preflight(self) -> None:
        """Checks that need this machine (device count, filesystems for the URLs) but no compute:
        fail before any work, naming the config field."""
        import jax

        for where, problem in self.cfg.data.url_problems():
            raise ConfigError(f"data.{where}", problem)
        for where, problem in self.url_access_problems():
            raise ConfigError(where, problem)
        for where, problem in self.input_problems():
            raise ConfigError(where, problem)
        self.cfg.trainer.check_devices(jax.device_count())

    def input_problems(self) -> list[tuple[str, str]]:
        """(config field, one-line problem) for each local input path the config names that cannot
        be used: a tokenizer directory (``data.tokenizer``) or a starting Hugging Face model
        (``initialize_from_hf``) that does not exist, is a file, or whose files are corrupt. Hub
        ids are checked when they are read (a hub model when the run's address is computed); URLs
        by :meth:`url_access_problems`."""
        from lm_pipeline.inputs import hf_model_dir_problem, tokenizer_problem

        out = []
        tok = self.cfg.data.tokenizer
        if tok.kind == "hf" and tok.name_or_path:
            problem = tokenizer_problem(tok.name_or_path)
            if problem:
                out.append(("data.tokenizer", problem))
        if self.cfg.initialize_from_hf:
            problem = hf_model_dir_problem(self.cfg.initialize_from_hf, "initialize_from_hf")
            if problem:
                out.append(("initialize_from_hf", problem))
        return out

    def checkpoint_problems(self) -> list[tuple[str, str]]:
        """(config field, one-line problem) for the checkpoints a training run would load:
        ``trainer.load_checkpoint_path`` (unless ``trainer.load_checkpoint: false``) must hold a
        complete checkpoint; a Hugging Face model directory as ``trainer.initialize_from`` must
        have a valid config.json and weights. Checked before ``train_ckpt`` is built, or found
        built: a finished run whose config names a resume path that holds nothing fails here
        rather than look like a cache hit (the path is not part of the run's address)."""
        from lm_pipeline import fs
        from lm_pipeline.inputs import checkpoint_problem, hf_model_dir_problem

        tc = self.cfg.trainer
        out = []
        if tc.load_checkpoint_path and tc.load_checkpoint is not False:
            problem = checkpoint_problem(tc.load_checkpoint_path, "trainer.load_checkpoint_path")
            if problem:
                out.append(("trainer.load_checkpoint_path", problem))
        start = fs.as_local(tc.initialize_from) if tc.initialize_from else None
        if start and os.path.isfile(os.path.join(start, "config.json")) \
                and not os.path.exists(os.path.join(start, "checkpoint.json")):  # a Hugging Face model directory
            problem = hf_model_dir_problem(tc.initialize_from, "trainer.initialize_from")
            if problem:
                out.append(("trainer.initialize_from", problem))
        return out

    def training_text_problem(self) -> str | None:
        """Why the training split holds no text (one line naming its shards: empty files, or every
        record invalid and skipped), from the ``raw_shards`` manifest (built if needed); None when
        it holds some."""
        rows = (self.raw_shards().manifest.get("shards") or {}).get("train") or []
        if not rows or any(int(r.get("valid") or 0) > 0 for r in rows):
            return None
        records = sum(int(r.get("records") or 0) for r in rows)
        skipped: dict[str, int] = {}
        for r in rows:
            for reason, n in (r.get("skipped") or {}).items():
                skipped[reason] = skipped.get(reason, 0) + int(n)
        names = [str(r.get("url") or r.get("name")) for r in rows]
        where = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        if records == 0:
            what = f"{where} {'holds' if len(names) == 1 else 'hold'} no records"
        else:
            reasons = ", ".join(f"{k}×{v}" for k, v in sorted(skipped.items(), key=lambda kv: (-kv[1], kv[0])))
            what = f"none of the {records} records of {where} is valid (skipped: {reasons})"
        source = (self.cfg.data.train_sources() or ["train_urls"])[0]
        return (f"no training text: {what}; point data.{source} at data with at least one record whose "
                f"'{self.cfg.data.text_key}' is text")

    def url_locations(self) -> list[tuple[str, str]]:
        """(config field, URL or path) of every location this experiment reads or writes."""
        cfg = self.cfg
        data = cfg.data
        out = [("store.root", self.store.root)]
        if data.cache_dir:
            out.append(("data.cache_dir", data.cache_dir))
        out += [(f"data.{where}", u) for where, u in data.urls()]
        out += mixture.url_locations(data)
        tc = cfg.trainer
        for where, value in (("data.tokenizer.name_or_path", data.tokenizer.name_or_path if data.tokenizer.kind == "hf" else None),
                             ("trainer.checkpointer.base_path", tc.checkpointer.base_path),
                             ("trainer.load_checkpoint_path", tc.load_checkpoint_path),
                             ("trainer.initialize_from", getattr(tc, "initialize_from", None)),
                             ("export.hf_save_path", getattr(self.export_config, "hf_save_path", None)),
                             ("eval.report_dir", getattr(self.eval_config, "report_dir", None))):
            if isinstance(value, str) and value:
                out.append((where, value))
        return out

    def url_access_problems(self) -> list[tuple[str, str]]:
        """(config field, one-line problem) for each object-store location that cannot be used
        from here: unknown scheme, filesystem package missing, bucket missing, credentials
        missing or refused. One listing per bucket; local paths are not checked here."""
        from lm_pipeline.fs import access_problems

        locations = self.url_locations()
        problems = access_problems(url for _, url in locations)
        return [(where, problems[url]) for where, url in locations if url in problems]

    @property
    def builtin_root(self) -> str:
        return f"{self.store.root}/builtin"

    def shards(self) -> dict[str, list]:
        """Shards per split: 'train' and each validation set (resolved once)."""
        if self._memo.shards is None:
            from lm_pipeline.data.sources import resolve_shards, validation_sets

            data = self.cfg.data
            if data.configs:  # a mixture: each component's splits (lm_pipeline.steps.mixture)
                self._memo.shards = mixture.shards(self)
                return self._memo.shards
            if not data.train_sources() and "train_ckpt" in self.stages:  # a mixture's component may only evaluate
                raise ConfigError("data", "no training data: set data.train_urls, data.hf_id or data.builtin")
            root = self.builtin_root if data.builtin else None
            out = {"train": resolve_shards(data, "train", builtin_root=root)} if data.train_sources() else {}
            out.update(validation_sets(data, builtin_root=root))
            self._memo.shards = out
        return self._memo.shards

    def components(self) -> dict[str, Pipeline]:
        """A data mixture's components, each a pipeline of its own data (its raw shards and token
        cache, the mixture's tokenizer), by name in ``data.configs`` order; empty without a
        mixture (:mod:`lm_pipeline.steps.mixture`)."""
        if self._memo.components is None:
            self._memo.components = mixture.component_pipelines(self)
        return self._memo.components

    # ---------------------------------------------------------------- addressing

    def stage(self, name: str) -> Stage:
        """The declaration of stage ``name``."""
        try:
            return self.stages[name]
        except KeyError:
            if name in self.skipped:
                raise ConfigError("", f"stage {name!r} does not apply to this experiment: {self.skipped[name]}") from None
            raise ValueError(f"unknown stage {name!r}; stages: {', '.join(self.stages)}") from None

    def stage_config(self, name: str) -> Any:
        """The semantic config of stage ``name``, as plain data (what its hash covers besides inputs)."""
        return self.stage(name).config(self)

    def input_stages(self, name: str) -> tuple[str, ...]:
        """The upstream stages whose fingerprints are inputs of stage ``name``'s fingerprint."""
        return self.stage(name).hashed_upstream(self)

    def final_step(self) -> int | str:
        """The step of the run's final checkpoint: from the finished run, else from the config."""
        manifest = self.store.manifest("train_ckpt", self.address("train_ckpt").fingerprint)
        if manifest is not None and manifest.get("summary", {}).get("final_step") is not None:
            return int(manifest["summary"]["final_step"])
        try:
            return self.cfg.trainer.resolve_num_steps(None, self.cfg.model.seq_len)
        except ConfigError:  # num_epochs: needs the data's size
            return "final"

    def address(self, name: str, step: int | None = None) -> Address:
        """A stage's fingerprint and what went into it (computed once, without the stage's work).

        ``step`` (checkpoint stages: eval_report, hf_export): the checkpoint step they read;
        default the final one.
        """
        st = self.stage(name)
        step_key: Any = (self.final_step() if step is None else step) if st.per_checkpoint else None
        found = self._memo.addresses.get((name, step_key))
        if found is not None:
            return found
        conf = st.config(self)
        inputs: dict[str, Any] = {up: self.address(up).fingerprint for up in st.hashed_upstream(self)}
        if st.sources is not None:
            inputs.update(st.sources(self, True))
        if st.per_checkpoint:
            inputs["step"] = step_key
        addr = Address(name, fingerprint(name, conf, st.code_version, inputs), conf, inputs, st.code_version)
        self._memo.addresses[(name, step_key)] = addr
        return addr

    def config_version(self, name: str) -> str:
        """The stage's fingerprint over its semantic config, code version and its upstream stages'
        config versions: what the address covers, minus the data's content. No data is read."""
        if name not in self._memo.versions:
            st = self.stage(name)
            inputs: dict[str, Any] = {up: self.config_version(up) for up in st.hashed_upstream(self)}
            if st.sources is not None:
                inputs.update(st.sources(self, False))
            self._memo.versions[name] = fingerprint(name, st.config(self), st.code_version, inputs)
        return self._memo.versions[name]

    def config_versions(self) -> dict[str, str]:
        """:meth:`config_version` of every stage, in table order."""
        return {name: self.config_version(name) for name in self.stages}

    def own_version(self, name: str) -> str:
        """The stage's fingerprint over its own semantic config and code version, no inputs: the
        version of a stage applied to inputs chosen elsewhere (one checkpoint of any run), with the
        inputs that are not stages known without reading the data (a local task file's hash)."""
        st = self.stage(name)
        return fingerprint(name, st.config(self), st.code_version, st.sources(self, False) if st.sources else {})

    # ---------------------------------------------------------------- running

    def cached(self, name: str, step: int | None = None) -> StageResult | None:
        """The stage's result if it is complete (a cache hit), else None. Does no work."""
        return artifact.cached(self.store, self.address(name, step))

    def run(self, name: str, write: Writer, step: int | None = None, *, staged: bool = False) -> StageResult:
        """Build stage ``name`` with ``write`` unless it is complete; commit its manifest last
        (:func:`lm_pipeline.steps.artifact.build`, whose ``staged`` this passes on)."""
        follower = self.stage(name).distributed and process_index(self.cfg) > 0
        return artifact.build(self.store, self.address(name, step), write, staged=staged,
                              follower=f"process {process_index(self.cfg)}" if follower else None)

    def build(self, name: str, **options: Any) -> StageResult:
        """Build stage ``name`` (its upstream first) with its build function's ``options``; what the
        stage needs of the user's inputs (its declaration's ``check``) is checked first, also when
        it is built already."""
        stage = self.stage(name)
        if stage.check is not None:
            stage.check(self)
        return stage.build(BuildContext(self, stage), Inputs(self, stage), **options)

    # -- the stages by name (the build functions are in lm_pipeline.steps.builders) -------------------

    def raw_shards(self) -> StageResult:
        return self.build("raw_shards")

    def tokenizer(self) -> StageResult:
        return self.build("tokenizer")

    def token_cache(self) -> StageResult:
        return self.build("token_cache")

    def train_ckpt(self, hooks: Sequence = ()) -> StageResult:
        return self.build("train_ckpt", hooks=hooks)

    def eval_report(self, checkpoint: str | None = None) -> StageResult:
        return self.build("eval_report", checkpoint=checkpoint)

    def hf_export(self, checkpoint: str | None = None, **options: Any) -> StageResult:
        return self.build("hf_export", checkpoint=checkpoint, **options)

    # -- the token cache fanned out (lm_pipeline.steps.fanout) ---------------------------------------

    def token_cache_groups(self) -> list[fanout.CacheGroup]:
        return fanout.groups(self)

    def token_cache_part(self, group: fanout.CacheGroup) -> dict[str, Any]:
        return fanout.build_part(self, group)

    def token_cache_commit(self, built: Sequence[Mapping[str, Any]] = ()) -> StageResult:
        return fanout.commit(self, built)

    # ---------------------------------------------------------------- the run and its checkpoints

    def datasets(self, cache: StageResult | None = None):
        """(train dataset, {validation set: dataset}, tokenizer dir, vocab size) from the cache."""
        from lm_pipeline.steps.builders import open_datasets

        return open_datasets(self.cfg, cache or self.token_cache())

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
        return self.store.artifact("train_ckpt", self.address("train_ckpt").fingerprint).path

    # ---------------------------------------------------------------- the plan (lm_pipeline.steps.plan)

    def plan(self) -> list[dict[str, Any]]:
        """Per stage: hit or miss, and for a miss what changed since the stage's last artifact."""
        return _plan(self)

    def plan_text(self) -> str:
        return _plan_text(self)
