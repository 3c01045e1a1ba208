"""megatron_ext's Megatron-LM arguments: parsing, the conflict explanations, the adjustments, and
the argument files of configs/megatron/ (no Megatron-LM checkout needed)."""
from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

import pytest

from megatron_ext.megatron.arguments import (ArgumentConflict, NotYetSupported, add_arguments, extra_args_provider,
                                             validate_args)
from megatron_ext.errors import ConfigError, InfeasibleError
from megatron_ext.megatron.cost import (CappedCostModel, cap_cost_model, head_degree_limit, load_cost_model,
                                        megatron_cost_model, megatron_zero_stage)
from megatron_ext.spec import read_yaml

ROOT = Path(__file__).resolve().parents[2]
COST_2 = str(ROOT / "configs/megatron/cost/tiny-cpu2.yaml")
COST_4 = str(ROOT / "configs/megatron/cost/tiny-cpu4.yaml")


def megatron_like_parser(ours: bool = True) -> argparse.ArgumentParser:
    """The Megatron-LM options validate_args reads, with Megatron's names and defaults."""
    p = argparse.ArgumentParser(allow_abbrev=False)
    for name, kw in {
        "--tensor-model-parallel-size": dict(type=int, default=1),
        "--pipeline-model-parallel-size": dict(type=int, default=1),
        "--context-parallel-size": dict(type=int, default=1),
        "--hybrid-context-parallel": dict(action="store_true"),
        "--sequence-parallel": dict(action="store_true"),
        "--micro-batch-size": dict(type=int, default=None),
        "--global-batch-size": dict(type=int, default=None),
        "--rampup-batch-size": dict(nargs="*", default=None),
        "--use-legacy-models": dict(action="store_true"),
        "--multi-latent-attention": dict(action="store_true"),
        "--num-experts": dict(type=int, default=None),
        "--window-size": dict(default=None),
        "--position-embedding-type": dict(default="learned_absolute"),
        "--sft": dict(action="store_true"),
        "--fim-data": dict(action="store_true"),
        "--dataloader-type": dict(default=None),
        "--data-path": dict(nargs="*", default=None),
        "--train-data-path": dict(nargs="*", default=None),
        "--valid-data-path": dict(nargs="*", default=None),
        "--test-data-path": dict(nargs="*", default=None),
        "--data-args-path": dict(default=None),
        "--per-split-data-args-path": dict(default=None),
        "--split": dict(default=None),
        "--mock-data": dict(action="store_true"),
        "--num-layers": dict(type=int, default=None),
        "--hidden-size": dict(type=int, default=None),
        "--ffn-hidden-size": dict(type=int, default=None),
        "--num-attention-heads": dict(type=int, default=None),
        "--group-query-attention": dict(action="store_true"),
        "--num-query-groups": dict(type=int, default=1),
        "--calculate-per-token-loss": dict(action="store_true"),
        "--moe-token-dispatcher-type": dict(default="allgather"),
        "--use-megatron-fsdp": dict(action="store_true"),
        "--use-torch-fsdp2": dict(action="store_true"),
        "--use-distributed-optimizer": dict(action="store_true"),
        "--num-distributed-optimizer-instances": dict(type=int, default=1),
        "--seq-length": dict(type=int, default=None),
        "--num-layers-per-virtual-pipeline-stage": dict(type=int, default=None),
        "--decoder-first-pipeline-num-layers": dict(type=int, default=None),
        "--recompute-granularity": dict(default=None),
        "--save": dict(default=None),
        "--ckpt-format": dict(default="torch_dist"),
        "--full-validation": dict(action="store_true"),
        "--multiple-validation-sets": dict(action="store_true"),
        "--cuda-graph-impl": dict(default="none"),
        "--enable-cuda-graph": dict(action="store_true"),
        "--external-cuda-graph": dict(action="store_true"),
        "--inprocess-restart": dict(action="store_true"),
        "--softmax-type": dict(default="vanilla"),
        "--qk-clip": dict(action="store_true"),
        "--log-max-attention-logit": dict(action="store_true"),
        "--mtp-num-layers": dict(type=int, default=None),
        "--fp8-format": dict(dest="fp8", default=None),  # (megatron-core's TransformerConfig field names)
        "--fp4-format": dict(dest="fp4", default=None),
        "--distributed-timeout-minutes": dict(type=int, default=10),
        "--phase-transition-iterations": dict(default=None),
        "--use-checkpoint-args": dict(action="store_true"),
        "--yaml-cfg": dict(default=None),
        "--ddp-average-in-collective": dict(action="store_true"),
        "--check-for-spiky-loss": dict(action="store_true"),
        "--defer-embedding-wgrad-compute": dict(action="store_true"),
        "--use-tp-pp-dp-mapping": dict(action="store_true"),
        "--bf16": dict(action="store_true"),
        "--fp16": dict(action="store_true"),
        "--grad-reduce-in-bf16": dict(action="store_true"),
    }.items():
        p.add_argument(name, **kw)
    return add_arguments(p) if ours else p


TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8", "--group-query-attention",
        "--num-query-groups", "4", "--mock-data"]


