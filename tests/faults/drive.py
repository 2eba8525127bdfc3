"""Run one pipeline stage as its own process (what a Dagster materialization of it calls).

    python tests/faults/drive.py CONFIG.yaml STAGE [--key value ...]

STAGE: raw_shards | tokenizer | token_cache | train_ckpt | eval_report | hf_export. Prints the
stage's result as one JSON line. The fault tests arm fault points in its environment.
"""

from __future__ import annotations

import json
import logging
import sys


def main(argv: list[str]) -> int:
    from lm_pipeline.config import load_config
    from lm_pipeline.schema import ConfigError
    from lm_pipeline.steps import Pipeline
    from lm_pipeline.store import StorageError

    path, stage, *overrides = argv
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        pipe = Pipeline(load_config(path, overrides), progress=False)
        res = getattr(pipe, stage)()
    except (ConfigError, StorageError) as e:  # as the CLI does: one clear line, no traceback
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2 if isinstance(e, ConfigError) else 1
    print(json.dumps({"stage": stage, "fingerprint": res.fingerprint, "path": res.path, "hit": res.hit}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
