"""Kernels for CPU meshes (same values as the portable XLA path; faster on XLA:CPU).

* :mod:`.matmul`: projections and the LM head whose weight gradient reads an explicitly
  transposed operand, and the layer remat policy that keeps their outputs.
* :mod:`.blocked_attention`: causal attention in query blocks with a flash-style backward.
* :mod:`.native_attention`: causal attention as a C++ XLA FFI kernel, built at first use.
* :mod:`.fused_head_loss`: the LM head and cross-entropy in chunks of positions, gradients in
  the forward pass.

Only :mod:`lm_pipeline.compute` imports these modules.
"""
