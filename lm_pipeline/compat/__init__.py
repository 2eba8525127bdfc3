"""Other frameworks' configuration names, translated to this project's :class:`RunConfig`.

* :mod:`lm_pipeline.compat.llm_trainer`: LLM-Trainer's ``ModelConfig`` / ``TrainingConfig`` /
  ``DataConfig`` (a PyTorch trainer) -> :func:`~lm_pipeline.compat.llm_trainer.to_run_config`,
  :func:`~lm_pipeline.compat.llm_trainer.train`. See ``docs/llm-trainer.md``.

Light: importing it imports no JAX (only ``train`` and ``devices=None`` do).
"""
