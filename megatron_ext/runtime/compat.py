"""Run megatron-core 0.16.1 on CPU ranks (gloo) when CUDA is absent.

``apply_cpu_compat()`` is the entry point (``quiet_fallback_warnings()`` silences what megatron-core
says of its fallbacks on import). It does nothing when ``torch.cuda.is_available()``
(GPU runs use megatron-core untouched) and is idempotent. On a machine without CUDA every patched
call would otherwise raise ("Torch not compiled with CUDA enabled", "pin_memory requires an
accelerator"), so each patch only turns a call that cannot work into its CPU meaning; no code path
that works today changes behaviour.

The patches, each with its reason:

* ``torch.cuda.current_device`` -> ``torch.device("cpu")``: megatron passes it as the ``device=`` of
  parameters, buffers, RoPE frequencies and communication scratch tensors (GlobalMemoryBuffer, p2p
  shape handshakes, the DDP grad buffers).
* ``torch.cuda.synchronize`` -> no-op: CPU ops are synchronous; parallel_state and p2p call it.
* ``tensor_parallel.random``: ``_get_cuda_rng_state`` / ``_set_cuda_rng_state`` and the tracker's
  ``add`` / ``fork`` use the CPU default generator, which is the "device" generator on CPU. This
  is what ``model_parallel_cuda_manual_seed``, ``get_cuda_rng_tracker().fork()`` (layer init with
  ``use_cpu_initialization=False``, attention dropout) and activation checkpointing need. The
  replacement ``fork`` drops megatron's "CPU RNG state changed within GPU RNG context" warning,
  which on CPU would fire on every dropout inside a fork.
* A few megatron functions hard-code ``device="cuda"``, ``.cuda()`` or ``pin_memory=True``; they run
  inside a small TorchFunctionMode that maps those to the CPU, active only for the duration of
  the call:
  - ``pipeline_parallel.schedules.forward_backward_*``: ``torch.zeros(..., device="cuda")`` for the
    token counter;
  - ``transformer.utils.get_default_causal_mask`` / ``get_sliding_window_causal_mask``:
    ``device="cuda"`` masks for the local DotProductAttention;
  - ``rope_utils.get_pos_emb_on_this_cp_rank``: ``pin_memory=True`` + ``.cuda()`` (RoPE with CP);
  - ``LanguageModule.setup_embeddings_and_output_layer``: ``weight.data.cuda()`` (tied embeddings
    with pipeline parallelism);
  - ``tensor_parallel.data.broadcast_data``: ``.cuda()`` on the batch (TP data broadcast);
  - the optimizers' constructors and ``optimizer.clip_grads``' norm and zero counting: scalars
    allocated with ``device="cuda"``.
  Functions imported by name into other megatron modules are replaced there too.

Not patched (callers must avoid them on CPU): CUDA graphs, ``config.enable_autocast`` with a CUDA
autocast, fused kernels that need apex / Transformer Engine, and the CUDA-graph-safe RNG tracker.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import sys
import warnings

import torch
from torch.overrides import TorchFunctionMode

from megatron_ext.runtime.device import is_cuda_device, rank_device

_APPLIED = False
_MARK = "__megatron_ext_cpu_compat__"

# (module, attribute) of megatron functions that hard-code CUDA devices; run under _CpuDeviceMode.
_DEVICE_WRAPPED = (
    ("megatron.core.pipeline_parallel.schedules", "forward_backward_no_pipelining"),
    ("megatron.core.pipeline_parallel.schedules", "forward_backward_pipelining_with_interleaving"),
    ("megatron.core.pipeline_parallel.schedules", "forward_backward_pipelining_without_interleaving"),
    ("megatron.core.transformer.utils", "get_default_causal_mask"),
    ("megatron.core.transformer.utils", "get_sliding_window_causal_mask"),
    ("megatron.core.models.common.embeddings.rope_utils", "get_pos_emb_on_this_cp_rank"),
    ("megatron.core.tensor_parallel.data", "broadcast_data"),
    ("megatron.core.optimizer.clip_grads", "get_grad_norm_fp32"),
    ("megatron.core.optimizer.clip_grads", "clip_grad_by_total_norm_fp32"),
    ("megatron.core.optimizer.clip_grads", "count_zeros_fp32"),
)

# (module, class, method) likewise: megatron's optimizers allocate their scalars with device="cuda".
_METHODS_WRAPPED = (
    ("megatron.core.optimizer.optimizer", "MixedPrecisionOptimizer", "__init__"),
    ("megatron.core.optimizer.optimizer", "FP32Optimizer", "__init__"),
)


class _CpuDeviceMode(TorchFunctionMode):
    """Inside this mode, ``device="cuda"`` becomes the CPU, ``.cuda()`` and ``.pin_memory()`` return
    the tensor, ``pin_memory=True`` is dropped, and ``tensor.type()`` names the CUDA type."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0].to(rank_device())  # no copy on CPU; the check mode sees a move to the device
        if func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # Asserts like ``grad.type() == 'torch.cuda.FloatTensor'`` see the CUDA name.
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        if kwargs:
            if "device" in kwargs and is_cuda_device(kwargs["device"]):
                kwargs = dict(kwargs, device=rank_device())
            if kwargs.get("pin_memory"):
                kwargs = dict(kwargs, pin_memory=False)
        if func is torch.Tensor.to and args and len(args) > 1 and is_cuda_device(args[1]):
            args = (args[0], rank_device(), *args[2:])
        return func(*args, **kwargs)


