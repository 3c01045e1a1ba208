"""Run a Megatron-LM entry script (``pretrain_gpt.py``); on a machine without CUDA, on CPU ranks.

Megatron-LM's training loop (``megatron/training``, not on PyPI) is written for GPUs: it asserts
CUDA, compiles its fused kernels with nvcc, imports triton unconditionally, allocates scalars
with ``device="cuda"`` and calls ``torch.cuda`` streams and memory statistics. On a machine without
CUDA this launcher makes it run on CPU ranks, unchanged, by patching those calls in-process before
the script starts (nothing in the checkout is modified):

* ``megatron_ext.runtime.compat.apply_cpu_compat()``: megatron-core on CPU (RNG tracker,
  ``torch.cuda.current_device``, hard-coded devices in the schedules and optimizers);
* the whole script runs under the compat layer's device mode: ``device="cuda"`` means the CPU,
  ``.cuda()`` and ``pin_memory`` are no-ops;
* ``torch.cuda`` streams, events and memory statistics become no-ops / zeros, and the "CUDA" RNG
  state is the CPU generator's; Megatron's ``get_device_arch_version()`` answers 0 (no GPU);
* ``initialize_megatron`` is called with ``allow_no_cuda=True``; model-parallel groups and the
  model-parallel RNG are set up as on one GPU per rank (Megatron skips both without a device);
* ``_compile_dependencies`` builds only the C++ dataset helpers (g++ + pybind11, once, on rank 0)
  and skips the nvcc fused kernels; the warm-up of the fused kernels (torch.compile) is skipped;
* without triton, ``batch_invariant_kernels`` (imported unconditionally, used only with
  ``--batch-invariant-mode``) is replaced by a stub that refuses that mode;
* flags that CPU runs need are added when absent (printed on rank 0): ``--distributed-backend
  gloo``, ``--transformer-impl local``, ``--no-gradient-accumulation-fusion``, and the fusions
  that need CUDA kernels off.

Usage, one process per rank (``scripts/run_local.sh`` and ``scripts/slurm/*.sbatch`` wrap this)::

    torchrun --standalone --nproc-per-node 4 -m megatron_ext.megatron.launch \\
        MEGATRON_LM/pretrain_gpt.py --flexsp --mock-data ...

A user error of megatron_ext's (``MegatronExtError``: a flag conflict, unreadable data, a batch no
plan holds) ends a rank with status 2, rank 0 saying it in one line ``megatron-ext: error: ...``.
Under torchrun that line is followed by torchrun's report of the failed ranks, so launchers check
the arguments first, once, before torchrun starts any rank (``scripts/run_local.sh`` does)::

    python -m megatron_ext.megatron.launch --check-args WORLD_SIZE MEGATRON_LM/pretrain_gpt.py ARGS

parses ARGS with the script's own parser as its rank 0 of WORLD_SIZE ranks would, megatron_ext's
validation and Megatron's ``validate_args`` included, and starts nothing: status 0, or 2 with the
error as the last line.

On a CUDA machine the launcher applies no patch: it only runs the script. In both cases the script
runs as ``__main__`` with a module spec named ``__main__``, so that processes started with the
``spawn`` method (the planner process of the data loader) do not import the whole training script
again, as they do for a script run by path.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import os
import signal
import subprocess
import sys
import sysconfig
import types
import warnings

from megatron_ext.errors import MegatronExtError
from megatron_ext.lifetime import die_with_parent, say_rank_error
from megatron_ext.megatron.arguments import env_rank

# Flags a CPU run needs, with the value to add when the user did not give the flag (None: a
# switch). Each entry is (flag, value, flags that mean the user chose otherwise).
CPU_DEFAULT_FLAGS: tuple[tuple[str, str | None, tuple[str, ...]], ...] = (
    ("--distributed-backend", "gloo", ()),
    ("--transformer-impl", "local", ()),
    ("--no-gradient-accumulation-fusion", None, ()),  # the fused wgrad GEMM is a CUDA kernel
    ("--no-masked-softmax-fusion", None, ("--masked-softmax-fusion",)),
    ("--no-bias-gelu-fusion", None, ()),
    ("--no-bias-swiglu-fusion", None, ()),
    ("--no-bias-dropout-fusion", None, ()),
    ("--no-rope-fusion", None, ()),
    ("--no-persist-layer-norm", None, ()),
)

_BIK = "megatron.core.transformer.custom_layers.batch_invariant_kernels"


def cpu_flags_to_add(argv: list[str]) -> list[str]:
    """The CPU_DEFAULT_FLAGS missing from ``argv`` (``--flag=value`` forms count as given)."""
    given = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    out: list[str] = []
    for flag, value, alternatives in CPU_DEFAULT_FLAGS:
        if flag in given or given.intersection(alternatives):
            continue
        out += [flag] if value is None else [flag, value]
    return out


# ---- torch.cuda without CUDA ---------------------------------------------------------------------
class _NoStream:
    """Stands for a CUDA stream or event: every method is a no-op."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        return lambda *a, **k: None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _patch_torch_cuda_runtime() -> None:
    """Streams, events and memory statistics: harmless stand-ins (CPU ops are synchronous and
    their memory is not tracked by the CUDA allocator)."""
    import torch

    cuda = torch.cuda
    cuda.Stream = _NoStream
    cuda.Event = _NoStream
    cuda.current_stream = lambda device=None: _NoStream()
    cuda.default_stream = lambda device=None: _NoStream()
    cuda.stream = lambda stream=None: contextlib.nullcontext()
    cuda.set_stream = lambda stream: None
    cuda.empty_cache = lambda: None
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        setattr(cuda, name, lambda device=None: 0)
    cuda.memory_stats = lambda device=None: {}
    cuda.reset_peak_memory_stats = lambda device=None: None
    cuda.get_device_name = lambda device=None: "cpu"
    # The "CUDA" generator is the CPU default generator on CPU ranks (as in runtime/compat.py).
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)


