"""Executes StepPlans with torch.distributed on megatron-core.

- ``compat``: ``apply_cpu_compat()`` lets megatron-core run on CPU ranks (gloo) without CUDA.
- ``groups``: ``SPGroupPool``, every aligned power-of-two block of the data-parallel domain as a
  process group, created once.
- ``attention``: ``UlyssesAttention`` (core attention for megatron's layer specs),
  ``UlyssesPackedSeqParams`` (the per-micro-batch packed layout), true-position RoPE.

Submodules are imported on demand (``attention`` imports megatron-core).
"""
