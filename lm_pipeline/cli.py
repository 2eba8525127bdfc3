"""``lm-pipeline``: the command line of the core (no Dagster needed).

Every subcommand takes ``--config_path FILE`` plus dotted overrides (``--model.num_heads 20``,
values parsed as YAML); the config is validated before any compute starts.

    lm-pipeline train    --config_path configs/tiny_gpt2.yaml [--trainer.num_train_steps 200]
    lm-pipeline cache    --config_path ...            # build the tokenizer and token cache only
                         [--ray_address ADDR]         # ... with one Ray task per shard group
    lm-pipeline plan     --config_path ...            # hit / miss per stage, and why
    lm-pipeline eval     --config_path ... [--checkpoint_path RUN_OR_STEP_DIR] [--output_dir DIR]
                         [--tasks hellaswag,arc_easy:5]  # lm-evaluation-harness tasks only
    lm-pipeline export   --config_path ... [--checkpoint_path STEP_DIR] --output_dir DIR
                         # without --checkpoint_path: the latest checkpoint of the config's run
    lm-pipeline generate --checkpoint_path STEP_DIR --prompt "def main(" [--temperature 0.8]
    lm-pipeline estimate --config_path ... [--num_devices 8] [--budget_gib 80]
    lm-pipeline lineage  PATH_OR_FINGERPRINT [--store ROOT | --config_path ...] [--json]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

from lm_pipeline.launch import REEXEC_COMMANDS
from lm_pipeline.schema import ConfigError
from lm_pipeline.steps.stages import STAGES
from lm_pipeline.store import StorageError

#: The subcommands that build a stage (and the stages before it), from the stage table.
BUILD_COMMANDS = {s.command[0]: s.name for s in STAGES if s.command}
COMMANDS = {
    **{s.command[0]: s.command[1] for s in STAGES if s.command},
    "plan": "show, per stage, whether it is cached and which fields or inputs changed",
    "eval": "evaluate a checkpoint on the config's validation sets (loss, perplexity, bits-per-byte)",
    "export": "export a checkpoint as a Hugging Face transformers directory",
    "generate": "sample text from a checkpoint",
    "estimate": "parameters, FLOPs per token and memory per device for the configured model, mesh and batch",
    "lineage": "show an artifact's chain of inputs back to the raw shards (stage, fingerprint, path, config)",
}


def _user_errors() -> tuple[type[BaseException], ...]:
    """Errors a user causes and fixes (input data, tokenizer, token cache, checkpoint paths,
    generation arguments): one line and exit 2, not a traceback. Imported only when an error
    propagates (an ``except`` clause evaluates its expression then)."""
    from lm_pipeline.data.cache.errors import CacheError
    from lm_pipeline.data.tokenizer import TokenizerError
    from lm_pipeline.data.validation import DataValidationError, ShardChangedError
    from lm_pipeline.generate import SamplingError
    from lm_pipeline.hf.files import UnsafeCheckpointError
    from lm_pipeline.hf.load import HfWeightsError
    from lm_pipeline.train.checkpoint import IncompleteCheckpointError

    return (DataValidationError, ShardChangedError, TokenizerError, CacheError, IncompleteCheckpointError,
            UnsafeCheckpointError, HfWeightsError, SamplingError, FileNotFoundError)


def _debug(args: argparse.Namespace) -> bool:
    import os

    return bool(getattr(args, "debug", False)) or os.environ.get("LM_PIPELINE_DEBUG", "") not in ("", "0")


def experiment_path(name: str) -> str | None:
    """``configs/experiments/<name>.yaml`` (of ``$LM_PIPELINE_EXPERIMENTS_DIR`` when set), the
    file the Dagster deployment names ``name``; None (after saying what exists) when missing."""
    import os

    folder = os.environ.get("LM_PIPELINE_EXPERIMENTS_DIR") or os.path.join("configs", "experiments")
    for ext in (".yaml", ".yml"):
        path = os.path.join(folder, name + ext)
        if os.path.isfile(path):
            return path
    known = sorted(os.path.splitext(f)[0] for f in os.listdir(folder) if f.endswith((".yaml", ".yml"))) \
        if os.path.isdir(folder) else []
    print(f"lm-pipeline: no experiment {name!r} in {folder}/ (experiments: {', '.join(known) or 'none'}); "
          "pass --config_path FILE for a config elsewhere", file=sys.stderr)
    return None


def _parser(cmd: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"lm-pipeline {cmd}", description=COMMANDS[cmd],
                                epilog="Any config field can be overridden: --section.field VALUE")
    p.add_argument("--config_path", "--config", dest="config_path", default=None, help="run config YAML")
    p.add_argument("--experiment", default=None,
                   help="an experiment of the Dagster deployment by name (as in its asset keys): "
                        "configs/experiments/NAME.yaml, or $LM_PIPELINE_EXPERIMENTS_DIR/NAME.yaml")
    p.add_argument("--log_level", default="INFO")
    p.add_argument("--debug", action="store_true", help="show the traceback of an error (also $LM_PIPELINE_DEBUG=1)")
    if cmd in ("eval", "export", "generate"):
        p.add_argument("--checkpoint_path", required=cmd == "generate", default=None,
                       help="a step-N dir, or a run dir (its latest checkpoint)" + (
                           "" if cmd == "generate" else "; default: the latest checkpoint of the config's run"))
    if cmd in ("eval", "export"):
        p.add_argument("--output_dir", required=cmd == "export", default=None)
    if cmd == "eval":
        p.add_argument("--tasks", default=None, help="evaluate only these lm-evaluation-harness tasks (comma-separated "
                       "names, NAME:K for K-shot) with the config's eval_harness settings; without it, a config's "
                       "eval_harness tasks run after the validation sets")
    if cmd == "train":
        p.add_argument("--resume_from_checkpoint", nargs="?", const=True, default=None, metavar="PATH",
                       help="resume from the latest complete checkpoint under PATH; with no PATH, from the latest one "
                            "in the checkpoint dir (trainer.checkpointer.base_path; without one, the run's own)")
    if cmd == "estimate":
        p.add_argument("--num_devices", type=int, default=None, help="default: the devices JAX sees")
        p.add_argument("--vocab_size", type=int, default=None, help="default: the tokenizer's real vocabulary (data.tokenizer: trained BPE: its vocab_size; a Hugging Face name or directory: read from its tokenizer.json)")
        p.add_argument("--budget_gib", type=float, default=None, help="also pick the largest micro-batch that fits")
        p.add_argument("--json", action="store_true")
    if cmd == "cache":
        p.add_argument("--ray_address", "--ray-address", dest="ray_address", default=None,
                       help="tokenize the shard groups as Ray tasks on this cluster (what ray.init takes: auto, "
                            "<head>:6379, ray://<head>:10001); the store and the data must be reachable from every node")
        p.add_argument("--ray_cpus_per_task", type=float, default=1.0, help="CPUs each Ray task reserves")
    if cmd == "lineage":
        p.add_argument("artifact", help="a path inside an artifact (its directory, a step-N, a file), "
                       "a fingerprint or a unique prefix of one (6+ hex digits), or STAGE/FINGERPRINT")
        p.add_argument("--store", default=None, help="the store to search for a fingerprint "
                       "(default: store.root of --config_path, else of the defaults)")
        p.add_argument("--json", action="store_true", help="print the chain as JSON")
    if cmd == "generate":
        p.add_argument("--prompt", action="append", required=True, help="may be given several times (a batch)")
        p.add_argument("--max_new_tokens", type=int, default=64)
        p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
        p.add_argument("--top_k", type=int, default=None)
        p.add_argument("--top_p", type=float, default=None)
        p.add_argument("--seed", type=int, default=0)
    return p


def _resolve_checkpoint(path: str) -> str:
    """A complete checkpoint at or under ``path``, or a local Hugging Face model directory."""
    import os

    from lm_pipeline.hf.start import is_hf_model_dir
    from lm_pipeline.inputs import hf_model_dir_problem
    from lm_pipeline.train.checkpoint import latest_checkpoint

    names = set(os.listdir(path)) if os.path.isdir(path) else set()
    if "config.json" in names and "checkpoint.json" not in names:  # a Hugging Face model directory
        problem = hf_model_dir_problem(path, "--checkpoint_path")  # its config.json invalid, no weights
        if problem:
            raise ConfigError("checkpoint_path", problem)
    if is_hf_model_dir(path):
        return path
    found = latest_checkpoint(path)
    if found is None:
        raise ConfigError("checkpoint_path", f"no complete checkpoint at or under {path}")
    return found


def _run_checkpoint(cfg) -> str:
    """The latest complete checkpoint of the config's run (``eval`` / ``export`` without
    ``--checkpoint_path``, as Levanter's export takes only the config)."""
    from lm_pipeline.steps import Pipeline
    from lm_pipeline.train.checkpoint import latest_checkpoint

    run_dir = Pipeline(cfg, progress=False).run_dir()
    found = latest_checkpoint(run_dir)
    if found is None:
        raise ConfigError("checkpoint_path", f"not given, and the config's run ({run_dir}) has no complete checkpoint: "
                          "train it first (lm-pipeline train with this config), or pass --checkpoint_path")
    return found


