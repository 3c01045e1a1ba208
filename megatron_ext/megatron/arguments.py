"""megatron_ext's arguments for Megatron-LM's parser, and the check that explains conflicts.

``extra_args_provider(parser)`` adds the group below to Megatron's parser (it is what the patched
``pretrain_gpt.py`` hands ``pretrain``); the parser it returns checks the parsed arguments at once
with ``validate_args``, before Megatron initializes anything, so a conflict is one line
``megatron-ext: error: ...`` on rank 0 (exit status 2) instead of an assertion deep in the run.
``python -m megatron_ext.megatron.launch --check-args N SCRIPT ARGS`` runs the same check before
any rank starts (``launch.py``).

Flags (all off by default; without ``--flexsp`` / ``--elastic-pp`` Megatron runs unchanged):

--flexsp                   Plan every step with FlexSP: each micro-batch packs sequences into
                           Ulysses sequence-parallel groups of per-group degree (1 .. data-parallel
                           size), chosen by the HiGHS planner from the batch's lengths.
--elastic-pp               Elastic pipeline parallelism with --pipeline-model-parallel-size P >= 2:
                           each step's sequences are cut into token-level slices and packed into
                           chunks, ordered per stage by the elastic_pp planner; each stage's
                           data-parallel ranks run every chunk as one Ulysses group.
--elastic-pp-sp D|auto     The Ulysses degree of an elastic pipeline's stages (default: the
                           data-parallel size). Below it, each stage's data-parallel ranks split
                           into data-parallel size / D groups of D: that many pipeline replicas
                           run side by side, each its share of the step's sequences. auto: the
                           degree the auto planner finds fastest, per step.
--flexsp-max-sp-size D     Largest Ulysses degree a group may have (a power of two; default: the
                           data-parallel size, capped by what the heads divide by).
--planner-time-limit SEC   Solver time limit per step (default 1.0). A step never waits longer:
                           a late plan is replaced by a quick heuristic one.
--cost-model PATH|PRESET   The cost model the planner uses: a cost-model YAML, or
                           MODEL:CLUSTER[:ZERO] presets (e.g. gpt-7b:a100-40g-8x8). Its ZeRO
                           stage (model states per GPU) is Megatron's: 1 with
                           --use-distributed-optimizer, else 0; a YAML without zero_stage and
                           MODEL:CLUSTER take it, a stage stated otherwise is an error. Its GPU
                           count must be the data-parallel size with --flexsp, the world size
                           with --elastic-pp. Required.
--adaptive-recompute       Stage-aware per-chunk activation recomputation (planned with HiGHS);
                           belongs to elastic pipelines: needs --elastic-pp or --flexsp-planner
                           auto. Without it an elastic step recomputes nothing when it fits,
                           every layer when not.
--plan-ahead N             Plan N steps ahead in a background process on rank 0 (default 1);
                           0 plans each step inline, right before it runs.
--planner-log PATH         Rank 0 appends one JSON record per step: the plan, where it came from,
                           its predicted and the measured forward-backward time.
--planner-trace FILE.json  Rank 0 writes every training step planned (the simulator's timeline)
                           and measured, side by side, as a Chrome trace (Perfetto).
--flexsp-planner NAME      The planner (default flexsp); auto plans each step both as FlexSP and
                           as one-stage elastic pipeline replicas of each SP degree and runs the
                           faster; the baselines static_ulysses, batchada and
                           megatron_balanced_cp run through the same runtime for comparisons.
--flexsp-static-degree D   The fixed degree of --flexsp-planner static_ulysses (1: plain data
                           parallelism, every sequence on one rank).
--flexsp-attention-backend auto|sdpa|flash|te
                           Core attention backend of the Ulysses attention (default auto).

Conflicts (each explained when hit): --context-parallel-size > 1, --sequence-parallel with
--tensor-model-parallel-size > 1, --micro-batch-size other than 1, --pipeline-model-parallel-size
> 1 with --flexsp; with --elastic-pp: a pipeline size below 2 or not dividing the layers, tensor
parallelism, virtual or uneven pipeline stages, an SP degree (--elastic-pp-sp, else the
data-parallel size) that is not a Ulysses degree of the heads or does not divide the data-parallel
size, fewer --global-batch-size sequences than pipeline replicas, --recompute-granularity full, the
--flexsp-* planner options; --elastic-pp-sp without --elastic-pp; with --flexsp-planner auto:
tensor parallelism, fewer --global-batch-size sequences than data-parallel ranks,
--recompute-granularity full; and for both:
--rampup-batch-size, --dataloader-type other than external, no data or two sources of it
(--data-path, --data-args-path, per-split paths, --mock-data), per-split paths without a train
split or with --split, legacy models, multi-latent attention, MoE, sliding-window attention,
--fp8-format / --fp4-format, position embeddings other than rope / learned_absolute / none, FSDP (Megatron-FSDP, torch FSDP2:
their per-pass collectives over the data-parallel group need every rank in step, which pipeline
replicas are not, and the runtime is untested under them), --num-distributed-optimizer-instances
above 1, --iterations-to-skip, --full-validation, --multiple-validation-sets, a --cost-model
whose ZeRO stage is not the one Megatron's arguments give, a --global-batch-size that is not a
multiple of the data-parallel size (Megatron's micro-batch calculator divides it), --save of
torch_dist checkpoints without psutil (megatron-core's writer would wait forever). Adjusted with a
note:
--calculate-per-token-loss is turned on, --dataloader-type becomes external, an unset
--micro-batch-size becomes 1, --moe-token-dispatcher-type becomes alltoall (megatron-core's
TransformerConfig requires it with variable sequence lengths, even without MoE layers).

Pure Python: importing this module needs neither torch nor Megatron-LM.
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
from dataclasses import dataclass, field

from megatron_ext.errors import ConfigError, MegatronExtError
from megatron_ext.lifetime import say_rank_error
from megatron_ext.runtime.backends import ATTENTION_BACKENDS
from megatron_ext.spec import is_power_of_two

POSITION_EMBEDDINGS = ("rope", "learned_absolute", "none")


class ArgumentConflict(ConfigError):
    """Flags that cannot be used together; the message says why and what to do instead."""


class NotYetSupported(MegatronExtError):
    """A valid flag value that megatron_ext does not support yet."""


def _sp_degree(text: str):
    """--elastic-pp-sp: a degree, or "auto" (chosen per step)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an SP degree or auto, got {text!r}") from None


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add megatron_ext's group to a Megatron-LM (or any) argparse parser; returns the parser."""
    from megatron_ext.planner.api import planner_names  # numpy + highspy, no torch

    g = parser.add_argument_group(
        "megatron_ext", "FlexSP adaptive sequence parallelism and elastic pipelines (docs/megatron.md)")
    g.add_argument("--flexsp", action="store_true",
                   help="plan each step's Ulysses SP groups (per-group degree) from the batch's sequence lengths")
    g.add_argument("--elastic-pp", action="store_true",
                   help="elastic pipelines: token-level slices and packed chunks over the pipeline stages, "
                        "planned per step, with Ulysses SP over each stage's data-parallel ranks")
    g.add_argument("--elastic-pp-sp", type=_sp_degree, default=None, metavar="D|auto",
                   help="Ulysses degree of each elastic pipeline stage (default: the data-parallel size); below it "
                        "the stage's data-parallel ranks run data-parallel size / D pipeline replicas side by side; "
                        "auto: per step, the degree (and replicas) the simulator finds fastest")
    g.add_argument("--flexsp-max-sp-size", type=int, default=None, metavar="D",
                   help="largest Ulysses degree of a group (power of two; default: the data-parallel size)")
    g.add_argument("--flexsp-max-ring", type=int, default=None, metavar="R",
                   help="groups may reach past the Ulysses limit (the heads, --flexsp-max-sp-size) with a ring of up "
                        "to R Ulysses subgroups, K/V passed around it (power of two; default 1: Ulysses only)")
    g.add_argument("--planner-time-limit", type=float, default=1.0, metavar="SEC",
                   help="solver time limit per step; a late plan is replaced by a heuristic one (default 1.0)")
    g.add_argument("--cost-model", default=None, metavar="PATH|PRESET",
                   help="cost-model YAML, or MODEL:CLUSTER[:ZERO] presets (e.g. gpt-7b:a100-40g-8x8); its ZeRO stage "
                        "is Megatron's (1 with --use-distributed-optimizer, else 0): a stage it states must agree")
    g.add_argument("--adaptive-recompute", action="store_true",
                   help="per-chunk activation recomputation planned per step (needs --elastic-pp or "
                        "--flexsp-planner auto)")
    g.add_argument("--plan-ahead", type=int, default=1, metavar="N",
                   help="steps planned ahead in a background process (default 1; 0: plan inline)")
    g.add_argument("--planner-log", default=None, metavar="PATH",
                   help="append one JSON record per step (plan, predicted and measured time) on rank 0")
    g.add_argument("--planner-trace", default=None, metavar="FILE.json",
                   help="every training step planned and measured, side by side, as a Chrome trace written by rank 0 "
                        "(open it in ui.perfetto.dev; for short runs: it holds every step)")
    g.add_argument("--flexsp-planner", default="flexsp", metavar="NAME",
                   help="planner: flexsp (default); auto (per step, FlexSP or one-stage pipeline replicas, whichever "
                        f"is faster); or a baseline: {', '.join(n for n in planner_names('sp') if n != 'flexsp')}")
    g.add_argument("--flexsp-static-degree", type=int, default=None, metavar="D",
                   help="degree of --flexsp-planner static_ulysses (1: plain data parallelism)")
    g.add_argument("--flexsp-attention-backend", default="auto", choices=ATTENTION_BACKENDS,
                   help="core attention backend of the Ulysses attention (default auto)")
    return parser


