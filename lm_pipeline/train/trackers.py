"""Metric trackers (JSONL, TensorBoard, Weights & Biases), Python logging set-up, secret redaction.

Configuration (``trainer.tracker``; a list of members selected by ``type:``)::

    tracker:
      - type: wandb          # project, entity, tags, id, name, group, resume, mode, save_code
        project: my-project
        mode: offline
      - type: tensorboard    # logdir (default <run_dir>/tensorboard)

Whatever is configured, :func:`build_tracker` always includes the JSONL metrics log at
``<run_dir>/metrics.jsonl``: one JSON object per line, ``{"step": int, <metric>: value, ...}``
(non-finite floats are written as Python's json writes them: ``NaN``, ``Infinity``).
It is the run's source of truth: when a run resumes and will log again from step ``s``
(``resume_step``), lines with ``step >= s`` are dropped first, so a resumed run's log equals an
uninterrupted one's (TensorBoard is opened with ``purge_step=s`` for the same effect).
:meth:`Tracker.log_summary` values go to ``<run_dir>/summary.json`` (merged; removed when a
run starts fresh). ``run_dir`` may be an fsspec URL (``gs://...``); the JSONL log is then
staged locally and uploaded periodically (object stores cannot append).

Canonical metric names (Levanter's; trackers pass names through unchanged):

* ``train/loss``: mean next-token loss of the step's batch (nats).
* ``eval/<set>/loss``: mean loss on validation set ``<set>``; ``eval/loss`` for the mean.
* ``optim/learning_rate``, ``optim/grad_norm`` (global norm before clipping),
  ``optim/update_norm``, ``optim/skipped_steps``.
* ``throughput/tokens_per_second``, ``throughput/examples_per_second``, ``throughput/mfu``
  (model FLOPs utilisation, a fraction), ``throughput/step_seconds``.

W&B: a run's wandb id is ``id`` when given, else derived from the pipeline's ``run_id``
(sanitised, stable), and ``resume`` defaults to ``"allow"``, so a resumed training run continues
the same wandb run. wandb drops points whose step is below the run's last logged step, so
after a crash the overlap between checkpoint and crash stays as first logged there; the JSONL
log is exact. ``mode: offline`` needs no network (files go under ``$WANDB_DIR`` or the run
directory; ``wandb sync`` uploads them later). wandb is imported only when a wandb tracker is
built.

Secrets: hyperparameters pass through :func:`lm_pipeline.train.runlog.redact` before any tracker
sees them; :mod:`lm_pipeline.train.runlog` also sets up the run's Python logging.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from lm_pipeline import fs
from lm_pipeline.atomic import atomic_write_text
from lm_pipeline.fs import join
from lm_pipeline.schema import Choice, ConfigError, field
from lm_pipeline.train.runlog import REDACTED, is_secret_key, redact, setup_logging  # noqa: F401 (re-exported)

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"

# --- trackers ---------------------------------------------------------------------------------


def _scalar(name: str, value: Any) -> Any:
    """Python int/float/bool/str from a metric value (numpy / jax scalars included)."""
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if hasattr(value, "item") and getattr(value, "size", 1) == 1:
        return value.item()
    raise TypeError(f"metric {name!r} must be a scalar, got {type(value).__name__}")


def _clean_metrics(metrics: Mapping[str, Any]) -> dict[str, Any]:
    return {str(k): _scalar(str(k), v) for k, v in metrics.items()}


class Tracker:
    """Where metrics go. ``log`` may be called several times for one step (train, then eval)."""

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        raise NotImplementedError

    def log_summary(self, metrics: Mapping[str, Any]) -> None:
        """Final / run-level values (not a time series)."""

    def flush(self) -> None:
        """Make everything logged so far durable where it is read (the trainer calls it before each
        checkpoint: a run resumed from that checkpoint finds every step before it)."""

    def finish(self) -> None:
        """Flush and close; the tracker must not be used afterwards."""

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.finish()


class NoopTracker(Tracker):
    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        pass


def _parse_metrics(text: str) -> list[dict[str, Any]]:
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # a torn last line from a crash
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int):
            out.append(rec)
    return out


def read_metrics(path: str) -> list[dict[str, Any]]:
    """The records of a JSONL metrics log (local path or fsspec URL; a torn line is ignored)."""
    text = fs.read_text(path)
    return _parse_metrics(text) if text is not None else []


class JsonlTracker(Tracker):
    """Appends ``{"step": s, ...}`` lines to ``path``; on (re)start keeps only lines with step < resume_step.

    ``path`` may be an fsspec URL (``gs://...``): object stores cannot append, so lines go to a
    local staging copy that is uploaded whole every ``upload_interval_s`` seconds (at a
    ``log`` call), at each ``flush`` (before every checkpoint), ``log_summary`` and ``finish``.
    """

    def __init__(
        self,
        path: str,
        *,
        resume_step: int | None,
        summary_path: str | None = None,
        upload_interval_s: float = 60.0,
    ):
        self.path = fs.norm(path)
        self.summary_path = summary_path or self.path + ".summary.json"
        self.upload_interval_s = upload_interval_s
        keep_before = resume_step or 0
        existing = fs.read_text(self.path)
        kept = ""
        if existing is not None:
            kept = "".join(json.dumps(r) + "\n" for r in _parse_metrics(existing) if r["step"] < keep_before)
            atomic_write_text(self.path, kept)
        if not resume_step:
            fs.remove(self.summary_path)
        self._file = fs.AppendFile(self.path)  # continues from ``kept``; closed in finish()
        self._last_upload = time.monotonic()

    def _upload(self) -> None:
        self._file.publish()
        self._last_upload = time.monotonic()

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        if "step" in metrics:
            raise ValueError("'step' is reserved in the metrics log; pass it as the step argument")
        record = {"step": int(step), **_clean_metrics(metrics)}
        self._file.write(json.dumps(record) + "\n")
        if time.monotonic() - self._last_upload >= self.upload_interval_s:
            self._upload()

    def flush(self) -> None:
        self._upload()

    def log_summary(self, metrics: Mapping[str, Any]) -> None:
        summary: dict[str, Any] = {}
        text = fs.read_text(self.summary_path)
        if text:
            with contextlib.suppress(json.JSONDecodeError):
                summary = json.loads(text)
        summary.update(_clean_metrics(metrics))
        atomic_write_text(self.summary_path, json.dumps(summary, indent=1, sort_keys=True) + "\n")
        self._upload()

    def finish(self) -> None:
        self._file.close()


class TensorboardTracker(Tracker):
    """Scalars to a tensorboardX event file; strings as text. Hyperparameters as a JSON text."""

    def __init__(self, logdir: str, *, resume_step: int | None, hparams: Mapping[str, Any]):
        from tensorboardX import SummaryWriter

        local = fs.as_local(logdir)
        if local:  # tensorboardX writes s3:// and gs:// itself (not through fsspec)
            os.makedirs(local, exist_ok=True)
        self.logdir = logdir = local or logdir
        # A unique suffix: event files are named by the second they were opened in, and a
        # restart within that second would otherwise overwrite the previous file.
        self.writer = SummaryWriter(
            logdir=logdir, purge_step=resume_step or None, flush_secs=30, filename_suffix=f".{uuid.uuid4().hex[:8]}"
        )
        self._last_step = resume_step or 0
        if hparams:
            text = json.dumps(hparams, indent=1, sort_keys=True, default=str)
            self.writer.add_text("hparams", f"```\n{text}\n```", global_step=self._last_step)

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        self._last_step = max(self._last_step, int(step))
        for name, value in _clean_metrics(metrics).items():
            if isinstance(value, (int, float)):  # bools included
                self.writer.add_scalar(name, float(value), global_step=int(step))
            elif isinstance(value, str):
                self.writer.add_text(name, value, global_step=int(step))

    def log_summary(self, metrics: Mapping[str, Any]) -> None:
        for name, value in _clean_metrics(metrics).items():
            if isinstance(value, (int, float)):
                self.writer.add_scalar(f"summary/{name}", float(value), global_step=self._last_step)
            elif isinstance(value, str):
                self.writer.add_text(f"summary/{name}", value, global_step=self._last_step)

    def finish(self) -> None:
        self.writer.close()


_WANDB_ID_OK = re.compile(r"^[A-Za-z0-9_.-]+$")


def wandb_run_id(run_id: str) -> str:
    """A stable wandb run id for a pipeline run id (letters, digits, ``_ . -``; at most 64 chars)."""
    clean = re.sub(r"[^A-Za-z0-9_.-]+", "-", run_id).strip("-.") or "run"
    if clean == run_id and len(clean) <= 64:
        return clean
    digest = hashlib.sha1(run_id.encode("utf-8")).hexdigest()[:8]
    return f"{clean[:55]}-{digest}"


class WandbTracker(Tracker):
    def __init__(self, cfg: WandbConfig, *, run_id: str, run_dir: str, hparams: Mapping[str, Any], resume_step: int | None):
        try:
            import wandb
        except ImportError as e:  # pragma: no cover - wandb is a declared optional dependency
            raise ImportError("the wandb tracker needs wandb: pip install 'lm-pipeline[wandb]'") from e
        # wandb writes local files; with a remote run_dir they go to $WANDB_DIR or ./wandb.
        wandb_dir = os.environ.get("WANDB_DIR") or fs.as_local(run_dir)
        if wandb_dir:
            os.makedirs(wandb_dir, exist_ok=True)
        self.run = wandb.init(
            project=cfg.project,
            entity=cfg.entity,
            name=cfg.name or run_id,
            id=cfg.id or wandb_run_id(run_id),
            group=cfg.group,
            tags=list(cfg.tags) or None,
            resume=cfg.resume,
            mode=cfg.mode,
            save_code=cfg.save_code,
            config=dict(hparams),
            dir=wandb_dir,
            reinit="create_new",
        )
        del resume_step  # wandb continues the run by id; it ignores steps below its last one

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        self.run.log(_clean_metrics(metrics), step=int(step))

    def log_summary(self, metrics: Mapping[str, Any]) -> None:
        self.run.summary.update(_clean_metrics(metrics))

    def finish(self) -> None:
        self.run.finish()


class CompositeTracker(Tracker):
    """Fans out to several trackers. Failures of non-critical ones (wandb, TensorBoard) are
    logged (with a traceback the first time) and do not stop training; critical ones raise."""

    def __init__(self, trackers: Sequence[Tracker], critical: Sequence[bool] | None = None):
        self.trackers = list(trackers)
        self.critical = list(critical) if critical is not None else [True] * len(self.trackers)
        self._failures = [0] * len(self.trackers)

    def _each(self, method: str, *args: Any) -> None:
        error: Exception | None = None
        for i, t in enumerate(self.trackers):
            try:
                getattr(t, method)(*args)
            except Exception as e:
                if self.critical[i]:
                    error = error or e  # still give the other trackers their call
                    continue
                self._failures[i] += 1
                if self._failures[i] == 1:
                    log.exception("tracker %s failed in %s; continuing without it for this call", type(t).__name__, method)
                else:
                    log.warning("tracker %s failed in %s (%d failures)", type(t).__name__, method, self._failures[i])
        if error is not None:
            raise error

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        self._each("log", metrics, step)

    def log_summary(self, metrics: Mapping[str, Any]) -> None:
        self._each("log_summary", metrics)

    def flush(self) -> None:
        self._each("flush")

    def finish(self) -> None:
        self._each("finish")


# --- configuration ----------------------------------------------------------------------------


class TrackerConfig(Choice):
    """Family of trackers, selected by ``type:`` (jsonl, tensorboard, wandb, noop)."""

    default_type: ClassVar[str] = "wandb"  # Levanter: a tracker mapping without a type is wandb

    def build(self, *, run_id: str, run_dir: str, hparams: Mapping[str, Any], resume_step: int | None) -> Tracker:
        raise NotImplementedError


@TrackerConfig.register("jsonl")
@dataclass(frozen=True)
class JsonlTrackerConfig(TrackerConfig):
    """An extra JSONL metrics log (``<run_dir>/metrics.jsonl`` is always written anyway)."""

    type: Literal["jsonl"] = field("jsonl", help="A JSONL metrics log.", semantic=False)
    path: str | None = field(None, help="Another file for the same JSONL log; null = only <run_dir>/metrics.jsonl.", semantic=False)

    def build(self, *, run_id: str, run_dir: str, hparams: Mapping[str, Any], resume_step: int | None) -> Tracker:
        if self.path is None or fs.norm(self.path) == fs.norm(join(run_dir, METRICS_FILE)):
            return NoopTracker()  # the always-on log
        return JsonlTracker(self.path, resume_step=resume_step)


@TrackerConfig.register("tensorboard")
@dataclass(frozen=True)
class TensorboardConfig(TrackerConfig):
    type: Literal["tensorboard"] = field("tensorboard", help="TensorBoard event files (tensorboardX).", semantic=False)
    logdir: str | None = field(None, help="Event files go to <logdir>/<run_id>; default <run_dir>/tensorboard.", semantic=False)

    def build(self, *, run_id: str, run_dir: str, hparams: Mapping[str, Any], resume_step: int | None) -> Tracker:
        base = self.logdir if self.logdir is not None else join(run_dir, "tensorboard")
        return TensorboardTracker(join(base, run_id), resume_step=resume_step, hparams=hparams)


@TrackerConfig.register("wandb")
@dataclass(frozen=True)
class WandbConfig(TrackerConfig):
    type: Literal["wandb"] = field("wandb", help="Weights & Biases.", semantic=False)
    project: str | None = field(None, help="wandb project (default: wandb's).", semantic=False)
    entity: str | None = field(None, help="wandb entity (default: your default entity).", semantic=False)
    tags: tuple[str, ...] = field((), help="Tags for the run.", semantic=False)
    id: str | None = field(None, help="wandb run id; default derived from the run id, so resuming continues the same wandb run.", semantic=False)
    name: str | None = field(None, help="Display name (default: the run id).", semantic=False)
    group: str | None = field(None, help="wandb group.", semantic=False)
    resume: bool | Literal["allow", "must", "never"] = field("allow", help="wandb's resume policy for the run id.", semantic=False)
    mode: Literal["online", "offline", "disabled"] | None = field(None, help="online, offline (no network; `wandb sync` later) or disabled; null = $WANDB_MODE or online.", semantic=False)
    save_code: bool = field(True, help="Let wandb save the main script.", semantic=False)

    def validate(self) -> None:
        if self.id is not None and (not _WANDB_ID_OK.match(self.id) or len(self.id) > 64):
            raise ConfigError("id", f"{self.id!r}: use at most 64 letters, digits, '_', '.', '-'")

    def build(self, *, run_id: str, run_dir: str, hparams: Mapping[str, Any], resume_step: int | None) -> Tracker:
        return WandbTracker(self, run_id=run_id, run_dir=run_dir, hparams=hparams, resume_step=resume_step)

    def start_problem(self) -> str | None:
        """Why this tracker could not start on this machine (no wandb package; online mode without an
        API key in $WANDB_API_KEY or a netrc entry for the wandb host), or None. Imports no wandb."""
        import importlib.util

        mode = self.mode or os.environ.get("WANDB_MODE") or "online"
        if mode in ("offline", "disabled", "dryrun"):
            return None
        if importlib.util.find_spec("wandb") is None:
            return "the wandb tracker needs wandb: pip install 'lm-pipeline[wandb]'"
        if os.environ.get("WANDB_API_KEY") or _netrc_has(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")):
            return None
        return ("wandb cannot start: no API key (WANDB_API_KEY is unset and no netrc entry for the wandb host); "
                "run `wandb login`, set WANDB_API_KEY, set WANDB_MODE=offline (or mode: offline) to log locally "
                "and `wandb sync` later, or remove the tracker")


def _netrc_has(url: str) -> bool:
    """Whether the user's netrc file (``$NETRC`` or ``~/.netrc``) has a password for ``url``'s host."""
    import netrc
    from urllib.parse import urlparse

    path = os.environ.get("NETRC") or os.path.expanduser("~/.netrc")
    try:
        entry = netrc.netrc(path).authenticators(urlparse(url).hostname or "")
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(entry and entry[2])


def tracker_problems(configs: Sequence[TrackerConfig]) -> list[tuple[str, str]]:
    """(config field, one-line problem) for each configured tracker that could not start here."""
    out = []
    for i, cfg in enumerate(configs):
        problem = getattr(cfg, "start_problem", lambda: None)()
        if problem:
            out.append((f"trainer.tracker[{i}]", problem))
    return out


@TrackerConfig.register("noop")
@dataclass(frozen=True)
class NoopTrackerConfig(TrackerConfig):
    type: Literal["noop"] = field("noop", help="No tracker besides the always-on JSONL log.", semantic=False)

    def build(self, *, run_id: str, run_dir: str, hparams: Mapping[str, Any], resume_step: int | None) -> Tracker:
        return NoopTracker()


def build_tracker(
    configs: Sequence[TrackerConfig],
    *,
    run_id: str,
    run_dir: str,
    hparams: Mapping[str, Any],
    resume_step: int | None,
    primary: bool = True,
) -> Tracker:
    """The run's tracker: the JSONL log at ``<run_dir>/metrics.jsonl`` plus the configured ones.

    ``resume_step``: None for a fresh run (any old log in ``run_dir`` is replaced); else the
    first step the resumed run will log again: records with ``step >= resume_step`` are
    dropped (TensorBoard: purged). A trainer that logs a step's metrics under the number of
    completed steps (``state.step + 1``) and resumes from a checkpoint with ``state.step == s``
    passes ``s + 1``, so the lines logged for step ``s`` before the interruption are kept.
    ``run_dir`` may be an fsspec URL (see :class:`JsonlTracker`). ``hparams`` are redacted first. ``primary=False``
    (a non-zero process of a multi-host job) gives a tracker that writes nothing.
    """
    if not primary:
        return NoopTracker()
    if resume_step is not None and resume_step < 0:
        raise ValueError(f"resume_step must be >= 0, got {resume_step}")
    clean = redact(hparams)
    trackers: list[Tracker] = [
        JsonlTracker(
            join(run_dir, METRICS_FILE),
            resume_step=resume_step,
            summary_path=join(run_dir, SUMMARY_FILE),
        )
    ]
    critical = [True]
    try:
        for cfg in configs:
            t = cfg.build(run_id=run_id, run_dir=run_dir, hparams=clean, resume_step=resume_step)
            if not isinstance(t, NoopTracker):
                trackers.append(t)
                critical.append(isinstance(t, JsonlTracker))
    except BaseException:
        for t in trackers:
            with contextlib.suppress(Exception):
                t.finish()
        raise
    return CompositeTracker(trackers, critical)

