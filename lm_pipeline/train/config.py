"""Trainer configuration: run length, batch and parallelism, precision, mesh, distributed start-up.

Field names follow Levanter's ``TrainerConfig``; the spellings used in Levanter's guides
(``batch_size``, ``per_device_train_parallelism``, ``eval_per_device_parallelism``,
``trainer.wandb.*``) are accepted as aliases. So are LLM-Trainer's (``docs/llm-trainer.md``):
``gradient_accumulation_steps`` (a field), ``eval_steps``, ``logging_steps``,
``per_device_batch_size`` (aliases), and ``save_steps``, ``save_total_limit``, ``use_amp``,
``amp_dtype``, ``report_to`` (translated by :meth:`TrainerConfig.normalize_raw`). Note that
``batch_size`` is Levanter's *global* batch here, not LLM-Trainer's per-device one.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Literal

from lm_pipeline.levanter import TRAINER_PROFILER_KEYS as _PROFILER
from lm_pipeline.schema import ConfigError, field, raise_problems
from lm_pipeline.train.batch_schedule import BatchSchedule, BatchStep, normalize_schedule, schedule_problems
from lm_pipeline.train.batch_split import batch_split_problem
from lm_pipeline.train.checkpoint import CheckpointerConfig
from lm_pipeline.train.precision import (  # noqa: F401  (re-exported: the trainer config's policy)
    _DTYPES,
    AUTO_MP,
    MP_FOR_PLATFORM,
    Precision,
    parse_mp,
    parse_mp_names,
    resolve_mp,
)
from lm_pipeline.train.quantization import QuantizationConfig, device_fp8
from lm_pipeline.train.trackers import TrackerConfig


def check_run_id(run_id: str, path: str = "trainer.id") -> str:
    """``run_id`` if it is a plain name, else a :class:`ConfigError` at ``path``: the id names a
    directory (``<base_path>/<id>``) and a log file (``<log_dir>/<id>.log``), so it must stay one."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", run_id) or ".." in run_id:
        raise ConfigError(path, f"{run_id!r} is not a plain name; use letters, digits, '.', '_', '-' "
                          "(no '/', no '..'), e.g. gpt2-small-run1")
    return run_id


@dataclass(frozen=True)
class DistributedConfig:
    """Multi-host start-up through ``jax.distributed.initialize``."""

    coordinator_address: str | None = field(None, help="host:port of process 0; None lets JAX detect SLURM/TPU clusters.", semantic=False)
    num_processes: int | None = field(None, help="Number of processes in the job.", semantic=False)
    process_id: int | None = field(None, help="This process's id, 0..num_processes-1.", semantic=False)
    local_device_ids: tuple[int, ...] | None = field(None, help="Devices this process uses (default: all visible).", semantic=False)
    initialize: bool | None = field(None, help="Call jax.distributed.initialize; None = only when coordinator_address or num_processes is set.", semantic=False)

    def validate(self) -> None:
        if self.num_processes is not None and self.num_processes < 1:
            raise ConfigError("num_processes", "must be >= 1")
        if self.process_id is not None and self.num_processes is not None and not 0 <= self.process_id < self.num_processes:
            raise ConfigError("process_id", f"must be in [0, {self.num_processes})")

    @property
    def enabled(self) -> bool:
        if self.initialize is not None:
            return self.initialize
        return self.coordinator_address is not None or (self.num_processes or 1) > 1