@contextlib.contextmanager
def _one_device_per_rank():
    """Inside: ``torch.cuda.device_count()`` is 1 and ``set_device`` a no-op, so that Megatron sets
    up its model-parallel groups and RNG as it does with one GPU per rank."""
    import torch

    saved = torch.cuda.device_count, torch.cuda.set_device
    torch.cuda.device_count = lambda: 1
    torch.cuda.set_device = lambda device: None
    try:
        yield
    finally:
        torch.cuda.device_count, torch.cuda.set_device = saved


def _with_one_device(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _one_device_per_rank():
            return fn(*args, **kwargs)
    return wrapper


# ---- triton ----------------------------------------------------------------------------------
def _stub_batch_invariant_kernels() -> None:
    """megatron/training/initialize.py imports this triton module unconditionally; it is only used
    by --batch-invariant-mode (CUDA kernels)."""
    if _BIK in sys.modules or importlib.util.find_spec("triton") is not None:
        return
    mod = types.ModuleType(_BIK)
    mod.__doc__ = "CPU stand-in (megatron_ext.megatron.launch): triton is not installed."

    def enable_batch_invariant_mode(*args, **kwargs):
        raise RuntimeError("--batch-invariant-mode needs triton and CUDA; it is not available on CPU ranks")

    mod.enable_batch_invariant_mode = enable_batch_invariant_mode
    mod.set_batch_invariant_mode = enable_batch_invariant_mode
    mod.disable_batch_invariant_mode = lambda *a, **k: None
    mod.is_batch_invariant_mode_enabled = lambda: False
    mod.__all__ = ["set_batch_invariant_mode", "is_batch_invariant_mode_enabled",
                   "disable_batch_invariant_mode", "enable_batch_invariant_mode"]
    sys.modules[_BIK] = mod


# ---- dataset helpers (C++) -------------------------------------------------------------------
def build_dataset_helpers(datasets_dir: str | None = None) -> str:
    """Compile megatron/core/datasets/helpers.cpp for this interpreter (g++ and pybind11, as
    Megatron's Makefile does, but with this Python's include flags and extension suffix rather
    than whatever ``python3`` is on PATH). Returns the path of the built module."""
    if datasets_dir is None:
        datasets_dir = os.path.dirname(importlib.import_module("megatron.core.datasets").__file__)
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    out = os.path.join(datasets_dir, "helpers_cpp" + suffix)
    if os.path.exists(out) and os.path.getmtime(out) >= os.path.getmtime(os.path.join(datasets_dir, "helpers.cpp")):
        return out
    try:
        import pybind11
    except ImportError:
        raise RuntimeError("building Megatron's dataset helpers needs pybind11: pip install pybind11") from None
    includes = f"-I{sysconfig.get_paths()['include']} -I{pybind11.get_include()}"
    cmd = ["make", "-C", datasets_dir, f"CPPFLAGS={includes}", f"LIBEXT={suffix}"]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"building Megatron's dataset helpers failed ({' '.join(cmd)}):\n{proc.stdout[-2000:]}")
    return out


