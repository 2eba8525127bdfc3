"""Continuing a finished run to more steps: a larger ``trainer.num_train_steps`` is a new run
(another address), which says how to continue the old one; ``trainer.load_checkpoint_path``
continues it with its weights and optimizer state -- with a constant learning rate the result is
exactly the run trained to the new length from the start."""

import logging
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import pytest
import yaml
from helpers import pipeline as pt

from lm_pipeline.config import load_config
from lm_pipeline.eval import load_model_from_checkpoint
from lm_pipeline.steps import Pipeline
from lm_pipeline.steps.builders import continuation_hint


def _pipe(tmp: Path, store: str, **trainer) -> Pipeline:
    cfg = pt.tiny_config(tmp)
    cfg["optimizer"].update({"lr_schedule": "constant", "warmup": 0.0})
    cfg["trainer"].update(trainer)
    cfg["store"]["root"] = str(tmp / store)
    path = tmp / f"{store}-{len(list(tmp.glob('*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return Pipeline(load_config(path), progress=False)


def _train_context(pipe):
    """What train_ckpt's builder receives as its context."""
    from lm_pipeline.steps.stage import BuildContext

    return BuildContext(pipe, pipe.stage("train_ckpt"))


def _params(step_dir: str) -> list[np.ndarray]:
    model = load_model_from_checkpoint(step_dir).model
    return [np.asarray(x) for x in jax.tree.leaves(eqx.filter(model, eqx.is_array))]


@pytest.mark.slow  # two training runs: ~25 s
def test_a_finished_run_continues_to_more_steps_as_if_trained_that_long(tmp_path, caplog):
    short = _pipe(tmp_path, "store", num_train_steps=6).train_ckpt()
    old_final = short.manifest["summary"]["final_checkpoint"]
    assert old_final.endswith("step-6")

    longer = _pipe(tmp_path, "store", num_train_steps=9)
    assert longer.address("train_ckpt").fingerprint != short.fingerprint  # another run, from step 0 ...
    hint = continuation_hint(_train_context(longer))  # ... which says how to continue the finished one instead
    assert hint is not None and short.manifest["run_dir"] in hint
    assert hint.endswith(f"--trainer.load_checkpoint_path {old_final}")
    assert continuation_hint(_train_context(_pipe(tmp_path, "store", num_train_steps=9, seed=1))) is None  # another config

    cont = _pipe(tmp_path, "store", num_train_steps=9, load_checkpoint_path=old_final)
    with caplog.at_level(logging.WARNING):
        res = cont.train_ckpt()
    assert res.manifest["summary"]["resumed_from"] == old_final and res.manifest["summary"]["final_step"] == 9
    assert not [r for r in caplog.records if "starting a new run from step 0" in r.getMessage()]

    straight = _pipe(tmp_path, "reference", num_train_steps=9).train_ckpt()  # never stopped
    assert straight.manifest["summary"]["resumed_from"] is None
    a, b = _params(res.manifest["summary"]["final_checkpoint"]), _params(straight.manifest["summary"]["final_checkpoint"])
    assert len(a) == len(b) > 0
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)
    assert any(not np.array_equal(x, y) for x, y in zip(_params(old_final), b, strict=True))  # it did train on
