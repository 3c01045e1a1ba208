"""The argument groups several commands share, and what they turn into.

- ``add_batch_source_args``: ``--lengths FILE``, ``--dist NAME`` or ``--data PREFIX`` (``plan``, ``simulate``);
- ``add_cost_args`` / ``cost_from_args``: the model, cluster, cost-model YAML and ZeRO stage;
- ``add_planner_args`` / ``options_from_args``: the FlexSP-kind planner and its options (``plan``, ``bench``);
- ``add_pipeline_args`` / ``pipeline_options_from_args``: ``--memory-mb``, ``--plot``, ``--trace`` and the
  pipeline planners' options (``plan``, ``simulate``); ``check_args`` refuses what they cannot run;
- ``ArgumentParser``: argparse's, with one-line usage errors;
- ``check_output_file`` / ``check_output_dir``: an output path that cannot be written, refused before the
  work that would fill it (every command that writes one).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import tempfile
from pathlib import Path

from megatron_ext.cost import CostModel
from megatron_ext.cost.model import check_presets_not_beside_file
from megatron_ext.data.lengths import DISTRIBUTIONS
from megatron_ext.errors import ConfigError
from megatron_ext.planner import PlannerOptions
from megatron_ext.planner.api import PIPELINE_KINDS, PLANNERS, PP_BASELINES, planner_names, planners_help
from megatron_ext.spec import MAX_LENGTH

PLOT_FORMATS = (".png", ".pdf", ".svg")


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser (every command's), its usage errors one line as any other bad input:
    ``megatron-ext: error: argument --pp: invalid int value: 'x' (see megatron-ext plan --help)``."""

    def error(self, message: str):
        self.exit(2, f"megatron-ext: error: {message} (see {self.prog} --help)\n")


PIPELINE_ONLY = {"pp": "--pp", "sp": "--sp", "b1_scale": "--b1-scale"}  # options that only pipeline planners use
# ... and only elastic_pp (auto's pipelines too): the baselines' recompute is their own (none if it fits, else all)
ELASTIC_ONLY = {"recompute": "--recompute", "recompute_ties": "--recompute-ties"}




def parse_tokens(text: str) -> int:
    """'384K' -> 393216, '1M' -> 1048576, '8192' -> 8192, '1.5K' -> 1536."""
    t = text.strip().upper()
    scale = {"K": 1024, "M": 1024**2}.get(t[-1:], 1)
    try:
        exact = float(t[:-1] if scale > 1 else t) * scale
        value = int(exact)
    except (ValueError, OverflowError):  # not a number, or inf / nan
        raise argparse.ArgumentTypeError(f"expected a token count like 8192 or 384K, got {text!r}") from None
    if value != exact:
        raise argparse.ArgumentTypeError(f"expected a whole number of tokens, got {text!r}")
    if not 1 <= value <= MAX_LENGTH:
        raise argparse.ArgumentTypeError(f"expected a token count from 1 to {MAX_LENGTH:,}, got {text!r}")
    return value


