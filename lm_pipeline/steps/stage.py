"""A stage's declaration (:class:`Stage`) and what its builder receives (:class:`BuildContext`,
:class:`Inputs`).

A builder is ``build(ctx, inputs, **options) -> StageResult``: ``inputs`` holds the artifacts it
reads (its upstream stages and theirs, each built on first use, a cache hit when complete),
``ctx`` the config, the data's shards and :meth:`BuildContext.run`, which writes the stage's own
artifact at its address and commits its manifest last. Nothing else of the pipeline is reachable
from a builder, so a stage reads exactly what its declaration says it reads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lm_pipeline.steps.pipeline import Pipeline, Writer
    from lm_pipeline.steps.result import Address, StageResult
    from lm_pipeline.store import ArtifactStore

#: The pools a stage may run in (the Dagster layer names them): one training and one evaluation
#: at a time per deployment.
POOLS = ("training", "evaluation")


@dataclass(frozen=True)
class Stage:
    """One stage, declared once: everything the plan, lineage, the command line and the Dagster
    layer know of it.

    ``config(pipe)`` is the stage's semantic config as plain data (what enters its hash);
    ``upstream`` the stages whose artifacts it reads (its lineage, and the inputs of its hash
    unless ``input_stages`` narrows them for a config); ``sources(pipe, content)`` the inputs that
    are not stages (content hashes of data files; with ``content=False`` only what is known
    without reading the data); ``build(ctx, inputs, **options)`` builds it (see the module
    docstring). ``per_checkpoint`` stages read one checkpoint of the run, whose step enters their
    address. ``command``: the ``lm-pipeline`` subcommand that builds it, and its help. ``kind``:
    what the artifact is made of; ``pool``: one of :data:`POOLS` or None; ``metadata(result)``:
    what its result shows, as plain data (:mod:`lm_pipeline.steps.display`), besides the path,
    fingerprint, timing and size every stage shows. ``check(pipe)`` raises what the user must fix
    before the stage is built (also when it is built already: a cache hit must not hide a bad
    input). ``distributed``: all processes of one ``jax.distributed`` run build it together, each
    writing its part; process 0 takes the builders' lock and commits the manifest, the others do
    neither (a follower waiting for the lock that process 0 holds while process 0 waits for it in
    ``jax.distributed`` start-up would deadlock; one manifest per artifact is the rule).
    ``not_applicable(pipe)``: why the stage does not apply to an experiment (one line, e.g. its
    config has no section for it), None when it does; a stage that does not apply, and every stage
    reading it, is not one of that experiment's stages (no address, plan row, asset or command).
    """

    name: str
    code_version: int  # bumped by hand when what the stage produces changes
    upstream: tuple[str, ...]
    config: Callable[[Pipeline], Any]
    build: Callable[..., StageResult]
    description: str
    kind: str
    input_stages: Callable[[Pipeline], tuple[str, ...]] | None = None
    sources: Callable[[Pipeline, bool], dict[str, Any]] | None = None
    per_checkpoint: bool = False
    command: tuple[str, str] | None = None
    pool: str | None = None
    metadata: Callable[[StageResult], dict[str, Any]] | None = None
    check: Callable[[Pipeline], None] | None = None
    distributed: bool = False
    not_applicable: Callable[[Pipeline], str | None] | None = None

    def __post_init__(self) -> None:
        if self.pool is not None and self.pool not in POOLS:
            raise ValueError(f"stage {self.name!r}: pool {self.pool!r} is not one of {POOLS} (or None)")

    def hashed_upstream(self, pipe: Pipeline) -> tuple[str, ...]:
        """The upstream stages whose fingerprints are inputs of this stage's fingerprint."""
        return self.input_stages(pipe) if self.input_stages is not None else self.upstream


