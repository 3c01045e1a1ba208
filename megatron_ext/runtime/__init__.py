"""Executes StepPlans with torch.distributed on megatron-core.

- ``compat``: ``apply_cpu_compat()`` lets megatron-core run on CPU ranks (gloo) without CUDA.
- ``groups``: ``SPGroupPool``, every aligned power-of-two block of the data-parallel domain as a
  process group, created once.
- ``attention``: ``UlyssesAttention`` (core attention for megatron's layer specs),
  ``UlyssesPackedSeqParams`` (the per-micro-batch packed layout), the layer specs.
- ``kernels``: the attention backends behind one seam (``AttentionKernel``; ``sdpa``, ``flash``,
  ``te``, one module each) and ``pick_kernel``, which decides per call; names in ``backends``.
- ``comm``: the autograd all-to-all of Ulysses.
- ``rope``: true-position RoPE (``use_true_positions_for_rope``).
- ``slices``: token-level slices, ``PrefixKVCache`` (prefix K/V and its held gradient between the
  slices of a sequence).
- ``pipeline``: elastic pipelines (``forward_backward_elastic`` runs an elastic_pp StepPlan on
  megatron's pipeline layout; ``build_schedule`` validates a pipeline and derives its deadlock-free
  per-stage programs; ``build_pipeline_model``).

Submodules are imported on demand (``attention`` and ``rope`` import megatron-core; ``kernels``,
``comm`` and ``slices`` torch only).
"""