def parse(*argv: str):
    return megatron_like_parser().parse_args(list(argv))


def flexsp(*extra: str, world: int = 2, cost: str = COST_2):
    args = parse(*TINY, "--flexsp", "--cost-model", cost, *extra)
    return args, validate_args(args, world_size=world)


def test_flags_parse_with_their_defaults():
    args = parse()
    assert (args.flexsp, args.elastic_pp, args.adaptive_recompute) == (False, False, False)
    assert args.planner_time_limit == 1.0 and args.plan_ahead == 1 and args.flexsp_planner == "flexsp"
    assert args.cost_model is None and args.planner_log is None and args.flexsp_max_sp_size is None
    assert args.elastic_pp_sp is None and parse("--elastic-pp", "--elastic-pp-sp", "2").elastic_pp_sp == 2
    args = parse("--flexsp", "--flexsp-max-sp-size", "4", "--planner-time-limit", "0.5", "--cost-model", "x:y",
                 "--adaptive-recompute", "--plan-ahead", "0", "--planner-log", "/tmp/p.jsonl")
    assert (args.flexsp_max_sp_size, args.planner_time_limit, args.cost_model, args.plan_ahead) == (4, 0.5, "x:y", 0)


def test_without_our_flags_nothing_changes():
    args = parse(*TINY, "--micro-batch-size", "4", "--context-parallel-size", "2")
    before = dict(vars(args))
    assert validate_args(args, world_size=8).enabled is False
    assert vars(args) == before


def test_our_options_need_a_mode():
    with pytest.raises(ArgumentConflict, match="--cost-model has no effect without --flexsp"):
        validate_args(parse("--cost-model", COST_2), world_size=2)


def test_flexsp_adjusts_what_it_must_and_says_so():
    args, v = flexsp()
    assert v.enabled and v.data_parallel_size == 2
    assert args.calculate_per_token_loss and args.dataloader_type == "external" and args.micro_batch_size == 1
    assert args.moe_token_dispatcher_type == "alltoall"
    text = " ".join(v.notes)
    for what in ("--calculate-per-token-loss", "--dataloader-type external", "--micro-batch-size 1",
                 "--moe-token-dispatcher-type alltoall"):
        assert what in text


@pytest.mark.parametrize("extra, world, match", [
    (["--context-parallel-size", "2"], 4, "replaces context parallelism.*--context-parallel-size 1"),
    (["--sequence-parallel", "--tensor-model-parallel-size", "2"], 4, "--sequence-parallel with --tensor-model"),
    (["--micro-batch-size", "2"], 2, "needs --micro-batch-size 1 \\(got 2\\)"),
    (["--pipeline-model-parallel-size", "2"], 4, "--pipeline-model-parallel-size 1 \\(got 2\\).*--elastic-pp"),
    (["--hybrid-context-parallel"], 2, "hybrid-context-parallel"),
    (["--rampup-batch-size", "16", "16", "1000"], 2, "rampup-batch-size"),
    (["--dataloader-type", "single"], 2, "--dataloader-type single"),
    (["--num-experts", "8"], 2, "MoE"),
    (["--multi-latent-attention"], 2, "multi-latent-attention"),
    (["--position-embedding-type", "mrope"], 2, "position-embedding-type"),
    (["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2"], 2,
     "--num-distributed-optimizer-instances 2 shards the optimizer states over 2 times fewer ranks"),
    (["--adaptive-recompute"], 2, "needs --elastic-pp"),
    (["--flexsp-max-sp-size", "3"], 2, "power of two"),
    (["--flexsp-max-sp-size", "4"], 2, "at most the data-parallel size 2"),
    (["--flexsp-planner", "nope"], 2, "not a planner"),
    (["--flexsp-static-degree", "2"], 2, "static_ulysses only"),
    (["--planner-time-limit", "0"], 2, "must be a positive number"),
    (["--planner-time-limit", "nan"], 2, "must be a positive number"),
    (["--data-path", "a", "b"], 2, "give --data-path or --mock-data, not both"),
    (["--flexsp-planner", "auto", "--tensor-model-parallel-size", "2"], 4, "--tensor-model-parallel-size 1 \\(got 2\\)"),
    (["--flexsp-planner", "auto", "--global-batch-size", "1"], 2, "leaves some with none; give at least 2"),
    (["--flexsp-planner", "auto", "--recompute-granularity", "full"], 2, "drop --recompute-granularity full"),
    (["--flexsp-planner", "auto", "--flexsp-static-degree", "2"], 2, "static_ulysses only"),
    (["--full-validation"], 2, "--full-validation needs Megatron's GPT datasets"),
    (["--multiple-validation-sets"], 2, "--multiple-validation-sets needs Megatron's GPT datasets"),
    # CUDA graphs replay fixed shapes (GPU-only failures); an in-process restart leaves stale SP groups
    (["--cuda-graph-impl", "local"], 2, "CUDA graphs replay fixed shapes.*drop --cuda-graph-impl$"),
    (["--enable-cuda-graph", "--external-cuda-graph"], 2, "drop --enable-cuda-graph and --external-cuda-graph$"),
    (["--inprocess-restart"], 2, "--inprocess-restart rebuilds the process groups"),
    # what the Ulysses attention does not compute (a NotImplementedError on every rank, or a wrong MTP loss)
    (["--softmax-type", "learnable"], 2, "runs the standard softmax, not --softmax-type learnable"),
    (["--qk-clip", "--log-max-attention-logit"], 2, "drop --qk-clip and --log-max-attention-logit$"),
    (["--mtp-num-layers", "1"], 2, "does not support multi-token prediction"),
    (["--fp8-format", "hybrid"], 2, "FP8 and FP4 matrix multiplies need token counts in multiples of 8 to 32.*"
                                    "drop --fp8-format hybrid$"),
    (["--fp4-format", "e2m1"], 2, "drop --fp4-format e2m1$"),
    # what a planned run would follow wrongly or not at all (data, arguments, loss checks)
    (["--phase-transition-iterations", "10"], 2, "--phase-transition-iterations restarts the data at every phase"),
    (["--use-checkpoint-args"], 2, "--use-checkpoint-args sets arguments after megatron_ext has checked them"),
    (["--ddp-average-in-collective"], 2, "which Megatron runs without --ddp-average-in-collective; drop it$"),
    (["--check-for-spiky-loss"], 2, "--check-for-spiky-loss compares micro-batch loss sums"),
    # other ranks wait in an NCCL collective for each plan (the watchdog: --distributed-timeout-minutes)
    (["--planner-time-limit", "300"], 2, r"--planner-time-limit 300 s: .* \(10 min\); keep the wait under half"),
    (["--planner-time-limit", "30", "--distributed-timeout-minutes", "2"], 2, r"\(2 min\)"),
    (["--global-batch-size", "7"], 2, r"^--global-batch-size 7 is not a multiple of the data-parallel size 2 \(world 2 "
                                      r"/ \(TP 1 x PP 1 x CP 1\)\) x --micro-batch-size 1, .*; use 6 or 8$"),
])
def test_conflicts_are_explained(extra, world, match):
    with pytest.raises(ArgumentConflict, match=match):
        flexsp(*extra, world=world, cost=COST_4 if world == 4 else COST_2)


