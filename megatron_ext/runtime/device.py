"""The rank's device, and a check mode that holds CPU ranks to NCCL's rules.

``rank_device()`` is where a rank's tensors live: ``cuda:<current device>`` on a GPU, the CPU
otherwise. Every tensor a collective or p2p touches must be there: NCCL refuses host tensors
("No backend type associated with device type cpu"), so code that creates a tensor without naming
the device runs on gloo CPU ranks and dies on a cluster.

The check mode (``MEGATRON_EXT_DEVICE_CHECK=1``, or ``enable_device_check()``) finds such code on
CPU ranks. It splits the CPU in two, the way a GPU machine is split: a tensor is *on the host*
when it was made without naming a device (``torch.tensor(...)``, ``torch.zeros(...)``,
``torch.from_numpy``), moved with ``.cpu()`` / ``.to("cpu")``, or computed from host tensors
only; it is *on the rank's device* when it was made with ``device=rank_device()`` (the object
itself: on CPU ranks it is the one ``torch.device`` this module hands out, which megatron also
receives through the compat layer's ``torch.cuda.current_device``), moved with ``.to(rank_device())``
/ ``.cuda()``, or computed with any device tensor among its inputs. ``tensor.device`` of a device
tensor answers ``rank_device()``, so ``device=x.device`` keeps working. Then every collective and
p2p issued by megatron_ext's own code is checked as NCCL would check it:
each tensor on the rank's device, of a dtype NCCL carries. A violation raises
``DeviceDisciplineError`` naming the collective and the tensor. ``CHECKED`` counts the calls that
passed, so a test can show the check ran.
"""
from __future__ import annotations

import collections
import functools
import os
import sys

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from megatron_ext.errors import ConfigError

_CPU = torch.device("cpu")
# NCCL's element types (ncclInt8 ... ncclBfloat16); torch sends bool as uint8.
NCCL_DTYPES = frozenset({torch.int8, torch.uint8, torch.bool, torch.int32, torch.int64, torch.float16,
                         torch.bfloat16, torch.float32, torch.float64})
_HOST = "_megatron_ext_on_host"
_FACTORIES = frozenset({torch.tensor, torch.as_tensor, torch.asarray, torch.zeros, torch.ones, torch.empty,
                        torch.full, torch.arange, torch.linspace, torch.logspace, torch.eye, torch.rand,
                        torch.randn, torch.randint, torch.randperm, torch.empty_strided, torch.scalar_tensor})
# Tensor-taking collectives of torch.distributed, and the argument holding their tensor(s).
_COLLECTIVES = {"all_reduce": 0, "broadcast": 0, "reduce": 0, "all_gather": (0, 1), "all_gather_into_tensor": (0, 1),
                "reduce_scatter_tensor": (0, 1), "all_to_all_single": (0, 1), "all_to_all": (0, 1), "send": 0,
                "recv": 0}  # (isend / irecv stay: P2POp checks its op by identity; batch_isend_irecv is checked)
_OBJECT_COLLECTIVES = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list")
CHECKED: collections.Counter = collections.Counter()


class DeviceDisciplineError(RuntimeError):
    """A collective got a tensor NCCL would refuse (off the rank's device, or a dtype it lacks)."""


def rank_device() -> torch.device:
    """The device of this rank's tensors: its CUDA device, or the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return _CPU


DEVICE_CHOICES = ("auto", "cpu", "cuda")


def choose_device(requested: str, local_ranks: int) -> str:
    """The device type ranks started here run on, "cuda" or "cpu", for ``--device auto|cpu|cuda``
    (auto: CUDA where there is one); refuses what cannot run with a one-line ConfigError."""
    cuda = torch.cuda.is_available()
    if requested == "cuda" and not cuda:
        raise ConfigError("--device cuda: CUDA is not available here (torch.cuda.is_available() is False); "
                          "use --device cpu or auto")
    device = "cuda" if cuda and requested != "cpu" else "cpu"
    if device == "cuda" and local_ranks > torch.cuda.device_count():
        raise ConfigError(f"{local_ranks} ranks need a GPU each; this machine has {torch.cuda.device_count()} "
                          f"(use a --cluster of that many GPUs, or --device cpu)")
    return device


def init_rank_process_group(requested: str = "auto") -> torch.device:
    """This rank's process group for ``--device requested`` (``choose_device``): NCCL with the rank
    on ``cuda:LOCAL_RANK``, or gloo on CPU ranks (the check mode turned on there when asked).
    Returns the rank's device."""
    if requested == "cpu" and torch.cuda.is_available():
        raise ConfigError("--device cpu: these ranks see CUDA, and megatron runs on CPU ranks only where it is "
                          "absent; start them with CUDA_VISIBLE_DEVICES= (as the megatron-ext launcher does)")
    if choose_device(requested, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))) == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl", device_id=rank_device())
    else:
        maybe_enable_device_check()
        dist.init_process_group("gloo")
    return rank_device()


def _on_host(t) -> bool:
    return isinstance(t, torch.Tensor) and t.__dict__.get(_HOST, False)


def host_to_device(t: torch.Tensor, device) -> torch.Tensor:
    """Host tensor ``t`` on ``device``. Onto a GPU through pinned memory, without the host waiting:
    a copy from pageable memory returns only once done, after every kernel queued before it, so
    the host could not queue the next operation's kernels while the GPU runs."""
    if is_cuda_device(device):
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def is_cuda_device(dev) -> bool:
    """Whether ``dev`` (a torch.device, a string or a bare index) names a CUDA device."""
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev.split(":")[0] == "cuda"
    return isinstance(dev, int) and not isinstance(dev, bool)  # a bare index is a CUDA device


