"""Checkpoints of ``megatron-ext train`` (``--save`` / ``--load``) in megatron-core's distributed format.

A save directory is laid out as Megatron-LM lays out its ``torch_dist`` checkpoints:
``DIR/latest_checkpointed_iteration.txt`` holds the number of steps done by the newest complete
checkpoint, ``DIR/iter_0000004/`` holds that checkpoint: ``dist_checkpointing`` files of every
stage's model and optimizer (Adam moments and step count) and every rank's RNG states (Python,
numpy, torch CPU and CUDA, megatron's tracker), plus ``megatron_ext.json``, the settings of the
run that wrote it (``run_identity``), which a resuming run must share, and the size and CRC-32 of
every file the checkpoint holds, which a resuming run checks before it launches (a lost, cut-short
or changed shard is one line, not a traceback on every rank or NaN steps).

A save is written to a hidden folder beside its ``iter_`` folder and renamed to it once whole, so
the tracker never names a folder that is being written (a save of a step already saved sets that
one aside only then, and the next save or ``--load`` puts it back if the run was killed between
the two renames; the next save clears what a run killed while saving left).

What else a resumed run needs is not stored because it is a function of what is: the data
position is the steps done (step k's global batch is a function of the data, seed, batch size and
cut length alone, see ``data/batches.py``, so the loader restarts at step k), and the planners
keep no state from one step to the next (each plan is a function of the step's lengths, the cost
model and the options, and of how far a solver gets within its time limit, in a resumed run as in
an uninterrupted one; two plans of one batch give the same loss to float rounding).

A stop signal saves too (``save_and_stop_on_signals``, under ``--save``): every rank learns it
after the step it is running (``stop_requested_anywhere``), saves and ends the loop.

Only this module's ``check_checkpoint_args`` runs before launching (it reads JSON, no torch);
saving and loading are collective over every rank.
"""
from __future__ import annotations

import json
import math
import shutil
import zlib
from pathlib import Path

import numpy as np

from megatron_ext.data.lengths import SAMPLE_RULE
from megatron_ext.errors import ConfigError, SaveError
from megatron_ext.files import replacing

TRACKER_FILE = "latest_checkpointed_iteration.txt"  # Megatron-LM's name
RUN_FILE = "megatron_ext.json"  # not metadata.json: dist_checkpointing writes that one
FILES_KEY = "files"  # RUN_FILE's list of the checkpoint's files and their sizes (not a run setting)
CRC_KEY = "crc32"  # ... and their CRC-32s (a shard damaged in place keeps its size)

# what each run_identity key is called on the command line, for the refusal
_OPTIONS = {"model": "--model", "ranks": "ranks (--cluster)", "pp": "--pp",
            "vocab_size": "--vocab-size", "seed": "--seed", "global_batch": "--global-batch",
            "max_seq_len": "--max-seq-len", "sample_rule": "documents cut into samples as", "lr": "--lr"}
DATA_KEY = "documents"  # the data's fingerprint (``data_fingerprint``), checked by the ranks once they read it
BLEND_KEY = "blend"  # ... and its weighted blend (``blend_fingerprint``; absent from checkpoints saved before it)
TOKENS_KEY = "tokens"  # ... and its tokens, sampled (``tokens_fingerprint``; absent from checkpoints saved before it)

_stop_requested = False


def run_identity(args, cost, data) -> dict:
    """``run_settings`` and the data's fingerprints (``DATA_KEY``, ``BLEND_KEY``, ``TOKENS_KEY``): what
    a checkpoint is saved with."""
    return {**run_settings(args, cost), DATA_KEY: data_fingerprint(data), BLEND_KEY: blend_fingerprint(data),
            TOKENS_KEY: tokens_fingerprint(data)}