@dataclass
class Validated:
    """What ``validate_args`` concluded: the data-parallel size, the notes of what it adjusted."""

    enabled: bool
    data_parallel_size: int = 1
    notes: list[str] = field(default_factory=list)


def _get(args, name, default=None):
    return getattr(args, name, default)


def mode_flag(args) -> str | None:
    """The flag of the run's planned runtime, "--flexsp" or "--elastic-pp"; None: Megatron's own."""
    if _get(args, "flexsp", False):
        return "--flexsp"
    if _get(args, "elastic_pp", False):
        return "--elastic-pp"
    return None


def _conflict(msg: str) -> None:
    raise ArgumentConflict(msg)


def _parallel_sizes(args, world_size: int) -> tuple[int, int, int, int]:
    tp = int(_get(args, "tensor_model_parallel_size", 1) or 1)
    pp = int(_get(args, "pipeline_model_parallel_size", 1) or 1)
    cp = int(_get(args, "context_parallel_size", 1) or 1)
    if world_size % (tp * pp * cp):
        _conflict(f"the world size {world_size} does not divide by tensor x pipeline x context parallel "
                  f"sizes {tp} x {pp} x {cp}")
    return tp, pp, cp, world_size // (tp * pp * cp)


def _check_no_fsdp(args, flag: str, dp: int) -> None:
    """Megatron-FSDP and torch FSDP2 (megatron-core 0.16.1) run collectives over the whole
    data-parallel group inside every forward and backward, so every rank must make the same
    passes: pipeline replicas do not (each runs its own number of chunks), FlexSP steps and a
    single elastic pipeline do, untested."""
    given = [opt for name, opt in (("use_megatron_fsdp", "--use-megatron-fsdp"),
                                   ("use_torch_fsdp2", "--use-torch-fsdp2")) if _get(args, name, False)]
    if not given:
        return
    opt = given[0]
    instead = "Use --use-distributed-optimizer (ZeRO-1, the cost model's stage 1)."
    if opt == "--use-torch-fsdp2" and flag == "--elastic-pp":
        _conflict(f"--elastic-pp runs pipeline stages, and Megatron refuses --use-torch-fsdp2 with pipeline "
                  f"parallelism. {instead}")
    passes = {"--use-megatron-fsdp": "Megatron-FSDP reduce-scatters gradients in every backward (sharding strategies "
                                     "optim_grads and optim_grads_params) and gathers each layer's parameters in every "
                                     "forward and backward (optim_grads_params)",
              "--use-torch-fsdp2": "torch FSDP2 gathers each layer's parameters in every forward and backward and "
                                   "reduce-scatters its gradients in every backward"}[opt]
    sp = _get(args, "elastic_pp_sp", None)
    if flag == "--flexsp" and _get(args, "flexsp_planner", "flexsp") == "auto":
        replicas = "--flexsp-planner auto"
    elif flag == "--elastic-pp" and sp is not None and (sp == "auto" or sp < dp):
        replicas = f"--elastic-pp-sp {sp}"
    else:
        replicas = None
    held = (f"{flag} does not support {opt}: in megatron-core 0.16.1 {passes}, collectives of the whole "
            f"data-parallel group that every rank must join in step")
    if replicas:
        _conflict(f"{held}; the pipeline replicas of {replicas} run different numbers of chunks a step, so their "
                  f"ranks would wait in different collectives and hang. {instead}")
    each = ("micro-batch of a step (an idle one-token pass where it has no sequence)" if flag == "--flexsp"
            else "chunk of its stage")
    raise NotYetSupported(f"{held}. Every rank does run each {each}, but the runtime is untested under FSDP (which "
                          f"needs CUDA). {instead}")