def path_arg(text: str) -> str:
    """A file or folder argument: not empty (an empty one was taken as not given)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a path, got {text!r}")
    return text


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


DEFAULT_MODEL, DEFAULT_CLUSTER = "gpt-7b", "a100-40g-8x8"
MAX_BATCHES = 10_000  # batches one command plans (simulate --steps, bench --batches): past this, a typo


def add_cost_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and cluster")
    g.add_argument("--model", help=f"model preset or YAML path (default: {DEFAULT_MODEL})")
    g.add_argument("--cluster", help=f"cluster preset or YAML path (default: {DEFAULT_CLUSTER})")
    g.add_argument("--cost-model", type=path_arg, metavar="PATH",
                   help="cost-model YAML (the model and the cluster: not with --model / --cluster)")
    g.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3],
                   help="ZeRO stage of the model states (16 bytes a parameter), a what-if: 0 every GPU holds them all "
                        "(DDP), 1 optimizer states and master weights sharded over the GPUs (Megatron's "
                        "--use-distributed-optimizer), 2 gradients too, 3 parameters too (FSDP; the FlexSP paper's "
                        "setting); default 3, or with --cost-model the file's zero_stage")
    g.add_argument("--max-ring", type=positive_int, default=1, metavar="R",
                   help="groups may reach past the heads' Ulysses limit with a ring (context parallel) of up to R "
                        "Ulysses subgroups, K/V passed around it (a power of two; default 1: Ulysses only)")


def add_planner_args(p: argparse.ArgumentParser, kinds: tuple[str, ...] = (), drop_over_max: bool = True) -> None:
    """``--planner`` (one of ``kinds``, default all), its time limit and baselines' degree, and
    ``--drop-over-max`` where the command may fail on a sequence (``bench`` always drops them)."""
    g = p.add_argument_group("planner")
    g.add_argument("--planner", default="flexsp",
                   help=f"one of: {planners_help(*kinds)}; default flexsp")
    g.add_argument("--time-limit", type=float, default=1.0, metavar="SEC", help="solver time limit per step (default 1)")
    g.add_argument("--static-degree", type=int, help="degree of static_ulysses (default: the largest allowed)")
    if drop_over_max:
        g.add_argument("--drop-over-max", action="store_true",
                       help="drop (and report) sequences over --max-seq-len or what the planner can run (no "
                            "group holds them, no stage at its finest slicing) instead of failing")


NOTED: set[str] = set()  # notes said by this command (train --compare checks each run's options twice)


def note_unused_ring(cost: CostModel, largest: int | None = None) -> None:
    """Say so, once, where ``--max-ring`` changes nothing: Ulysses groups already span every GPU
    of the largest cluster the command plans for (``largest``, default the cost model's)."""
    gpus = largest or cost.num_gpus
    if cost.max_ring > 1 and cost.model.max_sp_degree >= gpus:
        note = (f"note: --max-ring {cost.max_ring} changes nothing here: {cost.model.name}'s Ulysses groups "
                f"already span all {gpus} GPUs (its heads allow degree {cost.model.max_sp_degree})")
        if note not in NOTED:
            NOTED.add(note)
            print(note, file=sys.stderr)


def cost_from_args(args, largest: int | None = None) -> CostModel:
    """The cost model of the options; ``largest``: the most GPUs the command plans for (bench's
    --gpus and scale row), for ``note_unused_ring``."""
    if args.cost_model is not None:
        check_presets_not_beside_file(args.model, args.cluster)
        cost = CostModel.from_yaml(args.cost_model)
        if args.zero_stage is not None:  # (a what-if on a measured model: its fixed costs follow the stage)
            cost = dataclasses.replace(cost, zero_stage=args.zero_stage)
    else:
        cost = CostModel.from_presets(DEFAULT_MODEL if args.model is None else args.model,  # ("": an unknown preset)
                                      DEFAULT_CLUSTER if args.cluster is None else args.cluster,
                                      3 if args.zero_stage is None else args.zero_stage)
    cost = cost.with_max_ring(getattr(args, "max_ring", 1))
    note_unused_ring(cost, largest)
    memory = getattr(args, "memory_mb", None)  # plan / simulate: one budget for every planner
    return cost if memory is None else cost.with_memory(memory)


def _time_limit(args) -> float:
    t = getattr(args, "time_limit", 1.0)
    if not (math.isfinite(t) and t > 0):
        raise ConfigError(f"--time-limit must be a finite number of seconds over 0, got {t}")
    return t


def options_from_args(args) -> PlannerOptions:
    return PlannerOptions(time_limit=_time_limit(args), static_degree=args.static_degree,
                          drop_over_max=getattr(args, "drop_over_max", False), max_seq_len=args.max_seq_len)


def add_batch_source_args(p, default_dist: str) -> None:
    """Where a command's lengths come from: ``--lengths FILE``, ``--dist NAME`` or ``--data PREFIX``
    (with ``--batch N --seed S``)."""
    src = p.add_mutually_exclusive_group()
    src.add_argument("--lengths", type=path_arg, metavar="FILE", help="text file, one sequence length per line (one batch)")
    src.add_argument("--dist", default=default_dist, choices=sorted(DISTRIBUTIONS),
                     help="synthetic length distribution: " + "; ".join(
                         f"{k} ({d.note})".replace("%", "%%") for k, d in sorted(DISTRIBUTIONS.items()))
                     + f" (default: {default_dist})")
    src.add_argument("--data", nargs="+", metavar="PREFIX",
                     help="Megatron indexed dataset (PREFIX.bin/.idx), or a blend as Megatron-LM's --data-path takes "
                          "it (W1 PREFIX1 W2 PREFIX2 ...): the batches a training run with this --seed, --batch and "
                          "--max-seq-len (needed) draws, longer documents cut into pieces")
    p.add_argument("--batch", type=int, default=512,
                   help="sequences per step with --dist or --data (default 512; ignored with --lengths)")
    p.add_argument("--seed", type=int, default=0,
                   help="sampling seed with --dist, shuffling seed with --data (train's --seed) (default 0; ignored with "
                        "--lengths)")


def add_pipeline_args(p) -> None:
    """``--memory-mb`` and ``--plot`` (every planner), and the pipeline planners' options."""
    g = p.add_argument_group("memory and pictures (every planner)")
    g.add_argument("--memory-mb", type=float, metavar="MB",
                   help="usable memory per GPU, for every planner and the simulator (default: the cluster's)")
    g.add_argument("--plot", metavar="FILE.png",
                   help="draw the plan: timeline (stages or GPUs x seconds) and memory per GPU over time "
                        f"({', '.join(PLOT_FORMATS)})")
    g.add_argument("--trace", metavar="FILE.json",
                   help="the simulated timeline as a Chrome trace (open it in ui.perfetto.dev): a track per GPU or "
                        "stage, a slice per SP group, chunk, recompute and p2p transfer, memory counters")
    g = p.add_argument_group(f"elastic pipelines ({', '.join(planner_names(*PIPELINE_KINDS))})")
    g.add_argument("--pp", type=positive_int,
                   help="pipeline stages (default: one per node, as many as divide the layers, replicas for the rest; on one "
                   "node, the fewest that fit)")
    g.add_argument("--sp", type=positive_int,
                   help="Ulysses degree inside a stage (default: GPUs / pp, up to the head limit); with pp x sp "
                        "below the GPU count, GPUs / (pp x sp) replicas of the pipeline run side by side, each "
                        "its share of the sequences")
    g.add_argument("--b1-scale", type=float, metavar="X",
                   help="what-if multiplier of the per-chunk fixed cost of a stage, which is derived from the "
                        "launch constant and, at ZeRO-3, the gathers of the stage's own parameters over its group "
                        "(default 1: as derived; see docs/cost_model.md)")
    g.add_argument("--recompute", choices=("ilp", "greedy", "none", "full"),
                   help="elastic_pp's activation recompute: per (stage, chunk) by the HiGHS ILP (default), by the "
                        "greedy, none (chunks small enough to fit) or every layer")
    g.add_argument("--recompute-ties", choices=("best", "tied", "untied"),
                   help="the recompute's variables (the ILP's, the greedy's): tied along the schedule's diagonals "
                        "(InfiniPipe), one per stage and chunk, or both and the faster simulated plan (default: best; "
                        "the greedy alone: tied)")


def check_args(args, planners: tuple[str, ...]) -> None:
    """Before any work: ``--data`` with the length that cuts its documents, the plot file's format,
    and no option that none of ``planners`` (the command's) uses: pipeline options without a
    pipeline planner, recompute options without elastic_pp or auto (the pipeline baselines
    recompute by their own rule), ``--max-ring`` without a planner of SP groups over all GPUs
    (FlexSP's kind or auto; a pipeline stage's group is Ulysses only). An unknown name counts as
    any planner (it is refused by name later)."""
    if getattr(args, "data", None) and not args.max_seq_len:
        raise ConfigError("--data needs --max-seq-len: the length a training run cuts its documents at "
                          "(train's --max-seq-len, Megatron-LM's --seq-length), so the batches are the run's")
    plot = getattr(args, "plot", None)
    if plot is not None and not plot.lower().endswith(PLOT_FORMATS):
        raise ConfigError(f"--plot {plot!r}: the file name must end in {', '.join(PLOT_FORMATS)}")
    trace = getattr(args, "trace", None)
    if trace is not None and not trace.lower().endswith(".json"):
        raise ConfigError(f"--trace {trace!r}: the file name must end in .json (Chrome trace-event JSON)")
    for option, path in (("--plot", plot), ("--trace", trace)):
        if path is not None:
            check_output_file(path, option)
    elastic = planner_names(*PIPELINE_KINDS)
    for options, what, users in ((PIPELINE_ONLY, "pipeline planners", elastic),
                                 (ELASTIC_ONLY, "elastic pipelines", [p for p in elastic if p not in PP_BASELINES])):
        given = [flag for name, flag in options.items() if getattr(args, name, None) is not None]
        if given and not any(p in users or p not in PLANNERS for p in planners):
            raise ConfigError(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} only to {what} "
                              f"({', '.join(users)}), not to {', '.join(planners)}")
    if getattr(args, "recompute_ties", None) is not None and getattr(args, "recompute", None) in ("none", "full"):
        raise ConfigError(f"--recompute-ties applies to what the ILP or the greedy recomputes, not to --recompute "
                          f"{args.recompute}")
    if getattr(args, "max_ring", 1) > 1 and all(p in PLANNERS and PLANNERS[p].kind == "pp" for p in planners):
        raise ConfigError(f"--max-ring applies only to planners of SP groups over all GPUs "
                          f"({', '.join(planner_names('sp', 'auto'))}), not to {', '.join(planners)}: "
                          f"a pipeline stage's SP group is Ulysses only")