def run_settings(args, cost) -> dict:
    """What a checkpoint shares with the runs that may resume it: the model's shapes, the ranks
    and pipeline stages its states are spread over (one RNG state per rank), the data stream
    (step k's batch is a function of the data, ``data_fingerprint``, checked by the ranks once they
    read it, the seed, batch size, cut length and the rule that cuts, ``data.lengths.SAMPLE_RULE``)
    and the learning rate (the optimizer state carries it). Not the planner, the SP degrees or the
    attention backend: they change how a step is computed, not what; not the data's path (moved
    data resumes)."""
    m = cost.model
    return {"model": f"{m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads "
                     f"({m.kv_heads} KV), FFN {m.ffn_hidden_size or 4 * m.hidden_size}"
                     + (" SwiGLU" if m.swiglu else ""),
            "ranks": cost.num_gpus, "pp": args.pp, "vocab_size": args.vocab_size, "seed": args.seed,
            "global_batch": args.global_batch, "max_seq_len": args.max_seq_len, "sample_rule": SAMPLE_RULE,
            "lr": args.lr}


def data_fingerprint(data) -> str:
    """The documents a run draws its batches from (``runtime.train.TrainingData``), by content:
    their count, tokens and the CRC-32 of their lengths (a corpus of other lengths differs; the
    same files under another path, or the default corpus named by its path, do not; the same
    lengths tokenized otherwise: ``tokens_fingerprint``)."""
    lengths = np.ascontiguousarray(np.asarray(data.documents.lengths, dtype=np.int64))
    return f"{lengths.size} documents, {int(lengths.sum())} tokens, lengths CRC-32 {zlib.crc32(lengths):08x}"


def tokens_fingerprint(data, samples: int = 64) -> str:
    """The documents' tokens, sampled: the CRC-32 of ``samples`` documents spread evenly over them
    (the lengths alone do not tell a corpus from the same one tokenized otherwise), read in a few
    milliseconds whatever the corpus's size."""
    docs = data.documents
    n = min(samples, len(docs))
    crc = 0
    for i in np.unique(np.linspace(0, len(docs) - 1, n).astype(np.int64)).tolist():
        crc = zlib.crc32(np.ascontiguousarray(docs.get(i), dtype=np.int64), crc)
    return f"tokens of {n} documents, CRC-32 {crc:08x}"


def blend_fingerprint(data) -> str:
    """How a weighted blend draws from its sources (which documents each batch holds): their
    sizes and weights; "unweighted" for one source or a plain concatenation."""
    if data.weights is None:
        return "unweighted"
    weights = [float(w) for w in data.weights]
    total = sum(weights)
    if not math.isfinite(total):  # (huge weights: their sum overflows; by the largest first, as GlobalBatches does)
        top = max(weights)
        weights = [w / top for w in weights]
        total = sum(weights)
    return (f"{' + '.join(map(str, data.source_sizes))} documents at weights "
            f"{' : '.join(f'{w / total:.6g}' for w in weights)}")


def check_resumed_data(root: str, data) -> None:
    """Refuse to resume a checkpoint on other data or another blend of it (the ranks, once they have
    read it; the launcher compares the other settings, ``check_checkpoint_args``)."""
    _, path = latest_checkpoint(root)
    saved = json.loads((path / RUN_FILE).read_text())
    for key, fingerprint, what in ((DATA_KEY, data_fingerprint, "other data"),
                                   (BLEND_KEY, blend_fingerprint, "another blend of its data"),
                                   (TOKENS_KEY, tokens_fingerprint, "other tokens in documents of the same lengths")):
        if saved.get(key) is None:  # (a checkpoint saved before it was compared)
            continue
        ours = fingerprint(data)
        if saved[key] != ours:
            raise ConfigError(f"--load {root}: its checkpoint was saved by a run on {what} ({saved[key]}), this "
                              f"run's --data holds {ours}; resume on the data it was saved with")