def _check_common(args, flag: str, tp: int, cp: int, dp: int) -> None:
    """Conflicts shared by --flexsp and --elastic-pp: in how the run is parallel and batched, in the
    Megatron features planned steps cannot follow, and in its data."""
    _check_parallel(args, flag, tp, cp, dp)
    _check_features(args, flag)
    _check_data(args, flag)


def _check_parallel(args, flag: str, tp: int, cp: int, dp: int) -> None:
    """The parallel layout and batching a planned run needs."""
    if cp > 1:
        _conflict(f"{flag} replaces context parallelism: its Ulysses groups already split each sequence, over "
                  f"1 to N ranks chosen per sequence. Use --context-parallel-size 1 (got {cp}) and bound the "
                  f"degree with --flexsp-max-sp-size instead.")
    if _get(args, "hybrid_context_parallel", False):
        _conflict(f"{flag} and --hybrid-context-parallel both decide how sequences are split; use one of them")
    if _get(args, "sequence_parallel", False) and tp > 1:
        _conflict(f"{flag} does not support Megatron's --sequence-parallel with --tensor-model-parallel-size "
                  f"{tp}: it would split each packed micro-batch's tokens over the TP ranks as well, which the "
                  f"planned shards are not padded for. Drop --sequence-parallel (the Ulysses groups already "
                  f"split the sequence) or use --tensor-model-parallel-size 1.")
    mbs = _get(args, "micro_batch_size", None)
    if mbs is not None and mbs != 1:
        _conflict(f"{flag} needs --micro-batch-size 1 (got {mbs}): the planner packs each SP group's sequences "
                  f"into one micro-batch of varying token count and chooses the number of micro-batches per "
                  f"step; --global-batch-size (sequences per step) is what it plans.")
    if _get(args, "rampup_batch_size", None):
        _conflict(f"{flag} plans a fixed number of sequences per step (--global-batch-size); drop "
                  f"--rampup-batch-size")
    _check_no_fsdp(args, flag, dp)
    instances = _get(args, "num_distributed_optimizer_instances", 1) or 1
    if _get(args, "use_distributed_optimizer", False) and instances > 1:
        _conflict(f"{flag}: --num-distributed-optimizer-instances {instances} shards the optimizer states over "
                  f"{instances} times fewer ranks than the cost model's ZeRO-1 (the whole data-parallel group), "
                  f"whose memory budget would then count on memory the run does not have; use 1")


