"""``lm-pipeline``: the command line of the core (no Dagster needed).

Every subcommand takes ``--config_path FILE`` plus dotted overrides (``--model.num_heads 20``,
values parsed as YAML); the config is validated before any compute starts.

    lm-pipeline train    --config_path configs/tiny_gpt2.yaml [--trainer.num_train_steps 200]
    lm-pipeline cache    --config_path ...            # build the tokenizer and token cache only
    lm-pipeline plan     --config_path ...            # hit / miss per stage, and why
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

from lm_pipeline.schema import ConfigError

COMMANDS = {
    "train": "train a model (builds the tokenizer and token cache first if needed)",
    "cache": "build the raw shards, tokenizer and token cache only",
    "plan": "show, per stage, whether it is cached and which fields or inputs changed",
}


def _parser(cmd: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"lm-pipeline {cmd}", description=COMMANDS[cmd])
    p.add_argument("--config_path", "--config", dest="config_path", default=None, help="run config YAML")
    p.add_argument("--log_level", default="INFO")
    return p


def _load(args: argparse.Namespace, rest: Sequence[str]):
    from lm_pipeline.config import load_config

    return load_config(args.config_path, list(rest))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        width = max(map(len, COMMANDS))
        print("usage: lm-pipeline COMMAND --config_path FILE [--section.field VALUE ...]\n\ncommands:")
        for name, text in COMMANDS.items():
            print(f"  {name.ljust(width)}  {text}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    cmd, rest = argv[0], argv[1:]
    args, overrides = _parser(cmd).parse_known_args(rest)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = _load(args, overrides)
        from lm_pipeline.steps import Pipeline

        pipe = Pipeline(cfg)
        pipe.preflight()
        if cmd == "train":
            res = pipe.train_ckpt()
            print(json.dumps({"run_dir": res.path, "hit": res.hit, **res.summary}, indent=2, default=str))
        elif cmd == "cache":
            res = pipe.token_cache()
            print(json.dumps({"cache_dir": res.path, "hit": res.hit, **res.summary}, indent=2, default=str))
        elif cmd == "plan":
            print(pipe.plan_text())
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