def resume_from(args) -> str | None:
    """The directory a run resumes from: ``--load``, but for ``--save``'s own directory before it
    holds anything (no tracker, no ``iter_`` folder): a job requeued with one command line
    (``--load DIR --save DIR``) starts fresh the first time, as Megatron-LM does. Any other
    ``--load`` must hold a checkpoint (a misspelt one is an error, not a fresh start)."""
    if not args.load:
        return None
    if args.save and Path(args.load).resolve() == Path(args.save).resolve() and not _holds_any(args.load):
        return None
    return args.load


def _holds_any(root: str) -> bool:
    """Whether ``root`` holds a checkpoint or the start of one (a tracker or an ``iter_`` folder)."""
    return Path(root).is_dir() and ((Path(root) / TRACKER_FILE).exists() or any(Path(root).glob("iter_*")))


def holds_checkpoint(root: str) -> bool:
    """Whether ``root`` holds a checkpoint ``latest_checkpoint`` finds (a tracker, or a complete
    ``iter_`` folder)."""
    try:
        latest_checkpoint(root)
    except ConfigError:
        return (Path(root) / TRACKER_FILE).is_file()  # (one naming a missing or damaged folder: refused later)
    return True


def check_save_dir(args) -> None:
    """Refuse a ``--save`` directory that holds a checkpoint this run does not resume: its saves
    would take the tracker from it (a later ``--load`` would find that run's progress gone)."""
    if not args.save or not _holds_any(args.save):
        return
    resumed = resume_from(args)
    if resumed is None or Path(resumed).resolve() != Path(args.save).resolve():
        raise ConfigError(f"--save {args.save} holds a checkpoint this run does not resume (it resumes "
                          f"{'nothing' if resumed is None else resumed}): its saves would replace it; resume "
                          f"it (--load {args.save}) or save to another directory")


def latest_checkpoint(root: str) -> tuple[int, Path]:
    """The steps done by the newest checkpoint in ``root`` and its directory: the tracker's, or
    without one the newest complete ``iter_`` folder's (one-line errors for a directory that holds
    none)."""
    tracker = Path(root) / TRACKER_FILE
    if not Path(root).is_dir():
        raise ConfigError(f"--load {root}: no such directory")
    if not tracker.is_file():
        # a run killed between its first save's rename and its tracker, or folders copied without
        # the tracker: the newest complete one (its run file is written last, before the rename)
        complete = sorted((int(p.name[5:]), p) for p in Path(root).glob("iter_*")
                          if p.name[5:].isdigit() and (p / RUN_FILE).is_file())
        if complete:
            return complete[-1]
        raise ConfigError(f"--load {root} holds no checkpoint (no {TRACKER_FILE}; `train --save {root}` writes one)")
    text = tracker.read_text(errors="replace").strip()
    if not (text.isascii() and text.isdigit()):
        raise ConfigError(f"--load {root}: {TRACKER_FILE} should hold a step count, not {text[:40]!r}")
    path = Path(root) / f"iter_{int(text):07d}"
    if not (path / RUN_FILE).is_file():
        raise ConfigError(f"--load {root}: {TRACKER_FILE} names step {text}, but {path} holds no complete checkpoint")
    return int(text), path


def restore_replaced(root: str) -> None:
    """Put back an earlier save of a step that a save of the same step, killed between its two
    renames, left set aside (``.iter_N.replaced`` with ``iter_N`` gone: the tracker names it)."""
    for kept in Path(root).glob(".iter_*.replaced"):
        name = Path(root) / kept.name[1:-len(".replaced")]
        if not name.exists() and (kept / RUN_FILE).is_file():
            kept.rename(name)