def _eval_tasks(cfg, tasks: str | None):
    """(the lm-evaluation-harness tasks to run, their checked index): the config's
    ``eval_harness:`` or ``--tasks``; (None, None) when there are none."""
    from lm_pipeline.eval.tasks import harness_config, prepare_tasks

    harness = harness_config(cfg.eval_harness, tasks)
    return (harness, prepare_tasks(harness)) if harness is not None else (None, None)


def _eval(cfg, ckpt: str, output_dir: str | None, harness=None, manager=None, tasks_only: bool = False) -> int:
    """Evaluate ``ckpt`` on the config's validation sets (unless ``tasks_only``), then on the
    harness tasks (:mod:`lm_pipeline.eval.tasks`)."""
    from lm_pipeline import fs

    out = output_dir or cfg.eval.report_dir or fs.join(ckpt, "eval")
    if not tasks_only:
        _eval_loss(cfg, ckpt, out)
    if harness is not None:
        from lm_pipeline.eval.tasks import evaluate_tasks, results_table

        results, files = evaluate_tasks(ckpt, harness, out, manager=manager, compute_dtype=cfg.eval.compute_dtype,
                                        store_root=cfg.store.root)
        print(results_table(results))
        print(json.dumps(files))
    return 0


def _eval_loss(cfg, ckpt: str, out: str) -> None:
    """Evaluate ``ckpt`` on the config's validation sets, tokenized with the checkpoint's tokenizer:
    read from the token cache the pipeline built for this data and tokenizer, tokenizing only the
    sets no cache holds (never the training data; :mod:`lm_pipeline.eval.data`)."""
    from lm_pipeline import fs
    from lm_pipeline.config import load_config
    from lm_pipeline.eval import evaluate_checkpoint, write_report
    from lm_pipeline.eval.data import eval_datasets
    from lm_pipeline.hf.start import hf_model_config, is_hf_model_dir

    if is_hf_model_dir(ckpt):  # a Hugging Face model directory: its config.json and its tokenizer
        model_cfg, tok = hf_model_config(ckpt), ckpt
    else:
        model_cfg = load_config(fs.join(ckpt, "config.yaml")).model  # a local dir or a URL
        tok = fs.join(ckpt, "tokenizer")
    ev = cfg.eval
    data = eval_datasets(cfg, tok, seq_len=model_cfg.seq_len, train=ev.unigram_baseline)
    df = evaluate_checkpoint(ckpt, data.datasets, batch_size=ev.batch_size, max_eval_batches=ev.max_eval_batches,
                             compute_dtype=ev.compute_dtype, store_root=cfg.store.root, train_cache=data.train_cache)
    files = write_report(df, out)
    cols = [c for c in ("dataset", "step", "loss", "perplexity", "bpb", "unigram_bpb", "tokens") if c in df.columns]
    print(df[cols].to_string(index=False))
    print(json.dumps(files))


