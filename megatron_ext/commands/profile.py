"""`megatron-ext profile`: measure the cost model's coefficients on this hardware.

It writes a cost-model YAML that ``plan``, ``simulate`` and ``train`` accept via --cost-model.

The launcher side (``run``) checks the options and starts one process per rank of the
cluster with torchrun (``launch.py``). Every rank runs this module's ``main``: it joins the process
group and measures (``runtime/profile.py``: what is measured and how it is fitted); rank 0 shows
the progress, writes the YAML (model + cluster inline; the ZeRO stage, device, dtype and attention
backend it describes; a ``profile`` section with the measurements and fit residuals) and prints
the coefficients.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

import torch.distributed as dist
import yaml

from megatron_ext.commands.args import ArgumentParser, check_output_file, path_arg, positive_int
from megatron_ext.commands.launch import torchrun, with_launcher_help
from megatron_ext.cost import CostModel
from megatron_ext.errors import ConfigError, MegatronExtError
from megatron_ext.files import replacing
from megatron_ext.lifetime import exit_process

from megatron_ext.runtime.compat import quiet_fallback_warnings

quiet_fallback_warnings()  # (the launcher imports this module too)

from megatron_ext.runtime.kernels import check_backend  # noqa: E402
from megatron_ext.runtime.backends import ATTENTION_BACKENDS  # noqa: E402
from megatron_ext.runtime.device import DEVICE_CHOICES, choose_device, init_rank_process_group, rank_device  # noqa: E402
from megatron_ext.runtime.profile import DTYPES, HEAD_SHARE_CAP, Profile, RankSetup, measure, measurements  # noqa: E402
from megatron_ext.runtime.timing import DeviceClock  # noqa: E402

RANKS = "megatron_ext.commands.profile"  # what torchrun runs on every rank: this module


def run(rest: list[str]) -> int:
    return torchrun(RANKS, rest)


def print_help() -> None:
    with_launcher_help(build_parser()).print_help()


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="megatron-ext profile", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny",
                   help="model preset or YAML (its shape is what gets measured) (default: %(default)s)")
    p.add_argument("--cluster", default="cpu-4",
                   help="cluster preset or YAML (its GPU count is the rank count) (default: %(default)s)")
    p.add_argument("--out", required=True, type=path_arg, metavar="FILE.yaml", help="cost-model YAML to write")
    p.add_argument("--lengths", type=_length_list, default="128,256,512,1024,2048,3072",
                   help="comma-separated sequence lengths of the compute sweep (default: %(default)s)")
    p.add_argument("--repeats", type=positive_int, default=3,
                   help="timed runs per point (the median is kept) (default: %(default)s)")
    p.add_argument("--device", default="auto", choices=DEVICE_CHOICES,
                   help="where the ranks run: cuda (NCCL, one GPU per rank), cpu (gloo), or auto: cuda where "
                        "there is CUDA (default auto)")
    p.add_argument("--dtype", choices=list(DTYPES), help="the model's dtype (default: bf16 on cuda, fp32 on cpu)")
    p.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
                   help="the core attention training will use (default auto: flash-attn, then Transformer Engine, "
                        "on CUDA in bf16, else SDPA)")
    p.add_argument("--zero-stage", type=int, default=0, choices=[0, 1, 2, 3],
                   help="ZeRO stage of the profiled run's model states, written to the YAML (default 0, the plain "
                        "Adam of `train`; 1 for Megatron-LM's --use-distributed-optimizer)")
    return p


MAX_PROFILE_LENGTH = 2**20  # tokens of one measured pass (a longer one holds no GPU's activations)


def _length_list(text: str) -> list[int]:
    try:
        lengths = [positive_int(x.strip()) for x in text.split(",")]
    except argparse.ArgumentTypeError:
        lengths = []
    if not lengths or max(lengths) > MAX_PROFILE_LENGTH:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive lengths of at most {MAX_PROFILE_LENGTH:,}, "
                                         f"e.g. 128,512,2048, got {text!r}")
    if len(set(lengths)) < 3:  # (a pass is a1 s^2 + a2 s + b1: three unknowns)
        raise argparse.ArgumentTypeError(f"expected three different lengths or more (the fit has three unknowns), "
                                         f"e.g. 128,512,2048, got {text!r}")
    return lengths


def check_args(args, local_ranks: int) -> tuple[str, str]:
    """Refuse what cannot run here before any rank starts (the launcher calls it, for the
    ``local_ranks`` it starts on this machine, and every rank again). Returns the device type the
    ranks run on ("cuda" or "cpu") and the dtype name."""
    device = choose_device(args.device, local_ranks)
    dtype = args.dtype or ("bf16" if device == "cuda" else "fp32")
    check_backend(args.attention_backend, device, dtype, "profile", "use --dtype bf16")
    return device, dtype


def check_before_launch(args) -> CostModel:
    """Refuse what cannot run before any rank starts (``launch.torchrun`` calls it); the cost
    model of ``--model`` and ``--cluster``, whose GPU count is the run's rank count."""
    cost = CostModel.from_presets(args.model, args.cluster)
    check_args(args, cost.num_gpus)
    check_output_file(args.out, "--out")  # (written after every measurement)
    if not args.out.lower().endswith((".yaml", ".yml")):  # (any other name, a picture too, was written over)
        raise ConfigError(f"--out {args.out!r}: the file name must end in .yaml or .yml (a cost-model YAML)")
    return cost


def rank_model_states_mb(args, cost: CostModel) -> float:
    """MB of model states a rank holds (the launcher's memory check): the whole model's weights and
    gradients in the profiled dtype (no optimizer)."""
    _, dtype = check_args(args, cost.num_gpus)
    return cost.model.params_b * 1024 * 2 * DTYPES[dtype].itemsize