def _names_rank_device(dev) -> bool:
    return dev is _CPU or is_cuda_device(dev)


def _tensors(args, kwargs):
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (x for x in a if isinstance(x, torch.Tensor))


def _is_descriptor(func, owner, name: str) -> bool:
    return getattr(func, "__self__", None) is owner and getattr(func, "__name__", "") == name


class _HostSplitMode(TorchFunctionMode):
    """Tracks which tensors are on the host (see the module doc)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_descriptor(func, torch.Tensor.device, "__get__"):
            real = func(*args)
            return _CPU if real.type == "cpu" and not _on_host(args[0]) else real
        if _is_descriptor(func, torch.Tensor.data, "__set__"):
            func(*args)
            args[0].__dict__[_HOST] = _on_host(args[1])
            return None
        host = self._placement(func, args, kwargs)
        out = func(*args, **kwargs)
        if host is None:
            return out
        if isinstance(out, torch.Tensor):
            if args and out is args[0] and _on_host(out) != host:
                if not (func in (torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu, torch.Tensor.pin_memory)):
                    return out  # in place: the tensor stays where it is
                out = out.view_as(out)  # a move that did not copy: a new tensor object on the other side
            out.__dict__[_HOST] = host
        elif isinstance(out, (list, tuple)):
            for t in out:
                if isinstance(t, torch.Tensor):
                    t.__dict__[_HOST] = host
        return out

    @staticmethod
    def _placement(func, args, kwargs):
        """True: the result is on the host; False: on the rank's device; None: not a tensor op."""
        if func is torch.Tensor.cuda:
            return False
        if func in (torch.Tensor.cpu, torch.Tensor.pin_memory):
            return True
        if "device" in kwargs:
            return not _names_rank_device(kwargs["device"])
        if func is torch.Tensor.to and len(args) > 1:
            target = args[1]
            if isinstance(target, torch.Tensor):
                return _on_host(target)
            if isinstance(target, (torch.device, str, int)) and not isinstance(target, bool):
                return not _names_rank_device(target)
        if func in _FACTORIES:
            return True
        inputs = list(_tensors(args, kwargs))
        if not inputs:
            return None
        return all(_on_host(t) for t in inputs)


def _caller_is_checked() -> bool:
    """Ours only: torch and megatron-core get their own right, and tests feed ours by hand."""
    return sys._getframe(2).f_globals.get("__name__", "").startswith("megatron_ext.")


def _check_tensor(op: str, t, group) -> None:
    where = f"{op} on group {dist.get_process_group_ranks(group) if group is not None else 'WORLD'}"
    if _on_host(t):
        raise DeviceDisciplineError(f"{where}: a host tensor {tuple(t.shape)} {t.dtype}; NCCL needs it on the "
                                    f"rank's device (create it with device=rank_device(), or move it there)")
    if t.dtype not in NCCL_DTYPES:
        raise DeviceDisciplineError(f"{where}: dtype {t.dtype} of a tensor {tuple(t.shape)} is not one NCCL carries")


def _checked_collective(op: str, fn, positions):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _caller_is_checked():
            group = kwargs.get("group")
            for i in (positions if isinstance(positions, tuple) else (positions,)):
                arg = args[i] if i < len(args) else None
                for t in arg if isinstance(arg, (list, tuple)) else (arg,):
                    if isinstance(t, torch.Tensor):
                        _check_tensor(op, t, group)
            CHECKED[op] += 1
        return fn(*args, **kwargs)
    return wrapper


def _checked_batch(fn):
    @functools.wraps(fn)
    def wrapper(p2p_op_list, *args, **kwargs):
        if _caller_is_checked():
            for p2p in p2p_op_list:
                _check_tensor(f"batch_isend_irecv ({p2p.op.__name__})", p2p.tensor, p2p.group)
            CHECKED["batch_isend_irecv"] += 1
        return fn(p2p_op_list, *args, **kwargs)
    return wrapper


def _counted(op: str, fn):
    # Object collectives move their own buffers to the current CUDA device on NCCL: count only.
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _caller_is_checked():
            CHECKED[op] += 1
        return fn(*args, **kwargs)
    return wrapper


_ENABLED = False


def device_check_requested() -> bool:
    return os.environ.get("MEGATRON_EXT_DEVICE_CHECK", "") not in ("", "0")


def enable_device_check() -> None:
    """Turn the check mode on in this process, for good (idempotent). CPU ranks only: on a GPU the
    real backend checks."""
    global _ENABLED
    if _ENABLED or torch.cuda.is_available():
        return
    for op, positions in _COLLECTIVES.items():
        setattr(dist, op, _checked_collective(op, getattr(dist, op), positions))
    dist.batch_isend_irecv = _checked_batch(dist.batch_isend_irecv)
    for op in _OBJECT_COLLECTIVES:
        setattr(dist, op, _counted(op, getattr(dist, op)))
    from_numpy = torch.from_numpy

    @functools.wraps(from_numpy)
    def host_from_numpy(array):
        t = from_numpy(array)
        t.__dict__[_HOST] = True
        return t

    torch.from_numpy = host_from_numpy
    _HostSplitMode().__enter__()
    _ENABLED = True


def maybe_enable_device_check() -> None:
    """``enable_device_check()`` when ``MEGATRON_EXT_DEVICE_CHECK`` asks for it."""
    if device_check_requested():
        enable_device_check()