def _check_features(args, flag: str) -> None:
    """Megatron features whose shapes, data order or attention planned steps do not follow."""
    if _get(args, "use_legacy_models", False):
        _conflict(f"{flag} needs megatron-core models; drop --use-legacy-models")
    if _get(args, "multi_latent_attention", False):
        _conflict(f"{flag}: the Ulysses attention supports standard self-attention (with GQA), not "
                  f"--multi-latent-attention")
    if _get(args, "num_experts", None):
        _conflict(f"{flag} does not support MoE models (--num-experts) yet")
    if _get(args, "iterations_to_skip", None):
        _conflict(f"{flag}: --iterations-to-skip reads Megatron batches to skip them; not supported")
    if _get(args, "phase_transition_iterations", None):
        # (Megatron restarts each phase's data at its own first sample; a planned run's step k draws batch k)
        _conflict(f"{flag}: --phase-transition-iterations restarts the data at every phase, which planned steps "
                  f"do not follow (step k draws global batch k of the run's data); run the phases as separate "
                  f"runs, each with its data")
    loaded = [f for f, on in (("--use-checkpoint-args", _get(args, "use_checkpoint_args", False)),
                              ("--yaml-cfg", _get(args, "yaml_cfg", None))) if on]
    if loaded:
        # (arguments read later than these checks, which they would not pass through: MoE, another
        # position embedding, other parallel sizes)
        _conflict(f"{flag}: {' and '.join(loaded)} sets arguments after megatron_ext has checked them; give them "
                  f"on the command line")
    if _get(args, "ddp_average_in_collective", False):
        _conflict(f"{flag} needs --calculate-per-token-loss (the loss is normalized over the global batch's "
                  f"tokens, whatever the plan), which Megatron runs without --ddp-average-in-collective; drop it")
    if _get(args, "check_for_spiky_loss", False):
        # (Megatron compares each micro-batch's summed loss with the last ones; a planned micro-batch
        # or chunk holds anything from one token to a whole long document)
        _conflict(f"{flag}: --check-for-spiky-loss compares micro-batch loss sums, which vary with the planned "
                  f"token counts (one token to a whole document) and would flag spikes that are not; drop it")
    for name in ("full_validation", "multiple_validation_sets"):
        if _get(args, name, False):
            _conflict(f"{flag}: --{name.replace('_', '-')} needs Megatron's GPT datasets; a planned run validates "
                      f"--eval-iters planned steps of the validation split, going on where the last evaluation "
                      f"stopped; drop it")
    graphs = [f for f, on in (("--cuda-graph-impl", _get(args, "cuda_graph_impl", "none") not in (None, "none")),
                              ("--enable-cuda-graph", _get(args, "enable_cuda_graph", False)),
                              ("--external-cuda-graph", _get(args, "external_cuda_graph", False))) if on]
    if graphs:
        _conflict(f"{flag}: CUDA graphs replay fixed shapes and launches, and planned steps change both every step "
                  f"(sequence lengths, SP groups, micro-batches); drop {' and '.join(graphs)}")
    if _get(args, "inprocess_restart", False):
        _conflict(f"{flag}: --inprocess-restart rebuilds the process groups inside the running processes, and the "
                  f"planned SP groups built at the first step would not follow; restart the job instead (Slurm "
                  f"--requeue, as scripts/slurm does)")
    if _get(args, "window_size", None) is not None:
        _conflict(f"{flag}: the Ulysses attention does not support sliding-window attention (--window-size)")
    softmax = _get(args, "softmax_type", "vanilla")
    if softmax not in (None, "vanilla"):
        _conflict(f"{flag}: the Ulysses attention runs the standard softmax, not --softmax-type {softmax}")
    clipped = [f for f, on in (("--qk-clip", _get(args, "qk_clip", False)),
                               ("--log-max-attention-logit", _get(args, "log_max_attention_logit", False))) if on]
    if clipped:
        _conflict(f"{flag}: the Ulysses attention does not track attention logits; drop {' and '.join(clipped)}")
    low = [f"{f} {v}" for f, v in (("--fp8-format", _get(args, "fp8", None)), ("--fp4-format", _get(args, "fp4", None)))
           if v]
    if low:
        # (Transformer Engine's FP8/FP4 GEMMs need the token count of every matrix a multiple of 8-32;
        # a planned shard holds ceil(T / d) tokens, and an idle pass one)
        _conflict(f"{flag}: FP8 and FP4 matrix multiplies need token counts in multiples of 8 to 32, and planned "
                  f"shards hold any number of tokens; drop {' and '.join(low)}")
    if _get(args, "mtp_num_layers", None):
        # (Megatron's MTP shifts labels by the packed sequences' bounds over the whole buffer, not a
        # rank's shard of it, and counts padding: its loss would depend on the plan)
        _conflict(f"{flag} does not support multi-token prediction (--mtp-num-layers)")
    pos = _get(args, "position_embedding_type", "learned_absolute")
    if pos not in POSITION_EMBEDDINGS:
        _conflict(f"{flag} supports --position-embedding-type {', '.join(POSITION_EMBEDDINGS)}, not {pos!r}")
    if _get(args, "sft", False) or _get(args, "fim_data", False):
        _conflict(f"{flag} reads whole documents as sequences; --sft and --fim-data are not supported")
    dl = _get(args, "dataloader_type", None)
    if dl not in (None, "external"):
        _conflict(f"{flag} feeds Megatron planned steps through an external data iterator; drop "
                  f"--dataloader-type {dl} (it becomes external)")


