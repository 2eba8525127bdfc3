"""The batch-split rule (``lm_pipeline.train.batch_split``) against a brute-force search: a split
works exactly when some per-device micro-batch, device count and accumulation -- those given fixed,
the others free -- multiply to the batch. The config, the trainer and the estimator all ask it."""

from __future__ import annotations

import itertools

import pytest

from lm_pipeline.schema import ConfigError
from lm_pipeline.train.batch_split import batch_split_problem


def _exists(batch: int, per: int | None, gas: int | None, data: int | None) -> bool:
    free = range(1, batch + 1)
    return any(p * g * d == batch for p in ([per] if per else free) for g in ([gas] if gas else free)
               for d in ([data] if data else free))


def test_a_split_works_exactly_when_its_parts_multiply_to_the_batch():
    for batch, per, gas, data in itertools.product(range(1, 37), (None, 1, 2, 3, 4, 6), (None, 1, 2, 3, 4),
                                                   (None, 1, 2, 3, 4, 8)):
        problem = batch_split_problem(batch, per_device=per, accumulation=gas, data_size=data)
        assert (problem is None) == _exists(batch, per, gas, data), (batch, per, gas, data, problem)
        if problem is not None:
            assert problem[0] in ("train_batch_size", "gradient_accumulation_steps") and problem[1]


@pytest.mark.parametrize("batch,per,gas,data,expected", [
    (16, None, None, 4, (4, 1)), (16, 2, None, 4, (2, 2)), (24, None, 3, 2, (4, 3)), (8, -1, None, 8, (1, 1))])
def test_the_trainer_and_the_estimator_split_by_the_same_rule(batch, per, gas, data, expected):
    from lm_pipeline.estimate.auto_parallelism import micro_batch_candidates
    from lm_pipeline.train.config import TrainerConfig

    cfg = TrainerConfig(train_batch_size=batch, gradient_accumulation_steps=gas)
    micro, accum = cfg.micro_batching(data, per)
    assert (micro, accum) == expected and micro * data * accum == batch
    assert micro_batch_candidates(batch, data) == [m for m in range(1, batch + 1) if _exists(batch, m, None, data)]
    with pytest.raises(ConfigError, match="divisible"):
        TrainerConfig(train_batch_size=batch, gradient_accumulation_steps=gas).micro_batching(batch + 1, None)