def test_save_of_torch_dist_checkpoints_needs_psutil(monkeypatch, tmp_path):
    """megatron-core's torch_dist writer would wait forever without psutil: refused at once."""
    import importlib.util

    find_spec = importlib.util.find_spec
    flexsp("--save", str(tmp_path))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "psutil" else find_spec(name, *a))
    with pytest.raises(ConfigError, match=r"^--save writes torch_dist checkpoints .* pip install psutil"):
        flexsp("--save", str(tmp_path))
    flexsp("--save", str(tmp_path), "--ckpt-format", "torch")  # the torch format's writer does not use it
    flexsp()


def test_flexsp_planner_auto_takes_adaptive_recompute():
    """auto's pipeline steps recompute per chunk with --adaptive-recompute, as --elastic-pp's do."""
    args, v = flexsp("--flexsp-planner", "auto", "--adaptive-recompute", "--global-batch-size", "8")
    assert v.enabled and args.flexsp_planner == "auto"


def test_the_cost_model_must_fit_the_job():
    with pytest.raises(ArgumentConflict, match="describes 4 GPUs .* data-parallel size is 2"):
        flexsp(cost=COST_4, world=2)
    args = parse(*TINY, "--flexsp")
    with pytest.raises(ArgumentConflict, match="needs --cost-model"):
        validate_args(args, world_size=2)
    args = parse(*TINY, "--flexsp", "--cost-model", "llama-7b:h100-80g-8x4:0")
    with pytest.raises(InfeasibleError, match="model states"):
        validate_args(args, world_size=32)


def test_data_must_be_a_prefix_a_blend_or_mock():
    args = parse("--num-attention-heads", "8", "--flexsp", "--cost-model", COST_2)
    with pytest.raises(ArgumentConflict, match="needs data"):
        validate_args(args, world_size=2)
    args = parse("--num-attention-heads", "8", "--flexsp", "--cost-model", COST_2, "--data-path", "0.5", "a",
                 "0.5", "b")
    validate_args(args, world_size=2)  # a blend
    for bad, match in ((["0.5", "a", "0.5"], "weight-prefix pairs"), (["-1", "a", "2", "b"], "non-negative"),
                       (["0", "a", "0", "b"], "not all zero"), (["a", "0.5"], "the number '0.5'")):
        args = parse("--num-attention-heads", "8", "--flexsp", "--cost-model", COST_2, "--data-path", *bad)
        with pytest.raises(ArgumentConflict, match=match):
            validate_args(args, world_size=2)
    args = parse("--num-attention-heads", "8", "--flexsp", "--cost-model", COST_2, "--data-path", "x",
                 "--train-data-path", "y")
    with pytest.raises(ArgumentConflict, match="give one data source, not --data-path and --train-data-path"):
        validate_args(args, world_size=2)


