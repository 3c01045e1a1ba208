"""Executes StepPlans with torch.distributed on megatron-core.

- ``compat``: ``apply_cpu_compat()`` lets megatron-core run on CPU ranks (gloo) without CUDA.
- ``groups``: ``SPGroupPool``, every aligned power-of-two block of the data-parallel domain as a
  process group, created once.
- ``attention``: ``UlyssesAttention`` (core attention for megatron's layer specs),
  ``UlyssesPackedSeqParams`` (the per-micro-batch packed layout), the layer specs.
- ``kernels``: the attention backends behind one seam (``AttentionKernel``; ``sdpa``, ``flash``,
  ``te``, one module each) and ``pick_kernel``, which decides per call; names in ``backends``.
- ``comm``: the autograd all-to-all of Ulysses.
- ``ring``: ring attention between the Ulysses subgroups of a group past the heads' limit
  (``SPGroup.ring``): K/V blocks around the ring by p2p, partial attentions merged by log-sum-exp.
- ``rope``: true-position RoPE (``use_true_positions_for_rope``).
- ``slices``: token-level slices, ``PrefixKVCache`` (prefix K/V and its held gradient between the
  slices of a sequence).
- ``step``: ``forward_backward(step, model, ...)``, the one step API: a planned Step through the
  executor of its plan's kind.
- ``forward``: ``ModelInput`` and ``forward_step``, what both executors feed the model.
- ``schedule``: the FlexSP executor (``forward_backward_flexsp``: megatron-core's own schedule).
- ``pipeline``: the elastic pipeline executor (``forward_backward_elastic`` runs an elastic_pp
  StepPlan on megatron's pipeline layout, each stage the program plan/program.py's
  ``build_schedule`` compiled for it).
- ``pipeline_model``: ``build_pipeline_model`` (this rank's stage of a GPTModel), ``stage_state_dict``.
- ``records``: ``step_record``, the keys of the step record both writers share (``train --run-dir``,
  Megatron-LM's ``--planner-log``), read by ``megatron-ext report``.
- ``device``: the rank's device and the NCCL-rules check mode; ``timing``: ``DeviceClock``, NVTX ranges.
- ``checkpoint``: ``train --save`` / ``--load`` (megatron-core distributed checkpoints).
- ``train`` and ``profile``: the engines of ``megatron-ext train`` and ``profile`` (their commands,
  in ``commands/``, parse the options and start the ranks); ``torchrun``: torchrun as the launcher
  runs it; ``supervisor``: torchrun watched from outside its session (stop signals, stderr, leftovers).

Submodules are imported on demand (``attention`` and ``rope`` import megatron-core; ``kernels``,
``comm`` and ``slices`` torch only).
"""


def __getattr__(name: str):
    """``runtime.forward_backward``: the one step API (runtime/step.py), imported on first use."""
    if name == "forward_backward":
        from megatron_ext.runtime.step import forward_backward

        return forward_backward
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
