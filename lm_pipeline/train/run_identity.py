"""What names a training run: the semantic config its id hashes and its inputs that are not data.

One scheme, two users: the pipeline's ``train_ckpt`` address (:mod:`lm_pipeline.steps.stages`,
whose fingerprint is the run's id) and the id of a run that :func:`lm_pipeline.train.run.train`
starts without one (:func:`lm_pipeline.train.run.run_id_for`, with the caller's data fingerprint
as input). A rule about what makes two runs different is written here only.
"""

from __future__ import annotations

from typing import Any

from lm_pipeline.fingerprint import semantic_view

#: The data fields that decide which component each of a mixture's rows is drawn from.
MIXTURE_DRAW_FIELDS = ("train_weights", "stop_strategy", "mixture_block_size")


def run_semantics(cfg: Any) -> dict[str, Any]:
    """The semantic config of a run: model, trainer and optimizer, the row order when it is not
    the default, and a mixture's draw (absent when not used, so that existing runs keep their ids)."""
    conf: dict[str, Any] = {"model": semantic_view(cfg.model), "trainer": semantic_view(cfg.trainer),
                            "optimizer": semantic_view(cfg.optimizer)}
    if cfg.data.shuffle != "epoch":
        conf["shuffle"] = {"order": cfg.data.shuffle, "era_length": cfg.data.era_length}
    if cfg.trainer.num_epochs is not None:  # epochs -> steps rounds up (it rounded to nearest before)
        conf["epochs_to_steps"] = "ceil"
    if getattr(cfg.data, "configs", None):
        conf["mixture"] = mixture_draw(cfg.data)
    return conf


def mixture_draw(data: Any) -> dict[str, Any]:
    """A mixture's draw: its components in order (the blocks' layout follows it) and the draw
    fields that are set."""
    view = semantic_view(data)
    return {"components": list(data.configs), **{k: view[k] for k in MIXTURE_DRAW_FIELDS if k in view}}


def start_weights(cfg: Any) -> dict[str, Any]:
    """Continued pretraining: the starting Hugging Face weights by content (or hub commit) as an
    input of the run's id; none for a run from scratch. A hub id that cannot be read fails here,
    in one line naming ``initialize_from_hf``."""
    source = cfg.initialize_from_hf
    if not source:
        return {}
    from lm_pipeline.hf.start import hf_weights_identity
    from lm_pipeline.inputs import hub_model_problem
    from lm_pipeline.schema import ConfigError

    problem = hub_model_problem(source, "initialize_from_hf")  # offline and not cached: in seconds, one line
    if problem:
        raise ConfigError("initialize_from_hf", problem)
    return {"hf_weights": hf_weights_identity(source)}