def test_per_split_data_paths_and_argument_files(tmp_path):
    base = ("--num-attention-heads", "8", "--flexsp", "--cost-model", COST_2)
    validate_args(parse(*base, "--train-data-path", "0.5", "a", "0.5", "b", "--valid-data-path", "c"), world_size=2)
    (tmp_path / "blend.txt").write_text("0.3 a\n0.7 b\n")
    validate_args(parse(*base, "--data-args-path", str(tmp_path / "blend.txt")), world_size=2)
    (tmp_path / "splits.json").write_text('{"train": "0.3 a 0.7 b", "valid": ["c"], "test": null}')
    validate_args(parse(*base, "--per-split-data-args-path", str(tmp_path / "splits.json")), world_size=2)
    (tmp_path / "bad.json").write_text('["a"]')
    (tmp_path / "number.json").write_text('{"train": 5}')
    (tmp_path / "object.json").write_text('{"train": {"a": 1}}')
    (tmp_path / "odd.txt").write_text("0.3 a 0.7")
    for extra, match in ((["--valid-data-path", "c"], "need a train split"),
                         (["--train-data-path", "a", "--split", "90,10,0"], "--split divides --data-path"),
                         (["--train-data-path", "a", "--test-data-path", "1", "x", "2"], "--test-data-path 1 x 2: a blend"),
                         (["--data-args-path", str(tmp_path / "nothing.txt")], "cannot read"),
                         (["--data-args-path", str(tmp_path / "odd.txt")], "odd count"),
                         (["--per-split-data-args-path", str(tmp_path / "bad.json")], "a JSON object"),
                         (["--per-split-data-args-path", str(tmp_path / "number.json")], '"train" must be a string'),
                         (["--per-split-data-args-path", str(tmp_path / "object.json")], r'or a list .*got \{"a": 1\}'),
                         (["--mock-data", "--train-data-path", "a"], "give --train-data-path or --mock-data")):
        with pytest.raises(ArgumentConflict, match=match):
            validate_args(parse(*base, *extra), world_size=2)


def test_heads_cap_the_degree():
    assert head_degree_limit(8, 4) == 4 and head_degree_limit(8, None) == 8 and head_degree_limit(40, None) == 8
    assert head_degree_limit(52, None) == 4 and head_degree_limit(64, 8, tensor_parallel=2) == 4
    # 12 heads / 3 KV heads: only degree 1, whatever the cost model's ModelSpec says
    args = parse("--num-attention-heads", "12", "--group-query-attention", "--num-query-groups", "3", "--mock-data",
                 "--flexsp", "--cost-model", COST_4)
    v = validate_args(args, world_size=4)
    assert any("capped at 1" in n for n in v.notes)
    with pytest.raises(ArgumentConflict, match="only divide by up to 1"):
        validate_args(parse("--num-attention-heads", "12", "--group-query-attention", "--num-query-groups", "3",
                            "--mock-data", "--flexsp", "--cost-model", COST_4, "--flexsp-max-sp-size", "2"),
                      world_size=4)


def test_capped_cost_model():
    cost = load_cost_model(COST_4)
    assert cost.degrees == (1, 2, 4)
    capped = cap_cost_model(cost, 2)
    assert isinstance(capped, CappedCostModel) and capped.degrees == (1, 2)
    assert capped.max_seq_len == cost.token_capacity(2) < cost.max_seq_len
    assert cap_cost_model(cost, 8) is cost
    import pickle

    assert pickle.loads(pickle.dumps(capped)).degrees == (1, 2)  # the planner process gets a copy


def test_ring_reaches_past_the_heads():
    """--flexsp-max-ring: 12 heads / 3 KV heads allow Ulysses 1 only; a ring of 4 still gives groups
    of 2 and 4 GPUs (1 x ring), and the plans validate against that split."""
    import numpy as np

    from megatron_ext.planner.api import make_plan

    base = ("--num-attention-heads", "12", "--group-query-attention", "--num-query-groups", "3", "--mock-data",
            "--flexsp", "--cost-model", COST_4)
    args = parse(*base, "--flexsp-max-ring", "4")
    assert validate_args(args, world_size=4).enabled
    cost = cap_cost_model(megatron_cost_model(args), head_degree_limit(12, 3))  # what the run plans with
    assert cost.degrees == (1, 2, 4) and [cost.ring_degree(d) for d in cost.degrees] == [1, 2, 4]
    plan = make_plan("flexsp", np.array([cost.token_capacity(4), 300, 200]), cost)
    assert any(g.ring == 4 for mb in plan.micro_batches for g in mb.groups)
    with pytest.raises(ArgumentConflict, match="--flexsp-max-ring must be a power of two"):
        validate_args(parse(*base, "--flexsp-max-ring", "3"), world_size=4)
    with pytest.raises(ArgumentConflict, match="--flexsp-max-ring has no effect without --flexsp"):
        validate_args(parse("--num-attention-heads", "8", "--flexsp-max-ring", "2"), world_size=4)