def check_output_file(path: str, option: str) -> None:
    """Refuse an output file that cannot be written (a folder, or in a folder that is missing or
    takes no new file), before the work whose result it would hold: found after, the work is lost."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{option} {path}: is a folder, not a file")
    _check_writable(p.parent, option, path)


def check_output_dir(path: str, option: str) -> None:
    """Refuse an output folder that cannot be written (a file, or missing where its nearest existing
    parent takes no new folder), before the work that would fill it."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ConfigError(f"{option} {path}: is a file, not a folder")
    nearest = next(a for a in (p, *p.parents) if a.exists())
    if not nearest.is_dir():
        raise ConfigError(f"{option} {path}: {nearest} is a file, not a folder")
    _check_writable(nearest, option, path)


def _check_writable(folder: Path, option: str, path: str) -> None:
    # a file created and removed: permission bits alone do not tell (root, read-only mounts, /proc)
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise ConfigError(f"{option} {path}: cannot write in {folder}: {e.strerror or e}") from None


def pipeline_options_from_args(args):
    from megatron_ext.planner.pp.pipeline import PipelineOptions

    t = _time_limit(args)
    return PipelineOptions(pp=args.pp, sp=args.sp, b1_scale=1.0 if args.b1_scale is None else args.b1_scale,
                           recompute=args.recompute or "ilp", ties=args.recompute_ties or "best", time_limit=t,
                           pack_tokens=getattr(args, "max_seq_len", None))