def check_checkpoint_args(args, cost, read_files: bool = True) -> None:
    """Refuse ``--save-interval`` below 1 or without ``--save``, and a ``--load`` directory that
    holds no checkpoint, a damaged one (``read_files``: its files' CRC-32s too, not only their
    sizes) or one of a run this one cannot continue (``run_identity``)."""
    if args.save_interval is not None and not args.save:
        raise ConfigError("--save-interval applies to --save")
    if args.save_interval is not None and args.save_interval < 1:
        raise ConfigError(f"--save-interval must be at least 1, got {args.save_interval}")
    check_save_dir(args)
    if resume_from(args) is None:
        return
    if Path(args.load).is_dir():
        restore_replaced(args.load)
    step, path = latest_checkpoint(args.load)
    try:
        saved = json.loads((path / RUN_FILE).read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"--load {args.load}: {path / RUN_FILE} is damaged ({e}); resume from another "
                          f"checkpoint (point {TRACKER_FILE} at it)") from None
    if not isinstance(saved, dict):
        raise ConfigError(f"--load {args.load}: {path / RUN_FILE} is damaged (not a JSON object)")
    _check_files(args.load, path, saved.get(FILES_KEY, {}), saved.get(CRC_KEY) if read_files else None)
    ours = run_settings(args, cost)
    for key, option in _OPTIONS.items():
        if saved.get(key) != ours[key]:
            raise ConfigError(f"--load {args.load}: its step-{step} checkpoint was saved by a run with {option} "
                              f"{_shown(saved.get(key))}, this run has {_shown(ours[key])}; resume with the same "
                              f"settings")


def file_crc32(path: Path) -> int:
    """CRC-32 of a file's bytes (zlib's), read a MB at a time."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


def _check_files(root: str, path: Path, files, crcs) -> None:
    """Every file the save wrote is there at the size and CRC-32 it wrote (a checkpoint saved
    before CRCs were kept: its sizes)."""
    damaged = f"--load {root}: {path} is damaged"
    again = f"; resume from another checkpoint (point {TRACKER_FILE} at it)"
    if not (isinstance(files, dict) and all(type(size) is int for size in files.values())):
        raise ConfigError(f"{damaged} ({RUN_FILE}'s {FILES_KEY} is not a mapping of file names to sizes){again}")
    if crcs is not None and not (isinstance(crcs, dict) and set(crcs) == set(files)
                                 and all(type(c) is int for c in crcs.values())):
        raise ConfigError(f"{damaged} ({RUN_FILE}'s {CRC_KEY} does not match its {FILES_KEY}){again}")
    for name, size in files.items():
        f = path / name
        if not f.is_file():
            raise ConfigError(f"{damaged}: {name} is missing{again}")
        if f.stat().st_size != size:
            raise ConfigError(f"{damaged}: {name} has {f.stat().st_size:,} bytes, {size:,} were saved{again}")
        if crcs is not None and file_crc32(f) != crcs[name]:
            raise ConfigError(f"{damaged}: {name} does not hold the bytes that were saved (its CRC-32 differs){again}")


def _first_cause(error: BaseException) -> str:
    """What went wrong first, in one line: the error at the root of ``error``'s causes (torch's
    CheckpointException: of the first rank's failure, which it gathers from every rank)."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        first = failures[min(failures)]
        error = first[0] if isinstance(first, tuple) else first
    while error.__cause__ is not None or error.__context__ is not None:
        error = error.__cause__ or error.__context__
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if lines and lines[0].startswith("Weights only load failed"):
        # (torch's advice to load with weights_only=False: unsafe, and not this run's to take)
        lines = [f"a file torch will not unpickle safely ({lines[-1][:200]})"]
    return f"{type(error).__name__}: {lines[0][:300]}" if lines else type(error).__name__


def _shown(value) -> str:
    if value is None:
        return "not given"
    return " ".join(value) if isinstance(value, list) else str(value)


def request_stop() -> None:
    """Ask the training loop to stop after the step it is running, saving a checkpoint first
    under ``--save``: what a SIGTERM handler calls (it only sets a flag, so it is safe there)."""
    global _stop_requested
    _stop_requested = True


def stop_requested() -> bool:
    """Whether this rank was asked to stop (``request_stop``)."""
    return _stop_requested