def _check_data(args, flag: str) -> None:
    """One data source, well formed: Megatron indexed datasets (a prefix, a blend, per-split paths) or mock data."""
    from megatron_ext.data.datasets import DataError, parse_blend
    from megatron_ext.megatron.data import SPLITS, data_blends

    given = [f"--{n.replace('_', '-')}" for n in ("data_path", "data_args_path", "train_data_path", "valid_data_path",
                                                  "test_data_path", "per_split_data_args_path") if _get(args, n)]
    if _get(args, "mock_data", False) and given:
        _conflict(f"{flag}: give {given[0]} or --mock-data, not both")
    if _get(args, "mock_data", False):
        return
    try:
        whole, per_split = data_blends(args)
    except DataError as e:
        _conflict(f"{flag}: {e}")
    if whole is None and per_split is None:
        _conflict(f"{flag} needs data: --data-path PREFIX (a Megatron indexed dataset, PREFIX.bin and "
                  f"PREFIX.idx, or a blend W1 PREFIX1 W2 PREFIX2 ...), --train-data-path ... or --mock-data")
    if whole is not None and len(given) > 1:
        _conflict(f"{flag}: give one data source, not {' and '.join(given)}")
    if per_split is not None:
        if per_split[0] is None:
            _conflict(f"{flag}: the per-split data paths need a train split (--train-data-path)")
        if _get(args, "split", None) is not None:
            _conflict(f"{flag}: --split divides --data-path; with per-split data paths drop it (as Megatron "
                      f"refuses split with blend_per_split)")
    for name, values in [("--data-path", whole)] + [(f"--{k}-data-path", v) for k, v in zip(SPLITS, per_split or [])]:
        if values is not None:
            try:
                parse_blend(values)
            except DataError as e:
                _conflict(f"{flag}: {name} {' '.join(map(str, values))}: {e}")