def quiet_fallback_warnings() -> None:
    """Silence what megatron-core says on import, once per module: that it runs its plain-torch
    fallbacks where Transformer Engine and Apex are absent (every CPU run), and that the "full"
    recompute scope is deprecated. Nothing for a user to do, and a launcher's errors stay one line."""
    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine)( and Apex)? (is|are) not installed")
    warnings.filterwarnings("ignore", message=r"full scope is deprecated")


def _on_cpu(fn):
    """Wrap ``fn`` so that it runs under _CpuDeviceMode."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _CpuDeviceMode():
            return fn(*args, **kwargs)

    setattr(wrapper, _MARK, True)
    return wrapper


def _replace_everywhere(old, new) -> None:
    """Point every loaded megatron module attribute that holds ``old`` at ``new`` (catches
    ``from x import f`` copies made before the patch)."""
    for name, mod in list(sys.modules.items()):
        if mod is None or not name.startswith("megatron."):
            continue
        for attr, val in list(vars(mod).items()):
            if val is old:
                setattr(mod, attr, new)


# ---- RNG: the CPU default generator plays the role of the CUDA generator -----------------------

def _cpu_get_rng_state(device="cuda", clone=False, graph_safe=False):
    # Why: torch.cuda.random.get_rng_state raises without CUDA; the CPU generator is the device one.
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state, device=-1, graph_safe=False):
    # Why: megatron's version queues a CUDA generator update that never runs on CPU.
    torch.set_rng_state(new_state)


def _tracker_add(self, name, seed):
    # Why: the original reads/seeds torch.cuda's generator; here the tracked state is a CPU state.
    self._is_initialized = True
    if seed in self.seeds_:
        raise Exception(f"seed {seed} already exists")
    if name in self.states_:
        raise Exception(f"cuda rng state {name} already exists")
    self.seeds_.add(seed)
    saved = torch.get_rng_state()
    torch.manual_seed(seed)
    self.states_[name] = torch.get_rng_state()
    torch.set_rng_state(saved)


@contextlib.contextmanager
def _tracker_fork(self, name="model-parallel-rng"):
    # Why: the original warns whenever the CPU state changes inside a fork, which on CPU is every
    # dropout; otherwise the same protocol: swap the tracked state in, run, store it, swap back.
    if name not in self.states_:
        raise Exception(f"cuda rng state {name} is not added")
    outer_name = self._current_state_name
    outer_state = torch.get_rng_state()
    if outer_name != "default-rng":
        self.states_[outer_name] = outer_state
    torch.set_rng_state(self.states_[name])
    self._current_state_name = name
    try:
        yield
    finally:
        if self._current_state_name != name:
            raise Exception(f"current state name {self._current_state_name} is not the same as the "
                            f"desired state name {name}.")
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(self.states_[outer_name] if outer_name != "default-rng" else outer_state)
        self._current_state_name = outer_name


def _patch_rng() -> None:
    random = importlib.import_module("megatron.core.tensor_parallel.random")
    for attr, new in (("_get_cuda_rng_state", _cpu_get_rng_state), ("_set_cuda_rng_state", _cpu_set_rng_state)):
        old = getattr(random, attr)
        if not getattr(old, _MARK, False):
            setattr(new, _MARK, True)
            _replace_everywhere(old, new)
    tracker = random.CudaRNGStatesTracker
    for attr, new in (("add", _tracker_add), ("fork", _tracker_fork)):
        if not getattr(getattr(tracker, attr), _MARK, False):
            setattr(new, _MARK, True)
            setattr(tracker, attr, new)


def _patch_torch_cuda() -> None:
    if not getattr(torch.cuda.current_device, _MARK, False):
        def current_device():
            # Why: megatron uses it as the device of new tensors; without CUDA that is the CPU.
            return rank_device()

        def synchronize(device=None):
            # Why: CPU kernels are synchronous; the original raises without CUDA.
            return None

        for f in (current_device, synchronize):
            setattr(f, _MARK, True)
        torch.cuda.current_device = current_device
        torch.cuda.synchronize = synchronize


def _patch_device_hardcoding() -> None:
    for modname, attr in _DEVICE_WRAPPED:
        mod = importlib.import_module(modname)
        old = getattr(mod, attr)
        if not getattr(old, _MARK, False):
            _replace_everywhere(old, _on_cpu(old))
    methods = _METHODS_WRAPPED + (("megatron.core.models.common.language_module.language_module", "LanguageModule",
                                   "setup_embeddings_and_output_layer"),)
    for modname, cls_name, attr in methods:
        cls = getattr(importlib.import_module(modname), cls_name)
        old = getattr(cls, attr)
        if not getattr(old, _MARK, False):
            setattr(cls, attr, _on_cpu(old))


def apply_cpu_compat() -> bool:
    """Make megatron-core usable on CPU. Returns True if the CPU patches are (now) in place, False
    on a CUDA machine, where nothing is changed. Safe to call any number of times, before or after
    megatron modules are imported."""
    global _APPLIED
    if torch.cuda.is_available():
        return False
    if _APPLIED:
        return True
    _patch_torch_cuda()
    _patch_rng()
    _patch_device_hardcoding()
    _APPLIED = True
    return True


def cpu_compat_applied() -> bool:
    return _APPLIED
