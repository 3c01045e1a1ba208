"""The hooks the patched ``pretrain_gpt.py`` installs (``patches/``): one call, six wrappers.

``wrap_pretrain_gpt(datasets_provider, model_builder, forward_step, extra_args_provider)`` returns
the same four things, wrapped. Each wrapper decides at call time, from the parsed arguments:
without ``--flexsp`` / ``--elastic-pp`` it calls Megatron's own function unchanged, so the patched
script trains exactly like the unpatched one; with either it uses megatron_ext's:

* extra_args_provider: adds megatron_ext's flags and validates them (``arguments.py``);
* model builder: Megatron's GPT (with --elastic-pp: this rank's stage) with Ulysses core attention
  (``model.py``);
* datasets provider: iterators of planned steps (``step.planned_datasets_provider``);
* forward step: carries ``get_forward_backward_func``, which the patched ``training.py`` asks for
  in ``train`` and ``evaluate``: ``step.flexsp_forward_backward`` with --flexsp,
  ``step.elastic_forward_backward`` with --elastic-pp, megatron-core's
  ``get_forward_backward_func()`` otherwise;
* Megatron's FLOPs count (``megatron.training.training.num_floating_point_operations``, behind its
  TFLOP/s/GPU line, ``--log-throughput`` and the FLOPs in checkpoints and the progress log): it
  counts every sample as ``--seq-length`` tokens; a planned step's count is that of its documents
  at their own lengths (``step.step_floating_point_operations``). ``wrap_pretrain_gpt`` installs it
  in Megatron's training module (which calls it by name) once;
* Megatron's check of a resumed checkpoint's arguments
  (``megatron.training.checkpointing.check_checkpoint_args``): unchanged, and the arguments kept,
  so that a planned run refuses to resume drawing other batches (``step.check_sample_cut``).
"""
from __future__ import annotations

import functools
import inspect

from megatron_ext.megatron.arguments import extra_args_provider as _extra_args_provider
from megatron_ext.megatron.arguments import mode_flag
from megatron_ext.megatron.model import ulysses_model_builder


def planned_mode() -> str | None:
    """"--flexsp" or "--elastic-pp" when this run is planned by megatron_ext, else None."""
    from megatron.training import get_args

    return mode_flag(get_args())


class ForwardStep:
    """Megatron's forward_step, plus the forward-backward function to run it with."""

    def __init__(self, stock):
        self.stock = stock
        functools.update_wrapper(self, stock)

    def get_forward_backward_func(self):
        mode = planned_mode()
        if mode is not None:
            from megatron_ext.megatron.step import FORWARD_BACKWARD

            return FORWARD_BACKWARD[mode]
        from megatron.core.pipeline_parallel import get_forward_backward_func

        return get_forward_backward_func()

    def __call__(self, data_iterator, model, *args, **kwargs):
        mode = planned_mode()
        if mode is not None:
            raise RuntimeError(f"{mode}: Megatron called the forward step with its own "
                               f"forward-backward function; megatron/training/training.py is not patched "
                               f"(run scripts/apply_patches.sh)")
        return self.stock(data_iterator, model, *args, **kwargs)


class DatasetsProvider:
    """Megatron's train_valid_test_datasets_provider, or megatron_ext's planned steps."""

    def __init__(self, stock):
        self.stock = stock
        self._takes_vp_stage = "vp_stage" in inspect.signature(stock).parameters
        functools.update_wrapper(self, stock)

    @property
    def is_distributed(self) -> bool:
        return planned_mode() is not None or bool(getattr(self.stock, "is_distributed", False))

    @is_distributed.setter
    def is_distributed(self, value: bool) -> None:
        self.stock.is_distributed = value

    def __call__(self, train_val_test_num_samples, vp_stage=None):
        if planned_mode() is not None:
            from megatron_ext.megatron.step import planned_datasets_provider

            return planned_datasets_provider(train_val_test_num_samples, vp_stage)
        if self._takes_vp_stage:
            return self.stock(train_val_test_num_samples, vp_stage=vp_stage)
        return self.stock(train_val_test_num_samples)


class FloatingPointOperations:
    """Megatron's num_floating_point_operations(args, batch_size), or in a planned run the count of
    the documents the last training step trained."""

    def __init__(self, stock):
        self.stock = stock
        functools.update_wrapper(self, stock)

    def __call__(self, args, batch_size):
        if mode_flag(args) is not None:
            from megatron_ext.megatron.step import step_floating_point_operations

            count = step_floating_point_operations(self.stock, args)
            if count is not None:
                return count
        return self.stock(args, batch_size)


def _count_planned_flops() -> None:
    from megatron.training import training

    if not isinstance(training.num_floating_point_operations, FloatingPointOperations):
        training.num_floating_point_operations = FloatingPointOperations(training.num_floating_point_operations)


class CheckpointArgs:
    """Megatron's check_checkpoint_args(checkpoint_args), which ``load_checkpoint`` calls with the
    resumed run's arguments: they are kept (``step.STATE.checkpoint_args``) for the planned data
    to check what it draws batches from against (``step.check_sample_cut``)."""

    def __init__(self, stock):
        self.stock = stock
        functools.update_wrapper(self, stock)

    def __call__(self, checkpoint_args):
        from megatron_ext.megatron.step import STATE

        STATE.checkpoint_args = checkpoint_args
        return self.stock(checkpoint_args)


def _keep_checkpoint_args() -> None:
    from megatron.training import checkpointing

    if not isinstance(checkpointing.check_checkpoint_args, CheckpointArgs):
        checkpointing.check_checkpoint_args = CheckpointArgs(checkpointing.check_checkpoint_args)


def wrap_pretrain_gpt(datasets_provider, model_builder, forward_step, extra_args_provider=None):
    """(datasets_provider, model_builder, forward_step, extra_args_provider), wrapped, Megatron's
    FLOPs count and its check of a resumed checkpoint's arguments (module doc)."""
    _count_planned_flops()
    _keep_checkpoint_args()
    return (DatasetsProvider(datasets_provider), ulysses_model_builder(model_builder), ForwardStep(forward_step),
            _extra_args_provider(extra_args_provider))
