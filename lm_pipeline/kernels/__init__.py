"""Platform-specific kernels, chosen by :class:`lm_pipeline.compute.ComputePlan` and by nothing
else: the models and the trainer never import them, so a package here can be deleted by editing
only :mod:`lm_pipeline.compute`."""