class BuildContext:
    """What a builder uses besides its inputs: the config and the stage's settings, the data's
    shards (the input that is no stage), and :meth:`run`, which builds the stage's artifact."""

    def __init__(self, pipe: Pipeline, stage: Stage):
        self._pipe = pipe
        self.stage = stage
        self.cfg = pipe.cfg
        self.progress = pipe.progress
        self.eval_config = pipe.eval_config
        self.export_config = pipe.export_config

    @property
    def store(self) -> ArtifactStore:
        return self._pipe.store

    def shards(self) -> dict[str, list]:
        """The data: shards per split ('train' and each validation set)."""
        return self._pipe.shards()

    def components(self) -> dict[str, Pipeline]:
        """A data mixture's components, each a pipeline of its own data (:meth:`Pipeline.components`)."""
        return self._pipe.components()

    def address(self, step: int | None = None) -> Address:
        """This stage's address (its fingerprint and what went into it)."""
        return self._pipe.address(self.stage.name, step)

    def complete(self, step: int | None = None) -> bool:
        """Whether this stage's artifact is complete (a cache hit)."""
        return self._pipe.store.is_complete(self.stage.name, self.address(step).fingerprint)

    def run(self, write: Writer, step: int | None = None, *, staged: bool = False) -> StageResult:
        """Build this stage's artifact with ``write`` unless it is complete (:meth:`Pipeline.run`)."""
        return self._pipe.run(self.stage.name, write, step, staged=staged)

    def run_id(self) -> str:
        """The training run's id (:meth:`Pipeline.run_id`)."""
        return self._pipe.run_id()

    def run_dir(self) -> str:
        """Where the training run lives (:meth:`Pipeline.run_dir`)."""
        return self._pipe.run_dir()


class Inputs(Mapping[str, "StageResult"]):
    """The artifacts a stage reads, by stage name: its upstream stages and theirs. Each is built on
    first use (its own upstream first; a cache hit when complete), so a builder that does not need
    one (an evaluation of a given checkpoint never trains) does not build it."""

    def __init__(self, pipe: Pipeline, stage: Stage):
        self._pipe = pipe
        self.stage = stage
        self._names = _ancestors(pipe, stage.name)
        self._built: dict[str, StageResult] = {}

    def _check(self, name: str) -> None:
        if name not in self._names:
            raise KeyError(f"stage {self.stage.name!r} reads {name!r}, which is not upstream of it "
                           f"(its inputs: {', '.join(self._names) or 'none'}); declare it in the stage's upstream")

    def __getitem__(self, name: str) -> StageResult:
        self._check(name)
        if name not in self._built:
            self._built[name] = self._pipe.build(name)
        return self._built[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def address(self, name: str) -> Address:
        """An input's address, without building it."""
        self._check(name)
        return self._pipe.address(name)

    def complete(self, name: str) -> bool:
        """Whether an input's artifact is complete, without building it."""
        return self._pipe.store.is_complete(name, self.address(name).fingerprint)

    def path(self, name: str) -> str:
        """Where an input's artifact is written (built or not)."""
        return self._pipe.store.artifact(name, self.address(name).fingerprint).path

    def checkpoint(self, checkpoint: str | None = None) -> tuple[str, int]:
        """(complete checkpoint dir, its step): ``checkpoint``, else the final one of the
        ``train_ckpt`` input (trained first if the run is not finished)."""
        from lm_pipeline.train.checkpoint import latest_checkpoint, read_metadata

        if checkpoint is None:
            run = self["train_ckpt"]
            checkpoint = run.manifest.get("final_checkpoint") or latest_checkpoint(run.manifest.get("run_dir", run.path))
            if checkpoint is None:
                raise FileNotFoundError(f"training run {run.path} has no complete checkpoint")
        found = latest_checkpoint(checkpoint)
        if found is None:
            raise FileNotFoundError(f"no complete checkpoint at or under {checkpoint}")
        return found, int(read_metadata(found)["step"])


def _ancestors(pipe: Pipeline, name: str) -> tuple[str, ...]:
    """Every stage ``name`` reads, directly or through its upstream, in table order."""
    found: set[str] = set()
    todo = list(pipe.stage(name).upstream)
    while todo:
        up = todo.pop()
        if up not in found:
            found.add(up)
            todo.extend(pipe.stage(up).upstream)
    return tuple(s for s in pipe.stages if s in found)