# ---- on every rank (under torchrun) -------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    import signal

    from megatron_ext.lifetime import die_with_parent, exit_quietly_on_stop_signals, say_rank_error

    # as train's ranks: stopped (torchrun passes a stop signal on), a rank ends quietly; orphaned, at once
    exit_quietly_on_stop_signals()
    die_with_parent(signal.SIGKILL)
    args = build_parser().parse_args(argv)
    try:
        _, dtype_name = check_args(args, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        init_rank_process_group(args.device)
        try:
            device = rank_device()
            return _profile(args, RankSetup(device, dtype_name, args.attention_backend, DeviceClock(device)))
        finally:
            dist.destroy_process_group()
    except MegatronExtError as e:
        return say_rank_error(e, int(os.environ.get("RANK", "0")))


def _profile(args, setup: RankSetup) -> int:
    from tqdm import tqdm

    rank, world = dist.get_rank(), dist.get_world_size()
    base = CostModel.from_presets(args.model, args.cluster, args.zero_stage)
    lengths = args.lengths
    progress = tqdm(total=measurements(world, base.model, lengths), disable=rank != 0, file=sys.stderr,
                    bar_format="[{bar:30}] {n}/{total} {desc}")

    def tick(what):
        progress.set_description_str(what, refresh=False)
        progress.update()

    found = measure(base, lengths, args.repeats, setup, tick)
    progress.close()
    if rank == 0:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        text = (f"# Measured by `megatron-ext profile --model {args.model} --cluster {args.cluster}` "
                f"on {world} {dist.get_backend()} ranks ({setup.device_name}, {setup.dtype_name}, "
                f"{found.attention} attention).\n"
                + yaml.safe_dump(_document(found, setup, dist.get_backend(), world), sort_keys=False))
        with replacing(out) as tmp:
            tmp.write_text(text)
        print(_summary(found, setup) + f"\nwrote {out}", flush=True)
    return 0


def _document(found: Profile, setup: RankSetup, host: str, ranks: int) -> dict:
    """The cost-model YAML's content: the fitted model and cluster, what they describe, and the
    measurements they were fitted from."""
    cost, fit, raw = found.cost, found.fit, found.raw_a2a
    return {
        "model": _fields(cost.model),
        "cluster": _fields(cost.cluster),
        "zero_stage": cost.zero_stage,
        # what the costs above were measured with (metadata: cost models do not read it)
        "device": setup.device_name,
        "dtype": setup.dtype_name,
        "attention_backend": found.attention,
        "profile": {
            "host": host, "ranks": ranks, "lengths": found.lengths,
            "fwd_bwd_ms": {d: [round(float(t), 3) for t in v] for d, v in found.fwd_bwd_ms.items()},
            "fit_residual_ms": fit["residual_ms"],
            "fit_rel_error": round(fit["rel_error"], 4),
            "raw_a2a": {d: {k: round(x, 4) for k, x in v.items()} for d, v in raw.items()},
            **found.runs,
        },
    }


def _summary(found: Profile, setup: RankSetup) -> str:
    model, cluster, raw = found.cost.model, found.cost.cluster, found.raw_a2a
    return (f"a1 {model.a1:.3e}  a2 {model.a2:.4f}  launch (b1) {model.launch_ms:.2f} ms  (median fit error "
            f"{round(found.fit['rel_error'], 4):.1%})\n"
            f"activation {model.act_mb_per_token:.4f} MB/token, {model.params_b * 1e3:.3f} M parameters, output layer "
            f"{model.head_share:.0%} of the per-token work"
            + _head_share_note(found.runs["output_layer_share"]) + "\n"
            + "".join(f"all-to-all degree {d}: {v['bandwidth_gbps']:.3f} GB/s, latency {v['latency_ms']:.2f} ms per call "
                      f"in place (raw: {raw[d]['bandwidth_gbps']:.3f} GB/s, {raw[d]['latency_ms']:.2f} ms)\n"
                      for d, v in found.a2a.items())
            + (f"p2p {cluster.p2p_bandwidth_gbps:.3f} GB/s, {found.handoff_ms:.2f} ms per stage handoff\n"
               if cluster.p2p_bandwidth_gbps is not None else "p2p: one rank, no pair to time\n")
            + f"FlexSP: {cluster.micro_batch_overhead_ms:.2f} ms per micro-batch beyond the model\n"
            f"pipeline: {cluster.pipeline_op_overhead_ms:.2f} ms per stage operation beyond the model\n"
            f"on {setup.device_name}, {setup.dtype_name}, {found.attention} attention, ZeRO-{found.cost.zero_stage}")


def _head_share_note(measured) -> str:
    """Why the output layer's share is what the summary says: ``measured`` its time over the fit's
    a2 (None where a2 is 0), the model keeping it up to HEAD_SHARE_CAP and the FLOPs' share past 1."""
    if measured is None:
        return " (from its FLOPs: the fit's a2 is 0, launches hide the per-token work; profile longer --lengths)"
    if measured > 1:
        return (f" (from its FLOPs: it measured {measured:.0%} of the fit's a2, which splits a1 and a2 poorly at "
                f"these lengths; profile longer --lengths)")
    if measured > HEAD_SHARE_CAP:
        return f" (measured {measured:.0%} of the fit's a2, capped: the layers do some per-token work too)"
    return ""


def _fields(spec) -> dict:
    """A spec's fields for the cost-model YAML (its name is the file's; unset fields left out)."""
    def tidy(v):
        if isinstance(v, float):
            return float(f"{v:.6g}")
        if isinstance(v, dict):
            return {k: tidy(x) for k, x in v.items()}
        return v

    return {k: tidy(v) for k, v in dataclasses.asdict(spec).items() if k != "name" and v is not None}


if __name__ == "__main__":
    exit_process(main())
