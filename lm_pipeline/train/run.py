"""``train(config)``: the recipe, read top to bottom.

config -> mesh -> data -> step functions -> state (resume, initialize_from, or fresh) ->
trackers -> loop (step, log, eval, checkpoint, hooks) -> final checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from tqdm.auto import tqdm

from lm_pipeline.batch import SequenceDataset, StepBatchSource
from lm_pipeline.config import RunConfig, dump_config
from lm_pipeline.data.loader import Prefetcher
from lm_pipeline.data.mixture import MixtureBatchSource, mixture_num_steps, mixture_source
from lm_pipeline.estimate import resolve_auto_parallelism
from lm_pipeline.faultpoints import faultpoint
from lm_pipeline.fingerprint import fingerprint
from lm_pipeline.hf.start import hf_source_files as _hf_source_files
from lm_pipeline.hf.start import model_vocab_size
from lm_pipeline.schema import ConfigError, to_dict
from lm_pipeline.train.batch_schedule import (
    BatchSchedule,
    ScheduledBatchSource,
    ScheduledMixtureSource,
    scheduled_mixture,
)
from lm_pipeline.train.checkpoint import Checkpointer, latest_checkpoint
from lm_pipeline.train.guard import FiniteStateCheckpointer
from lm_pipeline.train.precompile import AheadStep
from lm_pipeline.train.profiling import StepProfiler
from lm_pipeline.train.runlog import setup_logging
from lm_pipeline.train.sharding import MeshPlan, initialize_distributed, make_mesh
from lm_pipeline.train.trackers import build_tracker
from lm_pipeline.train.trainer import (
    Hook,
    StepFunctions,
    StepInfo,
    TrainResult,
    TrainState,
    build_step_functions,
    device_peak_flops,
    evaluate_datasets,
    put_batch,
    step_args,
)
from lm_pipeline.xla_cache import enable as enable_xla_cache

log = logging.getLogger(__name__)

TRAIN_CODE_VERSION = 1  # run ids of existing runs hash this value: keep it, whatever the stage table says


def run_id_for(cfg: RunConfig, data_fingerprint: str | None = None) -> str:
    """A run's id when ``train`` is called without one: ``trainer.id`` if given, else ``run-`` and
    :func:`~lm_pipeline.fingerprint.fingerprint` of the ``train_ckpt`` stage over the run's
    semantic config (:mod:`lm_pipeline.train.run_identity`, the pipeline's too) with the data's
    fingerprint as input.

    The pipeline names its runs by the ``train_ckpt`` address instead (``Pipeline.run_id``), which
    also covers packing and the token cache's address; this form is kept for library callers, so
    that their existing runs keep their ids (and resume)."""
    from lm_pipeline.train.run_identity import run_semantics, start_weights

    if cfg.trainer.id:
        return cfg.trainer.id
    inputs = {"data": data_fingerprint or "", **start_weights(cfg)}
    return "run-" + fingerprint("train_ckpt", run_semantics(cfg), TRAIN_CODE_VERSION, inputs)


def _find_resume_path(cfg: RunConfig, run_dir: str) -> str | None:
    tc = cfg.trainer
    if tc.load_checkpoint is False:
        return None
    search = tc.load_checkpoint_path or run_dir
    path = latest_checkpoint(search)
    if path is None and (tc.load_checkpoint is True or tc.load_checkpoint_path):
        raise ConfigError(
            "trainer.load_checkpoint_path" if tc.load_checkpoint_path else "trainer.load_checkpoint",
            f"no complete checkpoint found under {search}",
        )
    return path


@dataclass
class _Run:
    """What the loop needs, settled before the first step."""

    cfg: RunConfig
    plan: MeshPlan
    num_steps: int
    run_id: str
    run_dir: str
    source: StepBatchSource | MixtureBatchSource
    fns: StepFunctions
    checkpointer: Checkpointer
    vocab_size: int = 0  # the model's embedding rows (the tokenizer's, or a Hugging Face start's padded ones)
    first_batch: Any = None  # step 0's batch (host arrays): the shapes the train step is compiled for first

    @property
    def tokens_per_step(self) -> int:
        """Tokens of step 0 (a batch-size schedule's first size; :meth:`tokens_at` for any step)."""
        return self.tokens_at(0)

    def tokens_at(self, step: int) -> int:
        """Tokens of step ``step`` (0-based): its batch size (a schedule's, at that step) x seq_len."""
        return self.schedule.batch_size_at(step) * self.cfg.model.seq_len

    @property
    def schedule(self) -> BatchSchedule:
        return self.cfg.trainer.batch_schedule


def train(
    cfg: RunConfig,
    *,
    train_data: SequenceDataset | Mapping[str, SequenceDataset],
    vocab_size: int,
    eval_data: Mapping[str, SequenceDataset] | None = None,
    eval_bytes_per_token: Mapping[str, float] | None = None,
    data_fingerprint: str | None = None,
    run_id: str | None = None,
    run_dir: str | None = None,
    extra_checkpoint_files: Mapping[str, str | bytes] | None = None,
    hooks: Sequence[Hook] = (),
) -> TrainResult:
    """Train ``cfg.model`` on ``train_data``; resume automatically from the run's checkpoints.

    Args:
        train_data: packed training sequences (the token cache's layout, or any SequenceDataset);
            or a mixture's components by name, mixed as ``cfg.data`` says (:func:`mixture_source`).
        vocab_size: the tokenizer's vocabulary size (a run that starts from a Hugging Face model
            whose embedding has more rows, a padded vocabulary, keeps that model's rows).
        eval_data: named validation sets, evaluated every ``trainer.steps_per_eval`` steps.
        eval_bytes_per_token: per validation set, UTF-8 bytes per token of its text, for the
            ``eval/<set>/bpb`` metric (the set's average; the eval report counts bytes exactly).
        run_id: names the run (logs, trackers); default derived from the config's fingerprint.
        run_dir: where checkpoints and logs go; default ``<checkpointer.base_path>/<run_id>``.
        extra_checkpoint_files: files copied into every ``step-N`` dir (e.g. the tokenizer).
        hooks: user callbacks run every N steps; a hook may return metrics to log.
    """
    enable_xla_cache(cfg.store.root)  # compiled programs from an earlier run of these shapes: no recompiling
    run = _prepare(cfg, train_data, vocab_size, data_fingerprint, run_id, run_dir)
    cfg, tc, num_steps = run.cfg, run.cfg.trainer, run.num_steps
    state, resume_path = _compile_ahead_and_restore_or_init(run)
    start = int(state.step)
    tracker = build_tracker(tc.tracker, run_id=run.run_id, run_dir=run.run_dir, hparams=to_dict(cfg),
                            resume_step=start + 1 if resume_path else None, primary=jax.process_index() == 0)
    result = TrainResult(state=state, final_step=start, resumed_from=resume_path)
    evaluator = _Evaluator(run, eval_data or {}, eval_bytes_per_token or {}, tracker, result)
    meter = _StepMeter(run, tracker, start, run.vocab_size)
    files = {"config.yaml": dump_config(cfg), **_hf_source_files(cfg), **(extra_checkpoint_files or {})}
    # Batches are read and placed on devices ahead of the step, on a background thread.
    batches = Prefetcher(run.source, start, num_steps=num_steps - start, depth=2, put=lambda b: put_batch(b, run.plan))
    fns = run.fns
    profiler = StepProfiler(tc, run.run_id, num_steps)
    try:
        for step, batch in batches:
            profiler.before(step)
            with run.plan.mesh:
                state, metrics = fns.train_step_for(run.schedule.batch_size_at(step))(state, *step_args(fns, batch))
            done = step + 1
            profiler.after(done, state)
            faultpoint("train.after_step")
            meter.after_step(step, metrics)
            eval_loss = evaluator(state, done) if evaluator.due(done) else None
            for hook in hooks:
                if done % hook.every == 0:
                    extra = hook.fn(StepInfo(done, state, meter.last or {}))
                    if extra:
                        tracker.log(dict(extra), step=done)
            path = run.checkpointer.maybe_save(done, state, force=done == num_steps, extra_files=files,
                                               metadata={"run_id": run.run_id}, eval_loss=eval_loss,
                                               before_save=tracker.flush)
            if path:
                result.checkpoints.append(path)
        run.checkpointer.wait()
    except BaseException:
        # Let a checkpoint that is being written (of a good, earlier state) complete.
        with contextlib.suppress(Exception):
            run.checkpointer.wait()
        raise
    finally:
        profiler.stop()
        batches.close()
        meter.close()
    return _finish(run, result, state, meter, tracker)


def _prepare(cfg: RunConfig, train_data: SequenceDataset | Mapping[str, SequenceDataset], vocab_size: int,
             data_fingerprint: str | None, run_id: str | None, run_dir: str | None) -> _Run:
    """Mesh, step count, run id and directory, batch source, step functions, checkpointer."""
    tc = cfg.trainer
    initialize_distributed(tc.distributed)
    plan = make_mesh(tc)
    seq_len = cfg.model.seq_len
    if not isinstance(tc.train_batch_size, int):  # a batch-size schedule (lm_pipeline.train.batch_schedule)
        source, num_steps = _scheduled_source(cfg, train_data)
    elif isinstance(train_data, Mapping):  # a mixture's components (lm_pipeline.data.mixture)
        source = mixture_source(cfg.data, train_data, tc.train_batch_size, tc.seed)
        num_steps = mixture_num_steps(source, tc, seq_len)
    else:
        source = StepBatchSource(train_data, tc.train_batch_size, tc.seed,
                                 process_index=jax.process_index(), process_count=jax.process_count(),
                                 shuffle=cfg.data.shuffle, era_length=cfg.data.era_length)
        num_steps = tc.resolve_num_steps(_num_rows(train_data, cfg), seq_len)
    if source.seq_len != seq_len:
        raise ConfigError("model.seq_len", f"is {seq_len} but the training data is packed to {source.seq_len}")
    run_id = run_id or run_id_for(cfg, data_fingerprint)
    run_dir = run_dir or f"{(tc.checkpointer.base_path or 'checkpoints').rstrip('/')}/{run_id}"
    setup_logging(tc.log_dir, run_id)
    logging.getLogger("absl").setLevel(logging.WARNING)  # Orbax logs every internal step at INFO
    log.info("run %s: %d steps, batch %s x %d tokens, %d devices (data %d x model %d)",
             run_id, num_steps, tc.train_batch_size if isinstance(tc.train_batch_size, int) else tc.batch_schedule, seq_len, jax.device_count(), plan.data_size, plan.model_size)
    first = source.batch(0)
    has_segments = first.segment_ids is not None
    # a chat source's loss mask: its rows train on the assistant's tokens only (lm_pipeline.data.chat)
    has_loss_mask = first.loss_mask is not None or bool(getattr(cfg.data, "chat_sources", dict)())
    vocab_size = model_vocab_size(cfg, vocab_size)  # a Hugging Face start keeps its padded vocabulary
    if tc.per_device_parallelism == "auto":
        cfg = resolve_auto_parallelism(cfg, jax.device_count(), vocab_size, segments=has_segments)
    fns = build_step_functions(cfg.model, cfg.optimizer, cfg.trainer, vocab_size=vocab_size, num_train_steps=num_steps,
                               plan=plan, has_segments=has_segments, has_loss_mask=has_loss_mask)
    checkpointer = FiniteStateCheckpointer(cfg.trainer.checkpointer, base_path_override=run_dir)
    return _Run(cfg, plan, num_steps, run_id, run_dir, source, fns, checkpointer, vocab_size, first)


def _compile_ahead_and_restore_or_init(run: _Run) -> tuple[TrainState, str | None]:
    """:func:`_restore_or_init`, the first train step compiling on a thread meanwhile (CPU runs:
    :class:`~lm_pipeline.train.precompile.AheadStep` replaces ``run.fns.train_step``)."""
    if run.fns.compute.platform == "cpu":
        first = step_args(run.fns, put_batch(run.first_batch, run.plan))
        ahead = AheadStep(run.fns.train_step, run.fns.abstract_state, first, run.plan.mesh)
        run.fns = dataclasses.replace(run.fns, train_step=ahead)
    try:
        return _restore_or_init(run)
    except BaseException:
        if isinstance(run.fns.train_step, AheadStep):
            run.fns.train_step.ready()  # the error is raised once the compilation has ended
        raise


def _scheduled_source(cfg: RunConfig, train_data: SequenceDataset | Mapping[str, SequenceDataset]
                      ) -> tuple[ScheduledBatchSource | ScheduledMixtureSource, int]:
    """The batch source and length of a run with a batch-size schedule: step k reads the rows at
    positions [offset(k), offset(k) + size(k)) of the row order a fixed-batch run has."""
    tc, schedule = cfg.trainer, cfg.trainer.batch_schedule
    procs = {"process_index": jax.process_index(), "process_count": jax.process_count()}
    if isinstance(train_data, Mapping):  # a mixture: its phases start at the rows of their steps
        source = scheduled_mixture(cfg.data, train_data, schedule, tc.seed, **procs)
        return source, mixture_num_steps(source, tc, source.seq_len)
    order = StepBatchSource(train_data, 1, tc.seed, shuffle=cfg.data.shuffle, era_length=cfg.data.era_length)
    return (ScheduledBatchSource(order, schedule, **procs),
            tc.resolve_num_steps(_num_rows(train_data, cfg), order.seq_len))


def _num_rows(train_data: SequenceDataset, cfg: RunConfig) -> int:
    """The training rows, for a run length given in epochs. A dataset still being written (a
    token cache under construction) is waited for only when the run length needs its size."""
    rows_ready = getattr(train_data, "rows_ready", None)
    tc = cfg.trainer
    by_epochs = tc.num_epochs is not None and tc.num_train_steps is None and tc.train_tokens is None
    if rows_ready is not None and (by_epochs or tc.max_epochs is not None):
        log.info("trainer.num_epochs needs the training data's size: waiting for the token cache to be complete")
        return int(rows_ready(sys.maxsize))
    return len(train_data)


#: Errors of a checkpoint's bytes (TensorStore / Orbax status texts), as opposed to a mismatch
#: between the checkpoint and the model (which must never move a good checkpoint aside).
_DAMAGE = ("DATA_LOSS", "NOT_FOUND", "No such file", "corrupt", "Error decoding", "truncated", "OUT_OF_RANGE")


def _damage(path: str, checkpointer: Checkpointer, abstract_state) -> tuple[list[str], Any]:
    """(what is wrong with checkpoint ``path``, its state if intact)."""
    from lm_pipeline.train.checkpoint import read_metadata, verify

    problems = verify(path, read_metadata(path))
    if problems:
        return problems, None
    try:
        with_state = checkpointer.load(path, abstract_state)
    except Exception as e:  # Orbax wraps TensorStore's status in a plain Exception
        chain, err = [], e
        while err is not None and len(chain) < 8:
            chain.append(err)
            err = err.__cause__ or err.__context__
        damaged = next((c for c in chain if any(mark in str(c) for mark in _DAMAGE)), None)
        if damaged is None:
            raise
        return [f"unreadable ({str(damaged).splitlines()[0][:200]})"], None
    return [], with_state


def _resume_from_intact(run: _Run) -> tuple[str | None, Any]:
    """The newest intact checkpoint of the run and its state (None, None: start afresh).

    A damaged checkpoint (a file missing, truncated or altered since it was written, or arrays
    that cannot be read) of the run's own directory is moved aside to ``.damaged/`` with a one-line
    warning, and the next older one is tried. A checkpoint named by ``trainer.load_checkpoint_path``
    is the user's: damage there is an error naming it."""
    from lm_pipeline.train.checkpoint import move_aside

    with run.plan.mesh:
        while True:
            path = _find_resume_path(run.cfg, run.run_dir)
            if path is None:
                return None, None
            problems, state = _damage(path, run.checkpointer, run.fns.abstract_state)
            if not problems:
                return path, state
            what = f"checkpoint {path} is damaged: {'; '.join(problems[:3])}" + (
                f" (and {len(problems) - 3} more)" if len(problems) > 3 else "")
            if run.cfg.trainer.load_checkpoint_path or jax.process_count() > 1:
                raise ConfigError("trainer.load_checkpoint_path" if run.cfg.trainer.load_checkpoint_path
                                  else "trainer.load_checkpoint",
                                  f"{what}; point trainer.load_checkpoint_path at an intact checkpoint")
            moved = move_aside(path)
            log.warning("%s; moved it aside to %s and resuming from the newest intact checkpoint", what, moved)


def _restore_or_init(run: _Run) -> tuple[TrainState, str | None]:
    """The run's latest complete checkpoint, else a fresh state (weights from
    ``trainer.initialize_from`` if set); and the checkpoint resumed from, if any."""
    tc = run.cfg.trainer
    resume_path, state = _resume_from_intact(run)
    with run.plan.mesh:
        if resume_path is not None:
            log.info("resumed from %s at step %d", resume_path, int(state.step))
        else:
            state = run.fns.init(jax.random.key_data(jax.random.key(tc.seed)))
            from lm_pipeline.hf.start import is_hf_model_dir

            if tc.initialize_from and is_hf_model_dir(tc.initialize_from):  # a Hugging Face directory
                state = _initialize_from_hf(state, run.cfg, tc.initialize_from)
            elif tc.initialize_from:
                state = _initialize_from(state, tc.initialize_from, run.checkpointer, run.fns)
            elif run.cfg.initialize_from_hf:
                state = _initialize_from_hf(state, run.cfg, run.cfg.initialize_from_hf)
    return state, resume_path


class _Evaluator:
    """Evaluates the validation sets every ``trainer.steps_per_eval`` steps and at the end;
    logs ``eval/<set>/loss`` (and ``bpb``), the token-weighted and macro means."""

    def __init__(self, run: _Run, eval_data: Mapping[str, SequenceDataset], bytes_per_token: Mapping[str, float],
                 tracker: Any, result: TrainResult):
        tc, plan = run.cfg.trainer, run.plan
        self.run, self.data, self.bytes_per_token, self.tracker, self.result = run, eval_data, bytes_per_token, tracker, result
        per_device = tc.per_device_eval_parallelism if tc.per_device_eval_parallelism > 0 else max(
            1, tc.batch_schedule.max_size // plan.data_size)  # a schedule: its largest batch, as Levanter
        self.batch_size = per_device * plan.data_size

    def due(self, done: int) -> bool:
        return bool(self.data) and (done % self.run.cfg.trainer.steps_per_eval == 0 or done == self.run.num_steps)

    def __call__(self, state: TrainState, step: int) -> float:
        t0 = time.perf_counter()
        with self.run.plan.mesh:
            res = evaluate_datasets(self.run.fns, state, self.data, self.run.plan, batch_size=self.batch_size,
                                    max_batches=self.run.cfg.trainer.max_eval_batches)
        metrics: dict[str, float] = {}
        for name, r in res.items():
            metrics[f"eval/{name}/loss"] = r["loss"]
            if self.bytes_per_token.get(name):
                metrics[f"eval/{name}/bpb"] = r["loss"] / math.log(2) / self.bytes_per_token[name]
        total_tokens = sum(r["tokens"] for r in res.values())
        metrics["eval/loss"] = sum(r["loss"] * r["tokens"] for r in res.values()) / max(total_tokens, 1.0)
        metrics["eval/macro_loss"] = float(np.mean([r["loss"] for r in res.values()]))
        metrics["eval/seconds"] = time.perf_counter() - t0
        self.tracker.log(metrics, step=step)
        self.result.eval_history.append({"step": step, **metrics})
        log.info("eval at step %d: %s", step, ", ".join(f"{k}={v:.4f}" for k, v in metrics.items() if k.endswith("loss")))
        return metrics["eval/loss"]


class _StepMeter:
    """The progress bar, and every ``trainer.log_every`` steps the step's metrics with learning
    rate, throughput and MFU logged; a non-finite loss stops the run unless bad steps are skipped."""

    def __init__(self, run: _Run, tracker: Any, start: int, vocab_size: int):
        tc = run.cfg.trainer
        self.run, self.tracker = run, tracker
        self.bar = tqdm(total=run.num_steps, initial=start, desc="train", unit="step",
                        disable=None if tc.progress else True, dynamic_ncols=True)
        self.flops_per_token = run.cfg.model.flops_per_token(vocab_size)
        self.peak = device_peak_flops()
        self.lr_at = run.cfg.optimizer.lr_scheduler(run.num_steps)
        self.window_t0, self.window_steps, self.window_tokens = time.perf_counter(), 0, 0
        self.t_start = time.perf_counter()
        self.last: dict[str, Any] | None = None

    def after_step(self, step: int, metrics: Mapping[str, Any]) -> None:
        done, num_steps = step + 1, self.run.num_steps
        self.window_steps += 1
        self.window_tokens += self.run.tokens_at(step)
        self.bar.update(1)
        if done % self.run.cfg.trainer.log_every and done != num_steps:
            return
        host = {k: float(v) for k, v in jax.device_get(dict(metrics)).items()}
        if not math.isfinite(host["train/loss"]) and not self.run.cfg.optimizer.skip_bad_steps:
            raise FloatingPointError(
                f"non-finite training loss at step {done}; not saving a checkpoint. Resume from the last "
                "checkpoint with a lower optimizer.learning_rate (or a higher optimizer.warmup), check the "
                "data, or set optimizer.skip_bad_steps: true to skip such steps"
            )
        dt = time.perf_counter() - self.window_t0
        tps = self.window_tokens / max(dt, 1e-9)
        if "optim/learning_rate" not in host:  # a step that does not report it (the schedule, on the host)
            host["optim/learning_rate"] = float(self.lr_at(step))
        host["throughput/tokens_per_second"] = tps
        host["throughput/step_seconds"] = dt / self.window_steps
        if not self.run.schedule.is_constant:  # what a batch-size schedule changes: the batch and tokens so far
            host["train/batch_size"] = float(self.run.schedule.batch_size_at(step))
            host["throughput/total_tokens"] = float(self.run.schedule.offset_at(done) * self.run.cfg.model.seq_len)
        if self.peak:
            host["throughput/mfu"] = self.flops_per_token * tps / (self.peak * jax.device_count())
        self.tracker.log(host, step=done)
        self.bar.set_postfix(loss=f"{host['train/loss']:.3f}", tok_s=f"{tps:,.0f}")
        self.last = host
        self.window_t0, self.window_steps, self.window_tokens = time.perf_counter(), 0, 0

    def close(self) -> None:
        self.bar.close()


def _finish(run: _Run, result: TrainResult, state: TrainState, meter: _StepMeter, tracker: Any) -> TrainResult:
    """The result's final metrics (last logged step and last evaluation), trackers closed, plots."""
    result.state = state
    result.final_step = int(state.step)
    result.metrics = dict(meter.last or {})
    if result.eval_history:
        result.metrics.update({k: v for k, v in result.eval_history[-1].items() if k != "step"})
    result.train_seconds = time.perf_counter() - meter.t_start
    tracker.log_summary(result.metrics)
    tracker.finish()
    if jax.process_index() == 0:  # loss / lr / bpb / tokens/s PNGs beside the checkpoints (local or on a bucket)
        from lm_pipeline.plots import write_training_plots

        write_training_plots(run.run_dir)
    if result.metrics:
        log.info("finished %s at step %d: %s", run.run_id, result.final_step, json.dumps(result.metrics))
    return result


def _initialize_from(state: TrainState, path: str, checkpointer: Checkpointer, fns) -> TrainState:
    """New run, weights from another run's checkpoint; step and optimizer state start fresh."""
    found = latest_checkpoint(path)
    if found is None:
        raise ConfigError("trainer.initialize_from", f"no complete checkpoint found under {path} (a step-<N> dir with "
                          "checkpoint.json, or a Hugging Face model directory with config.json and *.safetensors; "
                          "for a hub repo use initialize_from_hf)")
    loaded = checkpointer.load(found, fns.abstract_state)
    log.info("initialized weights from %s", found)
    return TrainState(state.step, loaded.model, state.opt_state, state.key)


def _initialize_from_hf(state: TrainState, cfg: RunConfig, source: str) -> TrainState:
    """New run, weights from a Hugging Face model (``initialize_from_hf``), placed with the fresh
    state's shardings and dtypes; step and optimizer state start fresh."""
    import equinox as eqx

    from lm_pipeline.hf.load import load_hf_checkpoint

    _, hf_model = load_hf_checkpoint(source, config=cfg.model, use_hf_model_config=False)
    new_leaves, new_def = jax.tree_util.tree_flatten(eqx.filter(hf_model, eqx.is_array))
    old_leaves, old_def = jax.tree_util.tree_flatten(eqx.filter(state.model, eqx.is_array))
    if new_def != old_def:
        raise ConfigError("initialize_from_hf", f"{source}: the weights do not fit model ({cfg.model.type})")
    placed = []
    for new, old in zip(new_leaves, old_leaves, strict=True):
        if tuple(new.shape) != tuple(old.shape):
            fix = ("model: must describe the weights' shape" if cfg.use_hf_model_config
                   else "set use_hf_model_config: true to take the shape from its config.json")
            raise ConfigError(
                "initialize_from_hf",
                f"{source}: a weight of shape {tuple(new.shape)} where the model has {tuple(old.shape)} ({fix})")
        placed.append(jax.device_put(new.astype(old.dtype), old.sharding))
    model = eqx.combine(jax.tree_util.tree_unflatten(old_def, placed), state.model)
    log.info("initialized weights from Hugging Face model %s", source)
    return TrainState(state.step, model, state.opt_state, state.key)