def _cpu_compile_dependencies():
    """Megatron's _compile_dependencies without the nvcc fused kernels: the dataset helpers are
    built on rank 0 while the others wait."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        build_dataset_helpers()
    dist.barrier()


# ---- everything ----------------------------------------------------------------------------------
def prepare_cpu() -> bool:
    """Apply every patch above (idempotent). Returns False (and does nothing) when CUDA is
    available. Megatron-LM must be importable (its checkout first on sys.path)."""
    import torch

    if torch.cuda.is_available():
        return False
    _stub_batch_invariant_kernels()
    from megatron_ext.runtime.compat import apply_cpu_compat
    from megatron_ext.runtime.device import maybe_enable_device_check

    apply_cpu_compat()
    maybe_enable_device_check()  # MEGATRON_EXT_DEVICE_CHECK=1: our collectives under NCCL's rules
    _patch_torch_cuda_runtime()
    initialize = importlib.import_module("megatron.training.initialize")
    if not getattr(initialize, "_megatron_ext_cpu", False):
        initialize._initialize_distributed = _with_one_device(initialize._initialize_distributed)
        initialize._set_random_seed = _with_one_device(initialize._set_random_seed)
        initialize._compile_dependencies = _cpu_compile_dependencies
        # Why: the warm-up torch.compiles the fused kernels that CPU ranks turn off (CPU_DEFAULT_FLAGS);
        # it only costs start-up time here, and dynamo cannot trace it under the device check's mode.
        initialize._warmup_jit_function = lambda: None
        original = initialize.initialize_megatron

        @functools.wraps(original)
        def initialize_megatron(*args, **kwargs):
            kwargs["allow_no_cuda"] = True
            return original(*args, **kwargs)

        for modname in ("megatron.training.initialize", "megatron.training", "megatron.training.training"):
            mod = importlib.import_module(modname)
            if getattr(mod, "initialize_megatron", None) is original:
                mod.initialize_megatron = initialize_megatron
        initialize._megatron_ext_cpu = True
    utils = importlib.import_module("megatron.training.utils")
    if not getattr(utils.get_device_arch_version, "_megatron_ext_cpu", False):
        def get_device_arch_version():
            # Why: the original reads CUDA device 0's properties; arch 0 stands for "no GPU".
            return 0

        get_device_arch_version._megatron_ext_cpu = True
        for modname in ("megatron.training.utils", "megatron.training.arguments"):
            mod = importlib.import_module(modname)
            if hasattr(mod, "get_device_arch_version"):
                mod.get_device_arch_version = get_device_arch_version
    return True


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    world_to_check = None
    if argv[0] == "--check-args":
        if len(argv) < 3 or not argv[1].isdigit() or int(argv[1]) < 1:
            print("megatron-ext: error: usage: --check-args WORLD_SIZE SCRIPT [ARGS...]", file=sys.stderr)
            return 2
        world_to_check, argv = int(argv[1]), argv[2:]
        warnings.simplefilter("ignore")  # (the ranks show Megatron's import warnings)
    script = os.path.abspath(argv[0])
    if not os.path.isfile(script):
        print(f"megatron-ext: error: no such script: {argv[0]}", file=sys.stderr)
        return 2
    if world_to_check is None and "TORCHELASTIC_RUN_ID" in os.environ:
        # A rank of torchrun ends with it (killed, it would leave the ranks training as orphans; its
        # own stop reaches them as a signal first, which Megatron's --exit-signal-handler takes).
        die_with_parent(signal.SIGKILL)
    args = argv[1:]
    sys.path.insert(0, os.path.dirname(script))
    import torch

    cpu = not torch.cuda.is_available()
    added = cpu_flags_to_add(args) if cpu else []
    sys.argv = [script] + args + added
    if cpu:
        # Megatron asserts this for TP / CP on GPUs older than Blackwell (arch 0 here); no effect on CPU.
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
        prepare_cpu()
    if world_to_check is not None:  # (after the CPU patches: Megatron's validate_args asks the device too)
        return check_arguments(script, world_to_check, cpu)
    if added and env_rank() == 0:
        print(f"megatron_ext.megatron.launch: added for CPU ranks: {' '.join(added)}", flush=True)
    try:
        run_on_device(script, cpu)
    except MegatronExtError as e:  # bad data, a batch no plan holds: every rank raises it, rank 0 says it
        return say_rank_error(e, env_rank())
    if cpu:
        _destroy_process_group()
    return 0


def run_on_device(script: str, cpu: bool) -> None:
    """Run the script as ``__main__``; on CPU under the compat layer's device mode."""
    if not cpu:
        run_as_main(script)
        return
    from megatron_ext.runtime.compat import _CpuDeviceMode

    with _CpuDeviceMode():
        run_as_main(script)