def _estimate(cfg, args: argparse.Namespace) -> int:
    """Print the estimate (nothing is compiled or allocated)."""
    import jax

    from lm_pipeline.estimate import auto_micro_batch, estimate, resolve_auto_parallelism
    from lm_pipeline.estimate.vocab import tokenizer_vocab_size

    n = args.num_devices or jax.device_count()
    vocab = args.vocab_size or tokenizer_vocab_size(cfg.data.tokenizer)  # the real tokenizer's
    if cfg.trainer.per_device_parallelism == "auto":
        cfg = resolve_auto_parallelism(cfg, n, vocab)
        print(f"per_device_parallelism: auto -> {cfg.trainer.per_device_parallelism} sequences per device")
    est = estimate(cfg, num_devices=n, vocab_size=vocab)
    if args.json:
        print(json.dumps(est.to_dict(), indent=2, default=str))
    else:
        print(est.render())
    if args.budget_gib:
        budget = int(args.budget_gib * 2**30)
        print(f"fits in {args.budget_gib} GiB: {est.fits(budget)}; largest micro-batch per device that fits: "
              f"{auto_micro_batch(cfg, n, budget, vocab)}")
    return 0


def _lineage(cfg, args: argparse.Namespace) -> int:
    """Print the artifact's lineage; 1 when it names no complete artifact or a link is missing."""
    from lm_pipeline.steps import lineage as lin

    try:
        store, stage, fp = lin.resolve(args.artifact, args.store or cfg.store.root)
    except lin.LineageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if not args.store:  # the config's store: its token caches may be in data.cache_dir
        store = store.with_stage_root("token_cache", cfg.data.cache_dir)
    steps = lin.lineage(store, stage, fp)
    print(lin.to_json(steps) if args.json else lin.format_lineage(steps))
    broken = lin.broken_links(steps)
    if broken:
        links = "; ".join(f"{s['stage']} {s['fingerprint']} ({s['status']}, read by {', '.join(s['read_by'])})"
                          for s in broken)
        print(f"error: the lineage of {stage} {fp} is broken: MISSING from store {store.root}: {links}. "
              "Its chain is printed up to there; rebuild the missing artifacts with the experiment's "
              "config, or pass the store that holds them", file=sys.stderr)
        return 1
    return 0