@dataclass(frozen=True)
class TrainerConfig:
    """The training loop: length, batches, parallelism, precision, checkpoints, tracking."""

    seed: int = field(0, help="Random seed: initialisation, data order and dropout.")
    num_train_steps: int | None = field(None, help="Optimizer steps to run. Give this, num_epochs or train_tokens (default 1000 steps).")
    num_epochs: float | None = field(None, help="Run length in passes over the training data, converted to steps from the data size.", semantic=True)
    train_tokens: int | None = field(None, help="Run length as a token budget, converted to steps (rounded up).")
    max_epochs: float | None = field(None, help="A cap on passes over the training data (Levanter's top-level `epoch`): the run stops at its length or after this many epochs, whichever comes first; null = no cap.", hashed_at_default=False)
    z_loss_weight: float = field(0.0, help="Weight of the auxiliary z-loss (Levanter's top-level `z_loss_weight`, PaLM's 1e-4): adds z_loss_weight * mean(logsumexp(logits)^2) over the target tokens to the training loss; 0 = none. Reported losses stay the cross-entropy.", hashed_at_default=False)
    # A schedule: mappings {start, value} checked by normalize_raw (one-line problems naming each
    # entry), held as BatchStep values (hashable) from __post_init__ on.
    train_batch_size: int | tuple[dict[str, int], ...] = field(32, help="Global batch size in sequences: all devices and all accumulated micro-batches of one step (Levanter's batch_size; LLM-Trainer's per-device batch_size is per_device_batch_size); or Levanter's batch-size schedule, a list of {start: STEP, value: SIZE} (first start 0, starts increasing): each step reads the next SIZE rows.", aliases=("batch_size",))
    per_device_parallelism: int | Literal["auto"] = field(
        -1,
        help="Sequences per device per micro-batch; -1 = the whole batch (no gradient accumulation); 'auto' = the largest "
        "that divides the batch and fits device_memory_gib by the estimator (lm-pipeline estimate). Fewer than "
        "batch/devices means gradient accumulation.",
        semantic=False,
        aliases=("per_device_train_parallelism", "per_device_batch_size"),
    )
    gradient_accumulation_steps: int | None = field(
        None,
        help="Micro-batches accumulated per optimizer step (LLM-Trainer's name); null = as per_device_parallelism "
        "says. Each micro-batch is train_batch_size / gradient_accumulation_steps rows over the data-parallel "
        "devices; checked against per_device_parallelism when both are given. Same update up to float rounding.",
        semantic=False,
    )
    device_memory_gib: float | None = field(
        None,
        help="Memory per device that per_device_parallelism: auto may plan for; null = what the accelerator reports "
        "(on CPU: 80% of RAM shared by the local devices).",
        semantic=False,
    )
    per_device_eval_parallelism: int = field(-1, help="Sequences per device per eval batch; -1 = same as training.", semantic=False, aliases=("eval_per_device_parallelism",))
    mp: str = field(
        AUTO_MP,
        help="Mixed precision, e.g. 'p=f32,c=bfloat16' (params f32, compute bf16) or 'f32'; 'm=bf16' rounds only the "
        "projections' and the LM head's operands to bf16 (float32 accumulation, like torch.autocast on CPU): "
        "'p=f32,c=f32,m=bf16' is the fastest policy on CPUs with AVX512-BF16 or AMX. 'auto' = the machine's "
        "default: on CPU p=f32,c=f32,m=bf16 where the CPU has bf16 dot instructions (avx512_bf16, amx_bf16), else "
        "f32; p=f32,c=bfloat16 on GPU and TPU. 'auto' is resolved when the config is loaded, and the resolved "
        "policy is what the fingerprint hashes (name the policy to share runs between kinds of machine).",
    )
    steps_per_eval: int = field(1000, help="Evaluate on the validation sets every this many steps (and at the end).", semantic=False, aliases=("eval_steps",))
    max_eval_batches: int | None = field(None, help="Cap on eval batches per validation set; None = all.", semantic=False)
    log_every: int = field(10, help="Log metrics every this many steps.", semantic=False, aliases=("logging_steps",))
    progress: bool = field(True, help="Show a progress bar with ETA when attached to a terminal.", semantic=False)
    id: str | None = field(None, help="Run id; default derived from the run's fingerprint.", semantic=False)
    log_dir: str = field("logs", help="Python logs go to <log_dir>/<run_id>.log.", semantic=False)
    profiler: bool = field(False, help=_PROFILER["profiler"], semantic=False)
    profiler_start_step: int = field(5, help=_PROFILER["profiler_start_step"], semantic=False)
    profiler_num_steps: int = field(100, help=_PROFILER["profiler_num_steps"], semantic=False)
    checkpointer: CheckpointerConfig = field(default_factory=CheckpointerConfig, help="Where and when to save checkpoints.", semantic=False)
    tracker: tuple[TrackerConfig, ...] = field((), help="Trackers besides the always-on JSONL log: wandb, tensorboard (a mapping or a list).", semantic=False)
    load_checkpoint: bool | None = field(None, help="Resume from the run's latest checkpoint: None = if one exists, true = must exist, false = never.", semantic=False)
    load_checkpoint_path: str | None = field(None, help="Resume from the latest complete checkpoint found (recursively) under this path.", semantic=False, aliases=("resume_from_checkpoint",))
    initialize_from: str | None = field(None, help="Start a new run from the weights of this checkpoint (a step dir or a run dir).")
    batch_axis: str = field("batch", help="Logical axis of the batch (sharded over the mesh's data axis).", semantic=False)
    fsdp_axis: str | tuple[str, ...] | None = field("embed", help="Logical parameter axis (or axes) sharded over the data axis (FSDP/ZeRO-3); null = replicate parameters (plain data parallelism).", semantic=False)
    tensor_parallel_axes: tuple[str, ...] | None = field(None, help="Logical axes sharded over the model axis; default ['mlp', 'heads', 'kv_heads', 'vocab'] when model_axis_size > 1.", semantic=False)
    model_axis_size: int = field(1, help="Devices per tensor-parallel group (the mesh's model axis).", semantic=False)
    axis_resources: dict[str, str | None] | None = field(None, help="Advanced: logical axis -> mesh axis ('data' | 'model'), for both parameters and compute.", semantic=False)
    parameter_axis_resources: dict[str, str | None] | None = field(None, help="Advanced: logical -> mesh axis mapping for parameters at rest.", semantic=False)
    compute_axis_resources: dict[str, str | None] | None = field(None, help="Advanced: logical -> mesh axis mapping during compute.", semantic=False)
    distributed: DistributedConfig = field(default_factory=DistributedConfig, help="Multi-host start-up.", semantic=False)
    quantization: QuantizationConfig | None = field(None, help="Levanter's quantized training ({fp8: true}): checked against the device before any compute and refused there (see its fields); null or all false = none.", hashed_at_default=False)

    def __post_init__(self) -> None:
        if isinstance(self.train_batch_size, (list, tuple)):  # a schedule given in Python: BatchStep entries
            object.__setattr__(self, "train_batch_size", normalize_schedule(self.train_batch_size))
        # ``mp: auto`` becomes the concrete policy here, once, so that everything reading the config
        # (fingerprints and run ids, the compute plan, the estimator, the saved config.yaml, the
        # Pipes child's config) sees the same policy: a CPU run and a GPU run of one ``auto`` config
        # (or runs on CPUs with and without bf16 dot instructions) get different addresses. ``_mp_auto`` remembers the spelling for :meth:`precision_for`.
        if isinstance(self.mp, str) and self.mp.strip().lower() == AUTO_MP:
            try:
                object.__setattr__(self, "mp", resolve_mp(AUTO_MP))
            except ConfigError as e:
                raise ConfigError("mp", e.message) from None
            object.__setattr__(self, "_mp_auto", True)

    @classmethod
    def normalize_raw(cls, data: dict[str, Any]) -> dict[str, Any]:
        from lm_pipeline.levanter import mapped

        data = mapped(_llm_trainer_raw(data), "trainer")  # the profiler keys' log line
        for key in ("train_batch_size", "batch_size"):
            problems = schedule_problems(data.get(key), key)
            if problems:
                raise_problems([ConfigError(where, why) for where, why in problems])
            if key in data:
                value = normalize_schedule(data[key])
                data[key] = value if isinstance(value, int) or not isinstance(value, tuple) else [
                    {"start": e.start, "value": e.value} for e in value]
        tracker = data.get("tracker")
        if isinstance(tracker, dict):
            tracker = [tracker]
        if tracker is not None and not isinstance(tracker, (list, tuple)):
            return data  # not trackers (e.g. `tracker: true`): the field's own check says what they must be
        tracker = [dict(t) if isinstance(t, dict) else t for t in (tracker or [])]
        for t in tracker:
            # Levanter: wandb is the tracker when no type is given.
            if isinstance(t, dict) and "type" not in t and ({"project", "entity", "tags"} & set(t)):
                t["type"] = "wandb"
        wandb = data.pop("wandb", None)
        if wandb is not None:  # Levanter's `--trainer.wandb.project X`
            if not isinstance(wandb, dict):
                raise ConfigError("wandb", "expected a mapping of wandb settings (project, entity, name, id, ...)")
            entry = next((t for t in tracker if isinstance(t, dict) and t.get("type") == "wandb"), None)
            if entry is None:
                entry = {"type": "wandb"}
                tracker.append(entry)
            entry.update(wandb)
        if "tracker" in data or tracker:
            data["tracker"] = tracker
        return data

    def validate(self) -> None:
        if self.id is not None:
            check_run_id(self.id, "id")
        lengths = [n for n in ("num_train_steps", "num_epochs", "train_tokens") if getattr(self, n) is not None]
        if len(lengths) > 1:
            raise ConfigError(lengths[1], f"give only one of num_train_steps, num_epochs, train_tokens (got {', '.join(lengths)})")
        for name in ("num_train_steps", "train_tokens", "steps_per_eval", "log_every", "model_axis_size"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ConfigError(name, f"must be >= 1, got {v}")
        if self.num_epochs is not None and self.num_epochs <= 0:
            raise ConfigError("num_epochs", "must be > 0")
        if self.max_epochs is not None and not self.max_epochs > 0:
            raise ConfigError("max_epochs", f"must be > 0 or null (no cap), got {self.max_epochs}")
        if not (self.z_loss_weight >= 0 and math.isfinite(self.z_loss_weight)):
            raise ConfigError("z_loss_weight", f"must be >= 0, got {self.z_loss_weight}")
        for name in ("per_device_parallelism", "per_device_eval_parallelism"):
            v = getattr(self, name)
            if v != "auto" and (v == 0 or v < -1):
                extra = ", or 'auto'" if name == "per_device_parallelism" else ""
                raise ConfigError(name, f"must be -1 (whole batch) or >= 1{extra}, got {v}")
        if self.device_memory_gib is not None and not self.device_memory_gib > 0:
            raise ConfigError("device_memory_gib", f"must be > 0 or null, got {self.device_memory_gib}")
        if isinstance(self.train_batch_size, int) and self.train_batch_size < 1:
            raise ConfigError("train_batch_size", f"must be >= 1, got {self.train_batch_size}")
        raise_problems([ConfigError(where, why) for where, why in schedule_problems(self.train_batch_size)])
        if not isinstance(self.train_batch_size, int) and not all(
                isinstance(e, BatchStep) for e in self.train_batch_size):
            raise ConfigError("train_batch_size", "expected an integer or a list of {start: STEP, value: SIZE}")
        self._validate_accumulation()
        self._validate_split()
        try:
            parse_mp_names(self.mp)
        except ConfigError as e:
            raise ConfigError("mp", e.message) from None
        if self.max_eval_batches is not None and self.max_eval_batches < 1:
            raise ConfigError("max_eval_batches", "must be >= 1 or null")
        for name in ("axis_resources", "parameter_axis_resources", "compute_axis_resources"):
            for logical, mesh_axis in (getattr(self, name) or {}).items():
                if mesh_axis not in (None, "data", "model"):
                    raise ConfigError(f"{name}.{logical}", f"mesh axis must be 'data', 'model' or null, got {mesh_axis!r}")

    def _validate_split(self, data_size: int | None = None, prefix: str = "") -> None:
        """Every batch size (each entry of a schedule) splits into micro-batches as
        :func:`batch_split_problem` requires; a schedule's problems are reported together, each
        naming its entry."""
        per = self.per_device_parallelism
        per = per if isinstance(per, int) else None
        if isinstance(self.train_batch_size, int):
            problem = batch_split_problem(self.train_batch_size, per_device=per,
                                          accumulation=self.gradient_accumulation_steps, data_size=data_size)
            if problem:
                raise ConfigError(prefix + problem[0], problem[1])
            return
        problems = []
        for i, entry in enumerate(self.train_batch_size):
            problem = batch_split_problem(entry.value, per_device=per, accumulation=self.gradient_accumulation_steps,
                                          data_size=data_size)
            if problem:
                where = f"{prefix}train_batch_size[{i}].value" if problem[0] == "train_batch_size" else prefix + problem[0]
                why = problem[1] if problem[0] == "train_batch_size" else f"at step {entry.start}: {problem[1]}"
                problems.append(ConfigError(where, why))
        raise_problems(problems)

    @property
    def batch_schedule(self) -> BatchSchedule:
        """The batch size and data offset of every step (a plain batch size: one entry)."""
        return BatchSchedule(self.train_batch_size)

    def _validate_accumulation(self) -> None:
        gas, per = self.gradient_accumulation_steps, self.per_device_parallelism
        if gas is None:
            return
        if gas < 1:
            raise ConfigError("gradient_accumulation_steps", f"must be >= 1 (or null), got {gas}")
        if per == "auto":
            raise ConfigError("gradient_accumulation_steps", "give gradient_accumulation_steps or "
                              "per_device_parallelism: auto, not both (auto chooses the accumulation)")

    @property
    def precision(self) -> Precision:
        return parse_mp(self.mp)

    @property
    def mp_is_auto(self) -> bool:
        """Whether ``mp`` was given as ``auto`` (and resolved for this host's platform)."""
        return bool(getattr(self, "_mp_auto", False))

    def precision_for(self, platform: str) -> Precision:
        """The policy a run of this config would use on ``platform``: an ``auto`` policy resolved for
        that platform (the estimator asked about another platform), else :attr:`precision`."""
        return parse_mp(resolve_mp(AUTO_MP, platform)) if self.mp_is_auto else self.precision

    def check_devices(self, num_devices: int) -> None:
        """Errors for settings that cannot work on ``num_devices`` devices, or on their kind
        (quantization), raised before compute."""
        if self.quantization is not None and (self.quantization.fp8 or self.quantization.int8):
            problem = self.quantization.device_problem(*device_fp8())
            if problem is not None:
                raise problem
        if num_devices % self.model_axis_size:
            raise ConfigError(
                "trainer.model_axis_size",
                f"{self.model_axis_size} does not divide the {num_devices} devices; use a divisor of {num_devices}",
            )
        if isinstance(self.train_batch_size, int):
            per = self.per_device_parallelism if isinstance(self.per_device_parallelism, int) else None
            self.micro_batching(num_devices // self.model_axis_size, per)
        else:
            self._validate_split(num_devices // self.model_axis_size, prefix="trainer.")

    def micro_batching(self, data_size: int, per_device: int | None = None, batch_size: int | None = None
                       ) -> tuple[int, int]:
        """(sequences per device per micro-batch, micro-batches accumulated per step) on
        ``data_size`` data-parallel devices (the split decided by
        :func:`lm_pipeline.train.batch_split.batch_split_problem`).

        ``per_device``: the micro-batch per device; None or <= 0 = the whole batch at once.
        With ``gradient_accumulation_steps`` set, the micro-batch is ``train_batch_size /
        (gradient_accumulation_steps x data_size)`` and ``per_device``, when given, must equal it.
        ``batch_size``: the step's batch (one size of a schedule); default ``train_batch_size``,
        which must then be one size.
        """
        gas = self.gradient_accumulation_steps
        batch = self.train_batch_size if batch_size is None else batch_size
        if not isinstance(batch, int):
            raise ValueError("a batch-size schedule has one micro-batch split per size: pass batch_size")
        problem = batch_split_problem(batch, per_device=per_device, accumulation=gas, data_size=data_size)
        if problem:
            raise ConfigError(f"trainer.{problem[0]}", problem[1])
        if gas is not None:
            return batch // gas // data_size, gas
        whole = per_device is None or per_device <= 0
        micro = max(1, batch // data_size if whole else per_device)
        return micro, batch // (micro * data_size)

    def resolve_num_steps(self, num_sequences: int | None, seq_len: int) -> int:
        """Optimizer steps for this run, converting epochs / token budgets with the data size:
        ``ceil(num_epochs * rows / train_batch_size)`` (batches run across epoch boundaries, so
        every row is seen ``num_epochs`` times), ``ceil(train_tokens / (train_batch_size * seq_len))``."""
        steps = self._length_in_steps(num_sequences, seq_len)
        if self.max_epochs is not None:
            steps = min(steps, self._epochs_in_steps(self.max_epochs, num_sequences, "trainer.max_epochs"))
        return steps

    def _length_in_steps(self, num_sequences: int | None, seq_len: int) -> int:
        if self.num_train_steps is not None:
            return self.num_train_steps
        if self.train_tokens is not None and not isinstance(self.train_batch_size, int):  # the schedule's rows
            return max(1, self.batch_schedule.steps_to_reach(self.train_tokens / seq_len))
        if self.train_tokens is not None:
            return -(-self.train_tokens // (self.train_batch_size * seq_len))
        if self.num_epochs is not None:
            return self._epochs_in_steps(self.num_epochs, num_sequences, "trainer.num_epochs")
        return 1000

    def _epochs_in_steps(self, epochs: float, num_sequences: int | None, where: str) -> int:
        if not num_sequences:
            raise ConfigError(where, "needs the training data's size; build the cache first or give num_train_steps")
        # every row seen `epochs` times: the last (partial) batch's worth of rows is a whole step
        if not isinstance(self.train_batch_size, int):
            return max(1, self.batch_schedule.steps_to_reach(epochs * num_sequences))
        return max(1, math.ceil(epochs * num_sequences / self.train_batch_size - 1e-9))


# --- LLM-Trainer's TrainingConfig spellings (docs/llm-trainer.md) ----------------------------

#: ``report_to`` values -> tracker types.
REPORT_TO = {"tensorboard": "tensorboard", "wandb": "wandb"}


def _take(data: dict[str, Any], key: str, section: str | None = None) -> Any:
    """``data.pop(key)``; ConfigError if ``section`` (the field it fills) is given too."""
    if section is not None and section in data:
        raise ConfigError(key, f"given twice (as {key} and as {section}); keep one")
    return data.pop(key)


def amp_to_mp(use_amp: Any, amp_dtype: Any) -> str:
    """LLM-Trainer's ``use_amp`` / ``amp_dtype`` as a ``trainer.mp`` policy: ``use_amp: false`` ->
    ``f32``; ``use_amp: true`` with ``amp_dtype`` -> parameters f32, compute in that dtype (float16
    gets dynamic loss scaling, as PyTorch's GradScaler does); without ``amp_dtype`` -> ``auto``
    (bf16 compute on GPU/TPU; on CPU bf16 matmul operands where it has bf16 dot instructions, else f32)."""
    if not isinstance(use_amp, bool):
        raise ConfigError("use_amp", f"expected true or false, got {use_amp!r}")
    if not use_amp:
        return "f32"
    if amp_dtype is None:
        return AUTO_MP
    if not isinstance(amp_dtype, str) or amp_dtype not in _DTYPES or _DTYPES[amp_dtype] == "float32":
        raise ConfigError("amp_dtype", f"must be 'float16' or 'bfloat16' (or f16, bf16), got {amp_dtype!r}")
    return f"p=f32,c={_DTYPES[amp_dtype]}"


def report_to_trackers(value: Any) -> list[dict[str, Any]]:
    """LLM-Trainer's ``report_to`` (a name or a list: tensorboard, wandb; none / [] = no tracker) as
    ``trainer.tracker`` entries."""
    names = [value] if isinstance(value, str) else value
    if names is None or names == "none":
        return []
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise ConfigError("report_to", f"expected a list of tracker names (tensorboard, wandb), got {value!r}")
    out = []
    for name in names:
        if name == "none":
            continue
        if name not in REPORT_TO:
            raise ConfigError("report_to", f"{name!r} is not a tracker here; use tensorboard or wandb (the "
                              "JSONL metrics log is always written)")
        out.append({"type": REPORT_TO[name]})
    return out


#: LLM-Trainer's TrainingConfig keys (under ``trainer:``; the first two also under ``checkpointer:``).
#: A trainer section spelled with any of them keeps the best model (``checkpointer.keep_best``
#: defaults to true), as LLM-Trainer does.
LLM_TRAINER_KEYS = ("save_steps", "save_total_limit", "checkpoint_dir", "eval_steps", "logging_steps", "use_amp",
                    "amp_dtype", "report_to", "resume_from_checkpoint")


def _llm_trainer_raw(data: dict[str, Any]) -> dict[str, Any]:
    """LLM-Trainer's TrainingConfig keys that are not plain aliases, rewritten to ours:
    ``use_amp``/``amp_dtype`` -> ``mp``, ``report_to`` -> ``tracker``, ``save_steps``,
    ``save_total_limit`` and ``checkpoint_dir`` -> ``checkpointer`` (its keep rule ``every``,
    ``keep_last``, ``base_path``), ``resume_from_checkpoint: true`` (the flag without a path) ->
    ``load_checkpoint: true`` from the latest checkpoint in ``checkpoint_dir``; and with any of
    :data:`LLM_TRAINER_KEYS`, ``checkpointer.keep_best`` defaults to true."""
    nested = data.get("checkpointer")
    llm_trainer = any(k in data for k in LLM_TRAINER_KEYS) or (
        isinstance(nested, dict) and any(k in nested for k in ("save_steps", "save_total_limit")))
    if "use_amp" in data or "amp_dtype" in data:
        if "mp" in data:
            raise ConfigError("use_amp" if "use_amp" in data else "amp_dtype",
                              "given together with mp; keep one (mp: 'p=f32,c=bfloat16' is use_amp with bfloat16)")
        use_amp = data.pop("use_amp", True)
        data["mp"] = amp_to_mp(use_amp, data.pop("amp_dtype", None))
    if "report_to" in data:
        data["tracker"] = report_to_trackers(_take(data, "report_to", "tracker"))
    moved = {k: data.pop(k) for k in ("save_steps", "save_total_limit", "checkpoint_dir") if k in data}
    if moved:
        ckpt = data.get("checkpointer")
        ckpt = {} if ckpt is None else ckpt
        if not isinstance(ckpt, dict):
            raise ConfigError("checkpointer", "expected a mapping")
        if "checkpoint_dir" in moved:
            moved["base_path"] = moved.pop("checkpoint_dir")
        for key in moved:
            if key in ckpt:
                raise ConfigError(key, f"given twice (as trainer.{key} and as trainer.checkpointer.{key})")
        data["checkpointer"] = {**ckpt, **moved}
    if isinstance(data.get("resume_from_checkpoint"), bool):
        resume = data.pop("resume_from_checkpoint")
        data["load_checkpoint"] = resume  # true: must exist; false: never resume
        base = (data.get("checkpointer") or {}).get("base_path") if isinstance(data.get("checkpointer"), dict) else None
        if resume and base and not data.get("load_checkpoint_path"):
            data["load_checkpoint_path"] = base  # the latest checkpoint in the checkpoint dir
    if llm_trainer:
        ckpt = data.get("checkpointer")
        ckpt = {} if ckpt is None else ckpt
        if isinstance(ckpt, dict) and "keep_best" not in ckpt:
            data["checkpointer"] = {**ckpt, "keep_best": True}
    return data