def save_and_stop_on_signals() -> None:
    """Under ``--save``: the first stop signal (``lifetime.STOP_SIGNALS``: the launcher's, passed
    on by torchrun; Slurm's before the time limit) lets the running step finish, saves it and ends
    the run, as Megatron's exit-signal handler does. Later ones are the same stop reaching this
    rank again (Slurm signals every process of the job step, torchrun passes its own on) and are
    ignored: torchrun kills a rank whose step and save outlast its 30 s. Main thread only; also
    starts megatron's checkpoint-writer queue out of the signals' reach (below)."""
    import signal

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from megatron_ext.lifetime import STOP_SIGNALS, blocked_in_children, ignore, main_module_hidden

    def first(signum, frame):
        request_stop()
        for sig in STOP_SIGNALS:
            signal.signal(sig, ignore)

    for sig in STOP_SIGNALS:
        signal.signal(sig, first)
    # megatron-core's checkpoint writer keeps its results queue in a Manager process it starts at the
    # first save, in this rank's process group: the stop signal (torchrun's to the group, Slurm's to
    # every process) would end it, and the save on that stop fail (BrokenPipeError). Started now,
    # it never gets them (``kill_leftovers`` ends it if this rank is killed outright).
    with blocked_in_children(*STOP_SIGNALS), main_module_hidden():
        filesystem_async._get_write_results_queue()