#: Commands that re-execute themselves with tcmalloc preloaded (``lm_pipeline.launch``); the
#: ``lm-pipeline`` script does it before importing this module (``launch.cli``), ``python -m``
#: and other callers of :func:`main` here.
_REEXEC_COMMANDS = REEXEC_COMMANDS


def _build_stage(cmd: str, cfg, args: argparse.Namespace) -> int:
    """``plan``, or build the stage a building subcommand names (the stages before it first) and
    print where it is, whether it was a cache hit and its summary."""
    from lm_pipeline.steps import Pipeline

    on_ray = cmd == "cache" and getattr(args, "ray_address", None)
    if on_ray:
        from lm_pipeline.cluster import ClusterError, require_ray
        from lm_pipeline.cluster.ray_cache import build_token_cache_on_ray, check_ray_address

        try:  # before any work: the address's form and the package
            check_ray_address(args.ray_address)
            require_ray("tokenizing on Ray")
        except ClusterError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    pipe = Pipeline(cfg)
    pipe.preflight()
    if cmd == "plan":
        print(pipe.plan_text())
        return 0
    if on_ray:
        try:
            res = build_token_cache_on_ray(pipe, address=args.ray_address, num_cpus=args.ray_cpus_per_task)
        except ClusterError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    else:
        res = pipe.build(BUILD_COMMANDS[cmd])
    raw = pipe.cached("raw_shards")
    if raw is not None:  # what the data kept and skipped, also when it was built before
        from lm_pipeline.steps.builders import data_summary

        print(f"data: {data_summary(raw.manifest)}", file=sys.stderr)
    where = {"path": res.path, **({"run_dir": res.manifest["run_dir"]} if "run_dir" in res.manifest else {})}
    print(json.dumps({**where, "hit": res.hit, **res.summary}, indent=2, default=str))
    return 0