# ---- the ZeRO stage: Megatron's arguments decide it ------------------------------------------------
def test_zero_stage_follows_megatron_arguments():
    """--use-distributed-optimizer is ZeRO-1, plain DDP ZeRO-0; a cost model stating no stage (a
    YAML without zero_stage, MODEL:CLUSTER) takes it, and at stage 0 it holds fewer tokens a GPU."""
    assert megatron_zero_stage(parse())[0] == 0
    assert megatron_zero_stage(parse("--use-distributed-optimizer"))[0] == 1
    ddp, _ = flexsp()
    dist_opt, _ = flexsp("--use-distributed-optimizer")
    assert "zero_stage" not in read_yaml(Path(COST_2))
    zero0, zero1 = megatron_cost_model(ddp), megatron_cost_model(dist_opt)
    assert (zero0.zero_stage, zero1.zero_stage) == (0, 1)
    assert zero0.model_states_mb > zero1.model_states_mb and zero0.tokens_per_gpu < zero1.tokens_per_gpu
    presets, _ = flexsp("--use-distributed-optimizer", world=4, cost="tiny:cpu-4")
    assert megatron_cost_model(presets).zero_stage == 1


def test_the_cost_model_recomputes_what_the_run_recomputes():
    """A preset's recompute (llama-13b: 18 of 40 layers, which its published memory figure implies)
    is not what a Megatron-LM run keeps: the run's arguments decide, and where the planner decides
    per chunk (--elastic-pp, --flexsp-planner auto: Megatron's full recompute refused), none."""
    from megatron_ext.megatron.cost import megatron_recompute

    def args(**kw):
        return argparse.Namespace(cost_model="llama-13b:a800-80g-8x4", num_layers=40, **kw)

    full = dict(recompute_granularity="full", recompute_num_layers=10)
    assert megatron_recompute(args()) == ("none", None)
    assert megatron_recompute(args(recompute_granularity="selective")) == ("none", None)
    assert megatron_recompute(args(**full, recompute_method="block")) == ("full", 10)
    assert megatron_recompute(args(**full, recompute_method="uniform")) == ("full", None)
    assert megatron_recompute(args(**full, recompute_method="block", flexsp_planner="auto")) == ("none", None)
    assert megatron_recompute(args(elastic_pp=True)) == ("none", None)
    assert load_cost_model("llama-13b:a800-80g-8x4", 0).model.recomputed_layers == 18
    assert megatron_cost_model(args()).model.recomputed_layers == 0
    assert megatron_cost_model(args(**full, recompute_method="block")).model.recomputed_layers == 10


def test_the_budget_counts_the_model_states_megatron_keeps():
    """Megatron's --bf16 keeps fp32 gradient buffers (unless --grad-reduce-in-bf16 or
    --main-grads-dtype bf16): 18 bytes a parameter under DDP, 6 + 12 / dp with the distributed
    optimizer, where the paper's accounting counts 16 and 4 + 12 / dp (gpt-7b on 32 H100s planned
    ~15 GB a GPU the run did not have); an fp32 run keeps no master copy: 16, and 8 + 8 / dp. The
    capped cost model of a run and its pipeline stages count the same."""
    from megatron_ext.cost.pipeline import PipelineCost
    from megatron_ext.megatron.cost import megatron_state_bytes

    def args(*flags):
        return argparse.Namespace(cost_model="gpt-7b:h100-80g-8x4", **{f: True for f in flags})

    assert [megatron_state_bytes(args(*f)) for f in (("bf16",), ("bf16", "grad_reduce_in_bf16"), ("fp16",),
                                                     ("fp16", "accumulate_allreduce_grads_in_fp32"), ())] == [
        (2, 4, 12), (2, 2, 12), (2, 2, 12), (2, 4, 12), (4, 4, 8)]
    assert megatron_state_bytes(argparse.Namespace(bf16=True, main_grads_dtype="torch.bfloat16")) == (2, 2, 12)
    gb = 7.85 * 1024  # MB a byte of gpt-7b's parameters
    ddp, dist_opt = megatron_cost_model(args("bf16")), megatron_cost_model(args("bf16", "use_distributed_optimizer"))
    assert ddp.model_states_mb == pytest.approx(18 * gb)
    assert dist_opt.model_states_mb == pytest.approx((6 + 12 / 32) * gb)
    assert megatron_cost_model(args("bf16", "grad_reduce_in_bf16")).model_states_mb == pytest.approx(16 * gb)
    fp32 = megatron_cost_model(args("use_distributed_optimizer"))
    assert fp32.model_states_mb == pytest.approx((8 + 8 / 32) * gb)
    assert cap_cost_model(dist_opt, 4).model_states_mb == pytest.approx(dist_opt.model_states_mb)
    # two stages x SP 8 x 2 replicas: an end stage's half of the layers' parameters and its vocabulary
    # table (50,257 x 4,096), sharded over its 16 GPUs
    vocab = 50257 * 4096 / 1e9
    stage = ((7.85 - vocab) / 2 + vocab) * 1024
    assert PipelineCost(dist_opt, 2, 8).model_states_mb == pytest.approx((6 + 12 / 16) * stage)


def test_validation_budgets_the_stage_of_megatron_arguments():
    """LLaMA-7B's model states fill an 80 GB GPU without the distributed optimizer (ZeRO-0), not
    with it (ZeRO-1 over 32 ranks): the validation sees the stage the run has."""
    argv = ("--num-layers", "32", "--num-attention-heads", "32", "--mock-data", "--flexsp", "--cost-model",
            "llama-7b:h100-80g-8x4")
    with pytest.raises(InfeasibleError, match="at ZeRO-0"):
        validate_args(parse(*argv), world_size=32)
    assert validate_args(parse(*argv, "--use-distributed-optimizer"), world_size=32).enabled