def check_arguments(script: str, world_size: int, cpu: bool) -> int:
    """``--check-args WORLD_SIZE``: parse and validate the script's arguments as its rank 0 of
    ``world_size`` ranks does, megatron_ext's validation and then Megatron's own ``validate_args``
    (a conflict: one line on stderr, status 2), and start nothing: Megatron's ``pretrain`` is
    replaced by them alone. Launchers run this before torchrun, which would report a rank's exit in
    its own words after ours (and after a queue's wait, for a job)."""
    import io

    os.environ.update(RANK="0", WORLD_SIZE=str(world_size))
    _stub_batch_invariant_kernels()
    training = importlib.import_module("megatron.training")
    from megatron.training.arguments import parse_args, validate_args

    def parse_only(*args, extra_args_provider=None, args_defaults=None, **kwargs):
        parsed = parse_args(extra_args_provider)
        try:
            validate_args(parsed, args_defaults or {})
        except (AssertionError, ValueError, RuntimeError) as e:  # (how validate_args refuses)
            raise _MegatronRefusal(e) from e

    training.pretrain = parse_only
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # the ranks print the notes of what was adjusted
            run_on_device(script, cpu)
    except _MegatronRefusal as refusal:  # a message, or the assert itself
        import traceback

        e = refusal.__cause__
        where = traceback.extract_tb(e.__traceback__)[-1]
        said = str(e).strip() or f"{where.line} ({os.path.basename(where.filename)}:{where.lineno})"
        print(f"megatron-ext: error: Megatron refuses the arguments: {said}", file=sys.stderr)
        return 2
    return 0


class _MegatronRefusal(Exception):
    """Megatron's ``validate_args`` refused the arguments (its error is the cause)."""


def _destroy_process_group() -> None:
    """Megatron's ``pretrain`` leaves the process group to interpreter teardown, where gloo's
    threads can abort a rank that has finished ("terminate called without an active exception")."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def run_as_main(script: str) -> None:
    """Execute ``script`` as the ``__main__`` module, with a spec named ``__main__`` (see the module
    doc: spawned children then skip re-running it)."""
    spec = importlib.util.spec_from_file_location("__main__", script)
    module = importlib.util.module_from_spec(spec)
    saved = sys.modules.get("__main__")
    sys.modules["__main__"] = module
    try:
        spec.loader.exec_module(module)
    finally:
        if saved is not None:
            sys.modules["__main__"] = saved


if __name__ == "__main__":
    sys.exit(main())