def validate_args(args, world_size: int | None = None) -> Validated:
    """Check megatron_ext's flags against Megatron's (the raw parsed namespace: before Megatron's
    own validate_args). Adjusts what it must (listed in ``notes``) and raises ArgumentConflict,
    NotYetSupported or ConfigError with an explanation. ``world_size`` defaults to $WORLD_SIZE."""
    flexsp, elastic = bool(_get(args, "flexsp", False)), bool(_get(args, "elastic_pp", False))
    if _get(args, "elastic_pp_sp", None) is not None and not elastic:
        _conflict("--elastic-pp-sp sets the Ulysses degree of --elastic-pp's pipeline stages; it has no effect "
                  "without --elastic-pp" + (" (--flexsp chooses each group's degree: bound it with "
                                            "--flexsp-max-sp-size)" if flexsp else ""))
    if not (flexsp or elastic):
        for name, flag in (("adaptive_recompute", "--adaptive-recompute"), ("planner_log", "--planner-log"),
                           ("planner_trace", "--planner-trace"),
                           ("cost_model", "--cost-model"), ("flexsp_max_sp_size", "--flexsp-max-sp-size"),
                           ("flexsp_max_ring", "--flexsp-max-ring")):
            if _get(args, name):
                _conflict(f"{flag} has no effect without --flexsp or --elastic-pp")
        return Validated(False)
    if flexsp and elastic:
        _conflict("--flexsp and --elastic-pp are two runtimes; choose one (--elastic-pp runs Ulysses SP "
                  "inside each of its stages)")
    flag = mode_flag(args)
    world = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else int(world_size)
    tp, pp, cp, dp = _parallel_sizes(args, world)
    _check_common(args, flag, tp, cp, dp)
    _check_planning(args)
    from megatron_ext.megatron.cost import head_degree_limit

    heads = _get(args, "num_attention_heads", None)
    kv = _get(args, "num_query_groups", None) if _get(args, "group_query_attention", False) else None
    head_limit = head_degree_limit(heads, kv, tp) if heads else dp
    if elastic:
        cost = _check_elastic(args, world, tp, pp, dp, head_limit)
        if _get(args, "elastic_pp_sp", None) is None:  # one pipeline: each stage's data-parallel ranks one SP group
            args.elastic_pp_sp = dp
    else:
        cost = _check_flexsp(args, world, tp, pp, cp, dp, head_limit)
    batch = _get(args, "global_batch_size", None)
    if batch is not None and batch % dp:
        near = [n for n in (batch // dp * dp, (batch // dp + 1) * dp) if n > 0]
        _conflict(f"--global-batch-size {batch} is not a multiple of the data-parallel size {dp} (world {world} / "
                  f"(TP {tp} x PP {pp} x CP {cp})) x --micro-batch-size 1, which Megatron's micro-batch calculator "
                  f"requires (the planner itself takes any number of sequences a step); use "
                  f"{' or '.join(map(str, near))}")
    _check_checkpoint_writer(args)

    notes: list[str] = []
    if heads and cost.model.num_attention_heads != heads:
        notes.append(f"the cost model's {cost.model.name} has {cost.model.num_attention_heads} heads, the model "
                     f"{heads}: Ulysses degrees are capped at {cost.ulysses_degree(cost.num_gpus)} by the model's "
                     f"heads")
    for mine, theirs, what in ((_get(args, "num_layers"), cost.model.num_layers, "layers"),
                               (_get(args, "hidden_size"), cost.model.hidden_size, "hidden size")):
        if mine and mine != theirs:
            notes.append(f"the cost model's {cost.model.name} has {what} {theirs}, the model {mine}: predicted "
                         f"times will be off (`megatron-ext profile` measures this model)")

    # ---- adjustments ----
    if _get(args, "micro_batch_size", None) is None:
        args.micro_batch_size = 1
        notes.append("--micro-batch-size 1")
    if not _get(args, "calculate_per_token_loss", False):
        args.calculate_per_token_loss = True
        notes.append("--calculate-per-token-loss (the loss is normalized over the global batch's tokens)")
    if _get(args, "dataloader_type", None) is None:
        args.dataloader_type = "external"
        notes.append("--dataloader-type external (planned steps come from megatron_ext's data loader)")
    if _get(args, "moe_token_dispatcher_type", "alltoall") != "alltoall":
        # TransformerConfig refuses variable_seq_lengths (which the patched arguments.py turns on for
        # --flexsp and --elastic-pp) with any other dispatcher, even in a dense model (MoE is refused above).
        args.moe_token_dispatcher_type = "alltoall"
        notes.append("--moe-token-dispatcher-type alltoall (required with variable sequence lengths; no MoE layer)")
    for flag, path in (("--planner-log", _get(args, "planner_log", None)),
                       ("--planner-trace", _get(args, "planner_trace", None))):
        parent = os.path.dirname(os.path.abspath(path)) if path else None
        if path and not os.path.isdir(parent):
            _conflict(f"{flag} {path}: directory {parent} does not exist")
    trace = _get(args, "planner_trace", None)
    if trace and not trace.lower().endswith(".json"):
        _conflict(f"--planner-trace {trace}: the file name must end in .json (Chrome trace-event JSON)")
    return Validated(True, dp, notes)


def _check_planning(args) -> None:
    """The planner's time limit and look-ahead (both runtimes)."""
    limit = _get(args, "planner_time_limit", 1.0)
    if limit is None or not 0 < limit < math.inf:  # (nan fails both)
        _conflict(f"--planner-time-limit must be a positive number of seconds, got {limit}")
    ahead = _get(args, "plan_ahead", 1)
    if ahead is None or ahead < 0:
        _conflict(f"--plan-ahead must be 0 or more, got {ahead}")
    from megatron_ext.data.loader import PLANNER_STARTUP_S

    # the other ranks wait for rank 0's plan in a collective, which NCCL's watchdog ends
    timeout_s = 60 * (_get(args, "distributed_timeout_minutes", 10) or 10)
    if PLANNER_STARTUP_S + limit + 1 >= timeout_s / 2:
        _conflict(f"--planner-time-limit {limit:g} s: the other ranks wait for each plan (up to the limit + 1 s, "
                  f"and {PLANNER_STARTUP_S:.0f} s more for the planner to start) in a collective that NCCL ends "
                  f"after --distributed-timeout-minutes ({timeout_s / 60:g} min); keep the wait under half of it "
                  f"(lower the limit or raise the timeout)")
    if ahead > 1:
        raise NotYetSupported(f"--plan-ahead {ahead}: the planning data loader plans one step ahead; use "
                              f"--plan-ahead 1 (background, the default) or 0 (inline)")


def _check_checkpoint_writer(args) -> None:
    """megatron-core's torch_dist checkpoint writer calls psutil in each writer process before its
    error handling: without psutil every --save waits forever for writers that died."""
    if (_get(args, "save", None) and _get(args, "ckpt_format", "torch_dist") == "torch_dist"
            and importlib.util.find_spec("psutil") is None):
        raise ConfigError("--save writes torch_dist checkpoints (Megatron's default --ckpt-format), whose writer "
                          "needs psutil and without it waits forever: pip install psutil (a requirement "
                          "of megatron_ext that a --no-deps install skips), or save with --ckpt-format torch")


def _cost_model(args, flag: str):
    from megatron_ext.megatron.cost import megatron_cost_model

    ref = _get(args, "cost_model", None)
    if not ref:
        _conflict(f"{flag} needs --cost-model PATH|MODEL:CLUSTER[:ZERO]: the planner's time and memory model "
                  f"(e.g. gpt-7b:a100-40g-8x8, or a YAML from `megatron-ext profile`)")
    return ref, megatron_cost_model(args)


def _check_flexsp(args, world: int, tp: int, pp: int, cp: int, dp: int, head_limit: int):
    """--flexsp's own conflicts; returns the cost model, its degrees capped."""
    if pp > 1:
        _conflict(f"--flexsp runs each micro-batch's SP groups on one pipeline stage; use "
                  f"--pipeline-model-parallel-size 1 (got {pp}), or --elastic-pp for pipelines")
    from megatron_ext.planner.api import planner_names  # numpy + highspy, no torch

    planner = _get(args, "flexsp_planner", "flexsp")
    names = planner_names("sp", "auto")
    if planner not in names:
        _conflict(f"--flexsp-planner {planner!r} is not a planner; choose one of {', '.join(names)}")
    if _get(args, "adaptive_recompute", False) and planner != "auto":
        _conflict("--adaptive-recompute plans recomputation per pipeline chunk and stage: it needs --elastic-pp "
                  "(or --flexsp-planner auto, for its pipeline steps). With --flexsp use Megatron's "
                  "--recompute-granularity / --recompute-method.")
    if planner == "auto":
        _check_auto(args, tp, dp)
    if not is_power_of_two(dp):
        _conflict(f"--flexsp needs a power-of-two data-parallel size (its SP groups are aligned power-of-two "
                  f"blocks of ranks); world {world} / (TP {tp} x PP {pp} x CP {cp}) = {dp}")

    static = _get(args, "flexsp_static_degree", None)
    if static is not None and planner != "static_ulysses":
        _conflict("--flexsp-static-degree sets the degree of --flexsp-planner static_ulysses only")

    # The degree cap: what the user allows, what the heads allow, what the domain allows.
    from megatron_ext.megatron.cost import cap_cost_model

    heads = _get(args, "num_attention_heads", None)
    kv = _get(args, "num_query_groups", None) if _get(args, "group_query_attention", False) else None
    cap = _get(args, "flexsp_max_sp_size", None)
    if cap is not None:
        if not is_power_of_two(cap) or cap > dp:
            _conflict(f"--flexsp-max-sp-size must be a power of two of at most the data-parallel size {dp}, "
                      f"got {cap}")
        if cap > head_limit:
            _conflict(f"--flexsp-max-sp-size {cap}: Ulysses splits the attention heads over the group, and "
                      f"{heads} heads / {kv or heads} KV heads per TP rank (TP {tp}) only divide by up to "
                      f"{head_limit}")
    ring = _get(args, "flexsp_max_ring", None) or 1
    if not is_power_of_two(ring):
        _conflict(f"--flexsp-max-ring must be a power of two (1: no ring), got {ring}")
    if static is not None and (not is_power_of_two(static) or static > min(cap or dp, head_limit, dp)):
        _conflict(f"--flexsp-static-degree must be a power of two of at most {min(cap or dp, head_limit, dp)}, "
                  f"got {static}")

    ref, cost = _cost_model(args, "--flexsp")
    if cost.num_gpus != dp:
        _conflict(f"--cost-model {ref} describes {cost.num_gpus} GPUs ({cost.cluster.name}), but this job's "
                  f"data-parallel size is {dp} (world {world} / TP {tp} / PP {pp} / CP {cp}): the planner "
                  f"spreads sequences over exactly the data-parallel ranks")
    cost.max_seq_len  # raises InfeasibleError when the model states alone do not fit
    return cap_cost_model(cost, min(cap or dp, head_limit))


def _check_auto(args, tp: int, dp: int) -> None:
    """--flexsp-planner auto runs each step as FlexSP or as one-stage elastic pipeline replicas
    (of any SP degree), whichever the planner finds faster: the elastic runtime's conditions hold."""
    if tp > 1:
        _conflict(f"--flexsp-planner auto runs some steps as one-stage pipeline replicas, whose Ulysses groups "
                  f"span whole ranks: use --tensor-model-parallel-size 1 (got {tp})")
    _check_replicas_have_sequences(args, dp, f"--flexsp-planner auto may run a step as {dp} one-stage pipeline "
                                            f"replicas of SP 1", "")
    _check_no_full_recompute(args, "--flexsp-planner auto decides recomputation of its pipeline steps per chunk")


def _check_replicas_have_sequences(args, replicas: int, runs: str, hint: str) -> None:
    """Every pipeline replica needs a sequence a step (its ranks run a forward and a backward)."""
    batch = _get(args, "global_batch_size", None)
    if batch is not None and batch < replicas:
        _conflict(f"{runs}, each on its share of a step's sequences: --global-batch-size {batch} leaves some with "
                  f"none; give at least {replicas} sequences a step{hint}")


def _check_no_full_recompute(args, who: str) -> None:
    if _get(args, "recompute_granularity", None) == "full":
        _conflict(f"{who} itself (none when the step fits, every layer when not; per chunk with "
                  f"--adaptive-recompute); drop --recompute-granularity full")


def _check_elastic(args, world: int, tp: int, pp: int, dp: int, head_limit: int):
    """--elastic-pp's own conflicts: P stages of the layers, each stage's data-parallel ranks
    dp / D Ulysses groups of degree D (--elastic-pp-sp, default dp), one per pipeline replica.
    Returns the cost model, its degrees capped by the heads."""
    if pp < 2:
        _conflict("--elastic-pp cuts sequences into pipeline chunks over stages; it needs "
                  "--pipeline-model-parallel-size of at least 2")
    if tp > 1:
        _conflict(f"--elastic-pp runs Ulysses SP over each stage's data-parallel ranks with "
                  f"--tensor-model-parallel-size 1 (got {tp}); give those ranks to the stages' SP groups instead")
    if _get(args, "num_layers_per_virtual_pipeline_stage", None) or _get(args, "num_virtual_stages_per_pipeline_rank",
                                                                          None):
        _conflict("--elastic-pp orders chunks over one model chunk per stage; drop the virtual pipeline "
                  "(--num-layers-per-virtual-pipeline-stage / --num-virtual-stages-per-pipeline-rank)")
    for name in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
                 "pipeline_model_parallel_layout", "account_for_embedding_in_pipeline_split",
                 "account_for_loss_in_pipeline_split"):
        if _get(args, name, None):
            _conflict(f"--elastic-pp plans stages of equal layer counts; drop --{name.replace('_', '-')}")
    if _get(args, "use_tp_pp_dp_mapping", False):
        # (the cost model's stages hold consecutive ranks, as in Megatron's default order, tp-cp-ep-dp-pp)
        _conflict("--elastic-pp places a stage on consecutive ranks (Megatron's default rank order) and prices "
                  "its handoffs and Ulysses groups so; drop --use-tp-pp-dp-mapping")
    if _get(args, "defer_embedding_wgrad_compute", False):
        # (Megatron's own schedules finish the deferred output-layer weight gradients before
        # finalizing the gradients; the elastic schedule does not defer them)
        _conflict("--elastic-pp computes the output layer's weight gradients in each chunk's backward; drop "
                  "--defer-embedding-wgrad-compute")
    layers = _get(args, "num_layers", None)
    if layers and layers % pp:
        _conflict(f"--elastic-pp: --pipeline-model-parallel-size {pp} does not divide the {layers} layers "
                  f"(every stage holds the same number of layers)")
    heads = _get(args, "num_attention_heads", None)
    sp = _get(args, "elastic_pp_sp", None)
    if sp is None:
        sp = dp
        if not is_power_of_two(dp) or dp > head_limit:
            _conflict(f"--elastic-pp makes each stage's {dp} data-parallel ranks (world {world} / PP {pp}) one "
                      f"Ulysses group, which must be a power of two dividing the {heads} attention heads and the KV "
                      f"heads (up to {head_limit} here); change --pipeline-model-parallel-size or the number of "
                      f"ranks, or split the stages into pipeline replicas of a smaller SP with --elastic-pp-sp")
    elif sp == "auto":  # per step, any degree a stage's ranks allow: down to SP 1, dp replicas
        pass
    elif sp < 1 or dp % sp:
        _conflict(f"--elastic-pp-sp {sp} must divide a stage's {dp} data-parallel ranks (world {world} / PP {pp}): "
                  f"they split into data-parallel size / D pipeline replicas of SP D")
    elif not is_power_of_two(sp) or sp > head_limit:
        _conflict(f"--elastic-pp-sp {sp} is not an allowed Ulysses degree: a power of two dividing the {heads} "
                  f"attention heads and the KV heads (up to {head_limit} here)")
    replicas = dp if sp == "auto" else dp // sp
    _check_replicas_have_sequences(
        args, replicas, f"--elastic-pp-sp {sp} {'may run' if sp == 'auto' else 'runs'} {replicas} pipeline replicas "
                        f"side by side (a stage's {dp} data-parallel ranks / SP {1 if sp == 'auto' else sp})",
        " or a larger --elastic-pp-sp")
    _check_no_full_recompute(args, "--elastic-pp decides recomputation per chunk and stage")
    for name in ("flexsp_max_sp_size", "flexsp_static_degree", "flexsp_max_ring"):
        if _get(args, name, None) is not None:
            _conflict(f"--{name.replace('_', '-')} belongs to --flexsp; --elastic-pp's SP degree is "
                      f"--elastic-pp-sp (default: the data-parallel size)")
    if _get(args, "flexsp_planner", "flexsp") != "flexsp":
        _conflict("--flexsp-planner belongs to --flexsp; --elastic-pp plans with the elastic_pp planner")

    from megatron_ext.cost.pipeline import PipelineCost
    from megatron_ext.megatron.cost import cap_cost_model

    ref, cost = _cost_model(args, "--elastic-pp")
    if cost.num_gpus != world:
        _conflict(f"--cost-model {ref} describes {cost.num_gpus} GPUs ({cost.cluster.name}), but this job has "
                  f"{world} ranks: elastic pipelines span every rank ("
                  + (f"{pp} stages x any SP, and replicas" if sp == "auto" else
                     f"{replicas} replica{'s' if replicas > 1 else ''} x {pp} stages x SP {sp}")
                  + "), so their cost model describes the whole job")
    cost = cap_cost_model(cost, head_limit)
    error = None
    for d in ([d for d in cost.degrees if dp % d == 0] if sp == "auto" else [sp]):
        try:  # the cost model's own layers and heads, and whether a stage's model states fit
            PipelineCost(cost, pp, d)
            return cost
        except MegatronExtError as e:
            error = e
    raise type(error)(f"--elastic-pp with --cost-model {ref}: {error}") from None


def env_rank() -> int:
    """This process's rank as torchrun gives it ($RANK; 0 outside torchrun)."""
    return int(os.environ.get("RANK", "0"))


def check_or_exit(args) -> Validated:
    """``validate_args``; on a conflict, rank 0 prints one line ``megatron-ext: error: ...`` and
    every rank exits 2 (``say_rank_error``)."""
    try:
        result = validate_args(args)
    except MegatronExtError as e:
        sys.exit(say_rank_error(e, env_rank()))
    if result.enabled and result.notes and env_rank() == 0:
        print(f"megatron_ext: {mode_flag(args)} set " + "; ".join(result.notes), flush=True)
    return result


def extra_args_provider(chained=None):
    """An ``extra_args_provider`` for Megatron's ``pretrain``: adds megatron_ext's group (after
    ``chained``'s, if given) and makes the parser validate what it parses (``check_or_exit``)."""

    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        if chained is not None:
            parser = chained(parser)
        add_arguments(parser)
        original = parser.parse_known_args

        def parse_known_args(args=None, namespace=None):
            ns, rest = original(args, namespace)
            check_or_exit(ns)
            return ns, rest

        parser.parse_known_args = parse_known_args  # parse_args goes through it too
        return parser

    return provider