def test_a_cost_model_stating_another_stage_is_refused(tmp_path):
    yaml = tmp_path / "tiny-cpu2-zero3.yaml"
    yaml.write_text(Path(COST_2).read_text() + "zero_stage: 3\n")
    with pytest.raises(ConfigError) as e:
        flexsp("--use-distributed-optimizer", cost=str(yaml))
    assert str(e.value).startswith(f"--cost-model {yaml} says zero_stage: 3, but Megatron's arguments give stage 1 "
                                   f"(--use-distributed-optimizer shards the optimizer states")
    assert "\n" not in str(e.value) and "drop the stage from --cost-model" in str(e.value)
    with pytest.raises(ConfigError, match=r"^--cost-model tiny:cpu-4:1 says ZeRO stage 1, but Megatron's arguments "
                                          r"give stage 0 \(without --use-distributed-optimizer"):
        flexsp(world=4, cost="tiny:cpu-4:1")
    with pytest.raises(ConfigError, match="says ZeRO stage 0, but Megatron's arguments give stage 1"):
        elastic("--use-distributed-optimizer", cost="tiny:cpu-4:0")
    # the same stage, stated, is fine
    args, _ = flexsp("--use-distributed-optimizer", world=4, cost="tiny:cpu-4:1")
    assert megatron_cost_model(args).zero_stage == 1
    yaml.write_text(Path(COST_2).read_text() + "zero_stage: 1\n")
    assert flexsp("--use-distributed-optimizer", cost=str(yaml))[1].enabled


@pytest.mark.parametrize("extra, error, match", [
    (["--use-megatron-fsdp"], NotYetSupported,
     r"^--flexsp does not support --use-megatron-fsdp: in megatron-core 0.16.1 Megatron-FSDP reduce-scatters "
     r"gradients in every backward .* every rank must join in step\. Every rank does run each micro-batch of a step "
     r".*untested under FSDP .*Use --use-distributed-optimizer"),
    (["--use-torch-fsdp2"], NotYetSupported, r"^--flexsp does not support --use-torch-fsdp2: .*untested under FSDP"),
    (["--use-megatron-fsdp", "--flexsp-planner", "auto"], ArgumentConflict,
     r"the pipeline replicas of --flexsp-planner auto run different numbers of chunks a step, so their ranks would "
     r"wait in different collectives and hang"),
])
def test_fsdp_is_refused_with_flexsp(extra, error, match):
    with pytest.raises(error, match=match):
        flexsp(*extra)


@pytest.mark.parametrize("extra, error, match", [
    (["--use-megatron-fsdp"], NotYetSupported, r"^--elastic-pp does not support --use-megatron-fsdp: .*Every rank "
                                               r"does run each chunk of its stage"),
    (["--use-megatron-fsdp", "--elastic-pp-sp", "1"], ArgumentConflict,
     r"the pipeline replicas of --elastic-pp-sp 1 run different numbers of chunks"),
    (["--use-torch-fsdp2"], ArgumentConflict, r"^--elastic-pp runs pipeline stages, and Megatron refuses "
                                              r"--use-torch-fsdp2 with pipeline parallelism"),
])
def test_fsdp_is_refused_with_elastic_pp(extra, error, match):
    with pytest.raises(error, match=match):
        elastic(*extra)


def test_cost_model_references():
    assert load_cost_model("gpt-7b:a100-40g-8x8").num_gpus == 64
    assert load_cost_model("gpt-7b:h100-80g-8x4:1").zero_stage == 1
    assert load_cost_model("gpt-7b:h100-80g-8x4", zero_stage=0).zero_stage == 0
    assert load_cost_model(COST_2, zero_stage=0).zero_stage == 0  # the file states none

    for bad in ("gpt-7b", "nope.yaml", ":x", "gpt-7b:a100-40g-8x8:1:2"):
        with pytest.raises(ConfigError):
            load_cost_model(bad)


def elastic(*extra: str, world: int = 4, cost: str = COST_4):
    args = parse(*TINY, "--elastic-pp", "--pipeline-model-parallel-size", "2", "--cost-model", cost, *extra)
    return args, validate_args(args, world_size=world)


def test_elastic_global_batch_divides_over_each_stages_data_parallel_ranks():
    elastic("--global-batch-size", "6")
    with pytest.raises(ArgumentConflict, match=r"--global-batch-size 5 .* size 2 \(world 4 / \(TP 1 x PP 2 x CP 1\)\)"):
        elastic("--global-batch-size", "5")


def test_elastic_pp_validates_and_adjusts():
    args, v = elastic()
    assert v.enabled and v.data_parallel_size == 2
    assert args.elastic_pp_sp == 2  # the default: each stage's data-parallel ranks one SP group
    assert args.calculate_per_token_loss and args.dataloader_type == "external" and args.micro_batch_size == 1
    assert "--calculate-per-token-loss" in " ".join(v.notes)
    _, v = elastic("--adaptive-recompute", "--planner-log", "/tmp/plans.jsonl")
    assert v.enabled