def _usage(argv: list[str]) -> int:
    width = max(map(len, COMMANDS))
    print("usage: lm-pipeline COMMAND --config_path FILE [--section.field VALUE ...]\n\ncommands:")
    for name, text in COMMANDS.items():
        print(f"  {name.ljust(width)}  {text}")
    return 0 if argv and argv[0] in ("-h", "--help") else 2


def main(argv: Sequence[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] in _REEXEC_COMMANDS:
        from lm_pipeline.launch import maybe_reexec_with_tcmalloc

        maybe_reexec_with_tcmalloc()  # returns only when it does not re-execute
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        return _usage(argv)
    cmd, rest = argv[0], argv[1:]
    args, overrides = _parser(cmd).parse_known_args(rest)
    if cmd == "generate":  # argument errors before any checkpoint is read
        from lm_pipeline.generate import SamplingError, check_sampling

        try:
            check_sampling(args.max_new_tokens, args.temperature, args.top_k, args.top_p)
        except SamplingError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    if args.experiment is not None:
        if args.config_path is not None:
            print("lm-pipeline: give --experiment NAME or --config_path FILE, not both", file=sys.stderr)
            return 2
        args.config_path = experiment_path(args.experiment)
        if args.config_path is None:
            return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("absl").setLevel(logging.WARNING)
    try:
        from lm_pipeline.config import load_config

        cfg = load_config(args.config_path, list(overrides))
        if getattr(args, "resume_from_checkpoint", None) is not None:  # LLM-Trainer's flag (a path, or none)
            from lm_pipeline.compat.llm_trainer import resume_overrides
            from lm_pipeline.config import parse_overrides

            resume = resume_overrides(args.resume_from_checkpoint, cfg.trainer.checkpointer.base_path)
            cfg = load_config(args.config_path, [*parse_overrides(list(overrides)), *resume])
        if cmd in _REEXEC_COMMANDS:
            from lm_pipeline.launch import tcmalloc_status

            logging.getLogger("lm_pipeline.cli").info("allocator: %s", tcmalloc_status())
        if cmd in BUILD_COMMANDS or cmd == "plan":
            return _build_stage(cmd, cfg, args)
        if cmd == "estimate":
            return _estimate(cfg, args)
        if cmd == "lineage":
            return _lineage(cfg, args)
        harness = _eval_tasks(cfg, args.tasks) if cmd == "eval" else None  # task names before any checkpoint
        ckpt = _resolve_checkpoint(args.checkpoint_path) if args.checkpoint_path else _run_checkpoint(cfg)
        if cmd == "eval":
            return _eval(cfg, ckpt, args.output_dir, *harness, tasks_only=args.tasks is not None)
        if cmd == "export":
            from lm_pipeline.hf import export_hf

            out = export_hf(ckpt, args.output_dir, dtype=cfg.export.dtype, max_shard_size=cfg.export.max_shard_size)
            print(out)
            return 0
        from lm_pipeline.generate import generate_text

        texts = generate_text(ckpt, args.prompt, args.max_new_tokens, temperature=args.temperature,
                              top_k=args.top_k, top_p=args.top_p, seed=args.seed)
        for prompt, text in zip(args.prompt, [texts] if isinstance(texts, str) else texts, strict=True):
            print(prompt + text)
        return 0
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except _user_errors() as e:  # bad data, tokenizer, cache, checkpoint path: the message names it
        if _debug(args):
            raise
        text = " ".join(line.strip() for line in str(e).splitlines() if line.strip()) or type(e).__name__
        print(f"error: {text}  (--debug shows the traceback)", file=sys.stderr)
        return 2
    except FloatingPointError as e:  # a NaN/Inf loss without optimizer.skip_bad_steps
        print(f"error: {e}", file=sys.stderr)
        return 3
    except StorageError as e:  # full disk, read-only store: the message names the path and the fix
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