def stop_requested_anywhere(device) -> bool:
    """Whether any rank was asked to stop (collective: every rank asks after every step, so all
    stop after the same one)."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([int(_stop_requested)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _rng_states() -> dict:
    """This rank's random states, under Megatron-LM's names."""
    import random

    import numpy as np
    import torch
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(),
            "cuda_rng_state": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "rng_tracker_states": get_cuda_rng_tracker().get_states()}


def _set_rng_states(states: dict) -> None:
    import random

    import numpy as np
    import torch
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.setstate(states["random_rng_state"])
    np.random.set_state(states["np_rng_state"])
    torch.set_rng_state(states["torch_rng_state"])
    if states["cuda_rng_state"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda_rng_state"])
    get_cuda_rng_tracker().set_states(states["rng_tracker_states"])


def _sharded_state_dict(model, optimizer, is_loading: bool) -> dict:
    """What is saved, as Megatron-LM's ``generate_state_dict`` gathers it: the stage's model, its
    optimizer (keyed by the model's sharded parameters) and one RNG shard per rank."""
    import torch.distributed as dist
    from megatron.core.dist_checkpointing import ShardedObject

    model_state = model.module.sharded_state_dict()
    return {"model": model_state, "optimizer": optimizer.sharded_state_dict(model_state, is_loading=is_loading),
            "rng_state": ShardedObject("rng_state", _rng_states(), (dist.get_world_size(),), (dist.get_rank(),),
                                       replica_id=0)}


# how torch.save reports a write that failed (megatron-core's common.pt, rank 0's first write): a
# RuntimeError, not the OSError (a full disk: "basic_ios::clear: iostream error" or "[enforce fail
# at inline_container.cc] ... unexpected pos")
TORCH_WRITE_FAILURES = ("PytorchStreamWriter", "inline_container", "iostream error", "file write failed")


def save_checkpoint(root: str, steps_done: int, model, optimizer, identity: dict) -> Path:
    """Save the run after ``steps_done`` steps to ``root``/iter_NNNNNNN (collective), then point
    the tracker at it: a run killed while saving leaves the previous checkpoint the latest, and an
    earlier save of the same step as it was."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
    from torch.distributed.checkpoint.api import CheckpointException

    path = Path(root) / f"iter_{steps_done:07d}"
    writing = path.with_name(f".{path.name}.saving")
    try:
        if dist.get_rank() == 0:
            restore_replaced(root)
            for left in Path(root).glob(".iter_*.*"):  # what a run killed while saving left, of any step
                shutil.rmtree(left, ignore_errors=True)
            writing.mkdir(parents=True)
        dist.barrier()
        # each stage's data-parallel ranks hold the same states: they share the writing
        strategy = FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy(),
                                                    parallel_state.get_data_parallel_group())
        dist_checkpointing.save(_sharded_state_dict(model, optimizer, is_loading=False), str(writing), strategy)
        dist.barrier()  # every rank's files are written
        if dist.get_rank() == 0:
            _finish_save(root, path, writing, steps_done, identity)
    except (OSError, CheckpointException, RuntimeError) as e:  # (a full disk, a read-only folder: one line)
        failed = save_failure(e, root, steps_done)
        if failed is None:
            raise  # (a broken collective: a rank died, which the launcher reports)
        raise failed from e
    dist.barrier()
    return path


def save_failure(error: BaseException, root: str, steps_done: int) -> SaveError | None:
    """The one-line error of a save that could not be written, or None for an error that is not
    about writing (a RuntimeError other than torch's writer's: a broken collective)."""
    if isinstance(error, RuntimeError) and not any(w in str(error) for w in TORCH_WRITE_FAILURES):
        return None
    try:
        newest = f"the newest checkpoint stays {latest_checkpoint(root)[1]}"
    except ConfigError:
        newest = "no checkpoint was saved before it"
    return SaveError(f"cannot save step {steps_done} to {root}: {_first_cause(error)}; {newest}")


def _finish_save(root: str, path: Path, writing: Path, steps_done: int, identity: dict) -> None:
    """Rank 0: the run file (the files' sizes and CRC-32s), the folder's final name, the tracker."""
    written = [f for f in sorted(writing.rglob("*")) if f.is_file()]
    files = {str(f.relative_to(writing)): f.stat().st_size for f in written}
    crcs = {str(f.relative_to(writing)): file_crc32(f) for f in written}
    (writing / RUN_FILE).write_text(json.dumps({**identity, FILES_KEY: files, CRC_KEY: crcs}, indent=1) + "\n")
    replaced = path.with_name(f".{path.name}.replaced")
    if path.exists():  # an earlier save of this step: set aside until this one has its name
        shutil.rmtree(replaced, ignore_errors=True)
        path.rename(replaced)
    writing.rename(path)
    with replacing(Path(root) / TRACKER_FILE) as tmp:
        tmp.write_text(f"{steps_done}\n")
    shutil.rmtree(replaced, ignore_errors=True)  # (a shared file system may hold on to some of it)


def load_checkpoint(root: str, model, optimizer) -> tuple[int, Path]:
    """Load the newest checkpoint of ``root`` into the model, the optimizer and this rank's RNGs
    (collective; ``check_checkpoint_args`` has compared the runs). Returns the steps it had done
    (the next step's index) and its directory."""
    import logging
    import warnings

    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException

    steps_done, path = latest_checkpoint(root)
    # torch's checkpoint reader logs a traceback on the root logger before it falls back from a
    # file it cannot read, and the error below says it once
    root_logger = logging.getLogger()
    level = root_logger.level
    root_logger.setLevel(logging.ERROR)
    with warnings.catch_warnings():  # megatron-core's use of torch APIs torch deprecates: nothing for a user to do
        warnings.filterwarnings("ignore", message=r"(`load_state_dict` is deprecated|Please use DTensor instead)",
                                category=FutureWarning)
        # (megatron's fully parallel load exchanges tensors on CUDA only; each rank reads its stage's states)
        try:
            state = dist_checkpointing.load(_sharded_state_dict(model, optimizer, is_loading=True), str(path))
            model.module.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            _set_rng_states(state["rng_state"])
        except (Exception, CheckpointException) as e:  # files of the right sizes that cannot be read
            raise ConfigError(f"--load {root}: {path} could not be loaded ({_first_cause(e)}); resume from "
                              f"another checkpoint (point {TRACKER_FILE} at it)") from e
        finally:
            root_logger.setLevel(level)
    return steps_done, path