@pytest.mark.parametrize("extra, world, match", [
    (["--pipeline-model-parallel-size", "1"], 4, "at least 2"),
    (["--context-parallel-size", "2"], 8, "replaces context parallelism"),
    (["--flexsp"], 4, "choose one"),
    (["--tensor-model-parallel-size", "2"], 8, "--tensor-model-parallel-size 1 \\(got 2\\)"),
    (["--num-layers-per-virtual-pipeline-stage", "1"], 4, "drop the virtual pipeline"),
    (["--decoder-first-pipeline-num-layers", "1"], 4, "drop --decoder-first-pipeline-num-layers"),
    (["--num-layers", "3"], 4, "does not divide the 3 layers"),
    (["--num-attention-heads", "6", "--num-query-groups", "3"], 4, "2 data-parallel ranks .*up to 1 here"),
    (["--recompute-granularity", "full"], 4, "drop --recompute-granularity full"),
    (["--flexsp-max-sp-size", "2"], 4, "--flexsp-max-sp-size belongs to --flexsp"),
    (["--flexsp-planner", "batchada"], 4, "elastic_pp planner"),
    (["--micro-batch-size", "2"], 4, "needs --micro-batch-size 1"),
    (["--defer-embedding-wgrad-compute"], 4, "drop --defer-embedding-wgrad-compute$"),
    (["--use-tp-pp-dp-mapping"], 4, "drop --use-tp-pp-dp-mapping$"),
])
def test_elastic_pp_conflicts_are_explained(extra, world, match):
    with pytest.raises(ArgumentConflict, match=match):
        elastic(*extra, world=world)


def test_elastic_pp_sp_splits_the_stages_into_replicas():
    args, v = elastic("--elastic-pp-sp", "1", "--global-batch-size", "2")
    assert v.enabled and v.data_parallel_size == 2 and args.elastic_pp_sp == 1
    assert not any("elastic-pp-sp" in note for note in v.notes)
    # a data-parallel size the heads do not divide by is no obstacle to replicas of an allowed SP
    with pytest.raises(ArgumentConflict, match="2 data-parallel ranks .*up to 1 here.* or split the stages into "
                                               "pipeline replicas of a smaller SP with --elastic-pp-sp"):
        elastic("--num-attention-heads", "6", "--num-query-groups", "3")
    args, _ = elastic("--num-attention-heads", "6", "--num-query-groups", "3", "--elastic-pp-sp", "1")
    assert args.elastic_pp_sp == 1


@pytest.mark.parametrize("extra, world, match", [
    (["--elastic-pp-sp", "4"], 4, r"^--elastic-pp-sp 4 must divide a stage's 2 data-parallel ranks \(world 4 / PP 2\)"),
    (["--elastic-pp-sp", "0"], 4, r"^--elastic-pp-sp 0 must divide a stage's 2 data-parallel ranks"),
    (["--elastic-pp-sp", "3"], 12, r"^--elastic-pp-sp 3 is not an allowed Ulysses degree: a power of two dividing "
                                   r"the 8 attention heads"),
    (["--elastic-pp-sp", "2", "--num-attention-heads", "6", "--num-query-groups", "3"], 4,
     r"^--elastic-pp-sp 2 is not an allowed Ulysses degree: .*the 6 attention heads and the KV heads \(up to 1 here\)"),
    (["--elastic-pp-sp", "1", "--global-batch-size", "1"], 4,
     r"^--elastic-pp-sp 1 runs 2 pipeline replicas side by side .*--global-batch-size 1 leaves some with none; "
     r"give at least 2 sequences"),
])
def test_elastic_pp_sp_conflicts_are_explained(extra, world, match):
    with pytest.raises(ArgumentConflict, match=match):
        elastic(*extra, world=world)


def test_elastic_pp_sp_auto_chooses_per_step():
    """--elastic-pp-sp auto: the degree (and the replicas) of the stages' SP is the auto planner's
    choice per step; every replica of SP 1 needs a sequence, and the cost model spans the job."""
    args, v = elastic("--elastic-pp-sp", "auto", "--global-batch-size", "2")
    assert v.enabled and args.elastic_pp_sp == "auto"
    with pytest.raises(ArgumentConflict, match=r"^--elastic-pp-sp auto may run 2 pipeline replicas side by side "
                                               r"\(a stage's 2 data-parallel ranks / SP 1\)"):
        elastic("--elastic-pp-sp", "auto", "--global-batch-size", "1")
    with pytest.raises(ArgumentConflict, match=r"span every rank \(2 stages x any SP, and replicas\)"):
        elastic("--elastic-pp-sp", "auto", cost=COST_2)
    with pytest.raises(SystemExit):
        parse("--elastic-pp", "--elastic-pp-sp", "two")


def test_elastic_pp_sp_needs_elastic_pp():
    with pytest.raises(ArgumentConflict, match="^--elastic-pp-sp sets the Ulysses degree of --elastic-pp's pipeline "
                                               "stages; it has no effect without --elastic-pp$"):
        validate_args(parse(*TINY, "--elastic-pp-sp", "1"), world_size=2)
    with pytest.raises(ArgumentConflict, match=r"no effect without --elastic-pp \(--flexsp chooses each group's "
                                               r"degree: bound it with --flexsp-max-sp-size\)"):
        flexsp("--elastic-pp-sp", "1")


def test_elastic_pp_cost_model_spans_the_world():
    with pytest.raises(ArgumentConflict, match=r"this job has 4 ranks: elastic pipelines span every rank "
                                               r"\(2 replicas x 2 stages x SP 1\)"):
        elastic("--elastic-pp-sp", "1", cost=COST_2)
    with pytest.raises(ArgumentConflict, match="describes 2 GPUs .* this job has 4 ranks"):
        elastic(cost=COST_2)
    with pytest.raises(ArgumentConflict, match="--elastic-pp needs --cost-model"):
        validate_args(parse(*TINY, "--elastic-pp", "--pipeline-model-parallel-size", "2"), world_size=4)
    with pytest.raises(InfeasibleError, match="--elastic-pp with --cost-model llama-7b:a100-40g-8x4:0: .*model states"):
        validate_args(parse("--num-layers", "32", "--num-attention-heads", "32", "--mock-data", "--elastic-pp",
                            "--pipeline-model-parallel-size", "2", "--cost-model", "llama-7b:a100-40g-8x4:0"),
                      world_size=32)


def test_plan_ahead_beyond_one_step_is_not_supported_yet():
    with pytest.raises(NotYetSupported, match="plans one step ahead"):
        flexsp("--plan-ahead", "2")
    flexsp("--plan-ahead", "0")


def test_extra_args_provider_chains_and_validates(capsys, monkeypatch):
    def other(parser):
        parser.add_argument("--other-flag", action="store_true")
        return parser

    parser = extra_args_provider(other)(megatron_like_parser(ours=False))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    args = parser.parse_args([*TINY, "--other-flag", "--flexsp", "--cost-model", COST_2])
    assert args.other_flag and args.calculate_per_token_loss
    out = capsys.readouterr().out
    assert out.startswith("megatron_ext: --flexsp set ") and "--calculate-per-token-loss" in out
    with pytest.raises(SystemExit) as e:
        parser.parse_args([*TINY, "--flexsp", "--cost-model", COST_2, "--context-parallel-size", "2"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("megatron-ext: error: --flexsp replaces context parallelism") and err.count("\n") == 1
    # another rank leaves rank 0 a moment to say it (torchrun then stops the rest), and says it
    # itself only if still running
    from megatron_ext import lifetime

    waited = []
    monkeypatch.setattr(lifetime.time, "sleep", waited.append)
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit) as e:
        parser.parse_known_args([*TINY, "--flexsp", "--cost-model", COST_2, "--micro-batch-size", "2"])
    assert e.value.code == 2 and waited == [lifetime.RANK_ERROR_WAIT_S]
    assert capsys.readouterr().err.startswith("megatron-ext: error: --flexsp needs --micro-batch-size 1 (got 2)")


# ---- the argument files ----------------------------------------------------------------------------
def file_args(name: str) -> list[str]:
    out = subprocess.run(["bash", "-c", f'source "{ROOT}/scripts/slurm/common.sh"; args_from_file "$1"', "_",
                          str(ROOT / "configs/megatron" / name)], capture_output=True, text=True, check=True)
    return out.stdout.split("\n")[:-1]


@pytest.mark.parametrize("name, cluster, world", [
    ("gpt-7b", "h100-80g-8x4", 32), ("gpt-13b", "h100-80g-8x8", 64), ("llama-7b", "a800-80g-8x4", 32),
    ("llama-13b", "h100-80g-8x8", 64),
])
def test_gpu_argument_files_validate(name, cluster, world):
    argv = file_args(f"{name}.args")
    assert "--flexsp" in argv and "--cost-model" not in argv
    args, unknown = megatron_like_parser().parse_known_args(argv + ["--mock-data", "--cost-model",
                                                                     f"{name}:{cluster}:1"])
    v = validate_args(args, world_size=world)
    assert v.enabled and v.data_parallel_size == world


@pytest.mark.parametrize("name, tp", [("gpt-30b", 4), ("llama-30b", 4)])
def test_30b_argument_files_use_tensor_parallelism(name, tp):
    argv = file_args(f"{name}.args")
    cost = str(ROOT / f"configs/megatron/cost/{name}-tp{tp}-h100-8x8.yaml")
    args, _ = megatron_like_parser().parse_known_args(argv + ["--mock-data", "--cost-model", cost])
    assert args.tensor_model_parallel_size == tp and not args.sequence_parallel
    v = validate_args(args, world_size=64)
    assert v.data_parallel_size == 16 and megatron_cost_model(args).max_seq_len > 16384  # (the states the run keeps)


def test_tiny_cpu_argument_file_validates():
    argv = file_args("tiny-cpu.args")
    args, _ = megatron_like_parser().parse_known_args(argv + ["--mock-data", "--cost-model", COST_2])
    assert validate_args(args, world_size=2).enabled
