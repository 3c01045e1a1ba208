"""`megatron-ext profile` on 4 CPU ranks writes a cost model that `plan` accepts (one launch);
what cannot run here is refused in one line before any rank starts."""
import subprocess
import sys
from pathlib import Path

import torch
import yaml

from megatron_ext.commands import cli, profile
from megatron_ext.cost import CostModel
from megatron_ext.errors import ConfigError
from megatron_ext.runtime import kernels
from megatron_ext.runtime.profile import fit_profile, nonnegative_fit, transfer_fit
from megatron_ext.spec import load_model

import numpy as np
import pytest


def test_profile_writes_a_usable_cost_model(tmp_path):
    out = tmp_path / "cost.yaml"
    # a cluster file profiled before (its overheads absurd here): what it says of the overheads
    # must not be counted in the estimates the new ones are fitted against
    cluster = tmp_path / "cpu-4-profiled.yaml"
    preset = yaml.safe_load((Path(profile.__file__).parents[1] / "presets/clusters/cpu-4.yaml").read_text())
    cluster.write_text(yaml.safe_dump({**preset, "micro_batch_overhead_ms": 5000.0, "pipeline_op_overhead_ms": 5000.0}))
    done = subprocess.run([sys.executable, "-m", "megatron_ext.commands.cli", "profile", "--out", str(out),
                           "--cluster", str(cluster), "--lengths", "64,128,256", "--repeats", "1"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    cost = CostModel.from_yaml(out)
    assert cost.num_gpus == 4
    assert cost.model.a1 >= 0 and cost.model.a2 >= 0 and cost.model.launch_ms >= 0
    assert cost.model.a1 + cost.model.a2 > 0
    assert 0 < cost.model.act_mb_per_token < 1
    assert all(v > 0 for v in cost.cluster.a2a_bandwidth_gbps.values()) and set(cost.cluster.a2a_bandwidth_gbps) == {2, 4}
    assert set(cost.cluster.a2a_latency_ms) == {2, 4} and all(v >= 0 for v in cost.cluster.a2a_latency_ms.values())
    assert cost.model.activation_bytes == 4  # the CPU runtime trains in fp32
    assert cost.zero_stage == 0  # train's optimizer is not distributed
    assert cost.cluster.p2p_latency_ms >= 0 and cost.cluster.p2p_bandwidth_gbps > 0
    assert cost.cluster.pipeline_op_overhead_ms >= 0 and cost.cluster.micro_batch_overhead_ms >= 0
    doc = yaml.safe_load(out.read_text())
    # the output layer's measured share of a2, capped at 0.95; where busy cores hide the per-token
    # work (a2 fitted 0, or under what the output layer alone takes) the FLOPs' share stands
    measured = doc["profile"]["output_layer_share"]
    assert (measured is None) == (cost.model.a2 == 0)
    if measured is not None and measured <= 1:
        assert cost.model.head_time_share == pytest.approx(min(0.95, measured), abs=1e-3) and measured > 0
    else:
        assert cost.model.head_time_share is None
    assert doc["dtype"] == "fp32" and doc["attention_backend"] == "sdpa" and doc["device"].startswith("CPU")
    assert doc["profile"]["host"] == "gloo"
    assert set(doc["profile"]["fwd_bwd_ms"]) == {1, 2, 4} and all(len(v) == 3 for v in doc["profile"]["fwd_bwd_ms"].values())
    assert all(len(v) == 3 for v in doc["profile"]["fit_residual_ms"].values())
    # the written model is the fit: each pass it measured, less the fit's residual, is what it prices
    # (but where a degree's all-to-all cost did not grow with the tokens: its raw bandwidth stands)
    raw = doc["profile"]["raw_a2a"]
    for d, measured_ms in doc["profile"]["fwd_bwd_ms"].items():
        if d > 1 and cost.cluster.a2a_bandwidth_gbps[d] == pytest.approx(raw[d]["bandwidth_gbps"], rel=1e-3):
            continue
        for s, y, r in zip(doc["profile"]["lengths"], measured_ms, doc["profile"]["fit_residual_ms"][d]):
            priced = cost.pass_fixed_ms + cost.a2a_latency_ms(d) + float(cost.seq_time_ms(s, d))
            assert priced == pytest.approx(y - r, abs=5e-3), (d, s)
    # a real 2-stage pipeline step of the 2-layer model was timed against the simulator
    assert doc["profile"]["pipeline_stages"] == 2 and doc["profile"]["pipeline_step_ms"] > 0
    # and a real FlexSP step against its plan's estimate
    assert doc["profile"]["flexsp_step_ms"] > 0 and doc["profile"]["flexsp_micro_batches"] >= 1
    assert doc["profile"]["flexsp_estimated_ms"] < 5000 * doc["profile"]["flexsp_micro_batches"]
    assert cost.cluster.micro_batch_overhead_ms < 5000 and cost.cluster.pipeline_op_overhead_ms < 5000
    plan = subprocess.run([sys.executable, "-m", "megatron_ext.commands.cli", "plan", "--cost-model", str(out),
                           "--dist", "lmsys", "--batch", "16", "--json", "--no-baselines"],
                          capture_output=True, text=True, timeout=120)
    assert plan.returncode == 0, plan.stderr


def test_profile_on_one_rank_times_a_one_stage_pipeline(tmp_path):
    # one GPU (a node's smoke test): no second stage, yet a one-stage pipeline's chunks pay the
    # per-operation overhead too (an H100's was written as 0, and every elastic step ran 5x its estimate)
    cluster, out = tmp_path / "one.yaml", tmp_path / "cost.yaml"
    cluster.write_text(yaml.safe_dump({"num_nodes": 1, "gpus_per_node": 1, "memory_gb": 0.5}))
    done = subprocess.run([sys.executable, "-m", "megatron_ext.commands.cli", "profile", "--out", str(out),
                           "--cluster", str(cluster), "--lengths", "64,128,256", "--repeats", "1"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    doc = yaml.safe_load(out.read_text())
    # (batch 1F1B's packs: several operations to share out what the step took beyond the model)
    assert doc["profile"]["pipeline_stages"] == 1 and doc["profile"]["pipeline_chunks"] >= 4
    assert doc["profile"]["pipeline_step_ms"] > 0 and doc["cluster"]["pipeline_op_overhead_ms"] >= 0
    assert doc["profile"]["pipeline_simulated_ms"] > 0


def test_the_output_layers_share_is_from_flops_where_the_fit_has_no_per_token_work():
    assert "a2 is 0" in profile._head_share_note(None)  # no share measured
    assert "from its FLOPs: it measured 1536%" in profile._head_share_note(15.36)  # a2 too small to share
    assert "capped" in profile._head_share_note(0.97)
    assert profile._head_share_note(0.273) == profile._head_share_note(0.95) == ""  # (0.95 is kept as measured)


def test_transfer_fit_is_a_line_or_the_largest_transfers_rate_where_noise_swamps_it():
    line = transfer_fit([0.25, 1.0, 4.0], [0.001 + 0.002 * x for x in (0.25, 1.0, 4.0)])
    assert line["latency_ms"] == pytest.approx(1.0) and line["bandwidth_gbps"] == pytest.approx(0.5)
    flat = transfer_fit([0.25, 1.0, 4.0], [0.0100, 0.0101, 0.0099])  # (a fitted slope <= 0)
    assert flat["latency_ms"] == 0 and flat["bandwidth_gbps"] == pytest.approx(4.0 / 0.0099 * 1e-3)


def test_nonnegative_fit_recovers_coefficients_and_never_goes_negative():
    x = np.array([100.0, 200, 400, 800, 1600])
    cols = np.stack([x * x, x, np.ones_like(x)], axis=1)
    for relative in (True, False):
        coef, residual = nonnegative_fit(cols, 2e-5 * x * x + 0.03 * x + 4, relative=relative)
        assert np.allclose(coef, [2e-5, 0.03, 4], rtol=1e-6) and np.allclose(residual, 0, atol=1e-9)
    coef, _ = nonnegative_fit(cols, 0.05 * x - 3)  # the best unconstrained b1 would be negative
    assert (coef >= 0).all()
    # on relative error a short point's miss counts as much as a long one's
    y = 2e-5 * x * x + 0.03 * x + 4
    y[0] *= 1.5
    rel_res = nonnegative_fit(cols, y)[1] / y
    abs_res = nonnegative_fit(cols, y, relative=False)[1] / y
    assert abs(rel_res[0]) < abs(abs_res[0])


def test_fit_profile_recovers_compute_bandwidth_and_latency():
    spec = load_model("tiny")
    lengths = [128, 512, 1024, 2048]
    kv = 4 * spec.hidden_size // 8  # (4 of 8 heads' K/V: Q, K, V, the output and their gradients)
    per_token_mb = 2 * spec.num_layers * (2 * spec.hidden_size + 2 * kv) * spec.activation_bytes / 2**20
    s = np.array(lengths, dtype=float)

    def passes(d, bw=None, lat=0.0):
        comm = s * per_token_mb / d / bw + 8 * spec.num_layers * lat if bw else 0.0
        return (5.0 + (1e-4 * s * s + 0.06 * s) / d + comm).tolist()

    raw = {2: {"bandwidth_gbps": 9.0, "latency_ms": 0.1}, 4: {"bandwidth_gbps": 9.0, "latency_ms": 0.1}}
    fit = fit_profile(spec, lengths, {1: passes(1), 2: passes(2, 2.0, 0.5), 4: passes(4, 1.0, 1.5)}, raw)
    assert (fit["a1"], fit["a2"], fit["b1"]) == pytest.approx((1e-4, 0.06, 5.0), rel=1e-6)
    assert fit["a2a"][2]["bandwidth_gbps"] == pytest.approx(2.0, rel=1e-6)
    assert fit["a2a"][2]["latency_ms"] == pytest.approx(0.5, rel=1e-6)
    assert fit["a2a"][4]["bandwidth_gbps"] == pytest.approx(1.0, rel=1e-6)
    assert fit["a2a"][4]["latency_ms"] == pytest.approx(1.5, rel=1e-6)
    assert fit["rel_error"] < 1e-9 and set(fit["residual_ms"]) == {1, 2, 4}
    # an excess that does not grow with the tokens: latency only, the raw bandwidth stays
    flat = {1: passes(1), 2: (np.array(passes(2)) + 3.0).tolist()}
    fit = fit_profile(spec, lengths, flat, raw)
    assert fit["a2a"][2]["bandwidth_gbps"] == 9.0
    assert fit["a2a"][2]["latency_ms"] == pytest.approx(3.0 / (8 * spec.num_layers), rel=1e-6)


def test_fit_profile_refuses_passes_that_do_not_grow_with_length():
    # a small model on a fast GPU: the launch constant hides the work (15.4, 11.3, 12.4 ms on an
    # H100 at 256-4,096 tokens fitted a1 = a2 = 0, and the pipeline planners divided by zero)
    spec = load_model("tiny")
    with pytest.raises(ConfigError, match=r"15.4, 11.3, 12.4 ms at 256, 1,024, 4,096 tokens: no time grows"):
        fit_profile(spec, [256, 1024, 4096], {1: [15.377, 11.287, 12.43]}, {})
    # growth in either term is enough
    assert fit_profile(spec, [256, 1024, 4096], {1: [12.0, 12.5, 14.0]}, {})["a2"] > 0


class _Launched(Exception):
    """Raised in place of starting the ranks."""


@pytest.fixture
def launches(monkeypatch):
    """The environments the launcher would start ranks with (none are started)."""
    envs = []

    def popen(cmd, env, **kw):
        envs.append(env)
        raise _Launched

    monkeypatch.setattr(subprocess, "Popen", popen)
    return envs


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("args, says", [
    (["--device", "cuda"], "--device cuda: CUDA is not available here"),
    (["--attention-backend", "flash"], "--attention-backend flash cannot run on this cpu profile"),
    (["--attention-backend", "te", "--device", "cpu"], "--attention-backend te cannot run on this cpu profile"),
])
def test_what_cannot_run_here_is_one_line_before_launching(tmp_path, capsys, launches, args, says):
    assert cli.main(["profile", "--out", str(tmp_path / "c.yaml"), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"megatron-ext: error: {says}") and err.count("\n") == 1
    assert not launches and not (tmp_path / "c.yaml").exists()


def test_cpu_ranks_are_started_without_cuda(tmp_path, launches):
    with pytest.raises(_Launched):
        cli.main(["profile", "--out", str(tmp_path / "c.yaml"), "--device", "cpu", "--dtype", "bf16"])
    assert launches[0]["CUDA_VISIBLE_DEVICES"] == ""


@pytest.mark.parametrize("command", [["profile", "--out", "c.yaml"], ["train", "--steps", "1"]])
def test_ranks_of_a_model_too_large_for_this_machine_are_refused_before_launching(tmp_path, capsys, monkeypatch,
                                                                                  launches, command):
    """4 CPU ranks of gpt-7b ran 95 s, then one was killed out of memory."""
    from megatron_ext.commands import launch

    monkeypatch.setattr(launch, "_free_memory_mb", lambda: 20 * 1024.0)
    cluster = tmp_path / "cpu-4-roomy.yaml"  # (train's cost model holds gpt-7b's states in its GPUs' memory)
    preset = yaml.safe_load((Path(profile.__file__).parents[1] / "presets/clusters/cpu-4.yaml").read_text())
    cluster.write_text(yaml.safe_dump({**preset, "memory_gb": 500}))
    monkeypatch.chdir(tmp_path)
    assert cli.main([*command, "--model", "gpt-7b", "--cluster", str(cluster)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("megatron-ext: error: 4 CPU ranks of gpt-7b need about ") and err.count("\n") == 1
    assert "GB of model states a rank), over the 20.0 GB free; use a smaller --model (e.g. tiny), or " \
           "--allow-oversubscribe to start them anyway" in err and not launches
    for argv in (["--model", "tiny"], ["--model", "gpt-7b", "--cluster", str(cluster), "--allow-oversubscribe"]):
        with pytest.raises(_Launched):
            cli.main([*command, *argv])


def _args(*argv):
    return profile.build_parser().parse_args(["--out", "c.yaml", *argv])


def test_lengths_and_out_are_checked_when_parsed(capsys):
    """A length past any pass (each rank overflowed packing it, after the launch) and an empty
    --out (taken as the current folder) are refused by the parser."""
    for argv, msg in ((["--out", "c.yaml", "--lengths", "128,99999999999999999999"], "of at most 1,048,576"),
                      (["--out", "c.yaml", "--lengths", "1024"], "three different lengths or more"),
                      (["--out", "c.yaml", "--lengths", "512,1024,1024"], "three different lengths or more"),
                      (["--out", ""], "expected a path, got ''")):
        with pytest.raises(SystemExit):
            profile.build_parser().parse_args(argv)
        assert msg in capsys.readouterr().err


def test_device_and_dtype_resolution_on_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert profile.check_args(_args(), 4) == ("cpu", "fp32")
    assert profile.check_args(_args("--dtype", "bf16"), 4) == ("cpu", "bf16")  # CPU bf16 runs in torch


def test_checks_on_a_cuda_machine(monkeypatch, tmp_path, capsys):
    """The GPU side of the checks, with CUDA and flash-attn faked: two GPUs, four ranks asked."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(kernels, "available_backends", lambda: ["flash", "sdpa"])
    assert profile.check_args(_args("--attention-backend", "flash"), 2) == ("cuda", "bf16")
    assert profile.check_args(_args("--device", "cpu"), 4) == ("cpu", "fp32")
    with pytest.raises(ConfigError, match="4 ranks need a GPU each; this machine has 2"):
        profile.check_args(_args(), 4)
    with pytest.raises(ConfigError, match="flash runs bf16 only"):
        profile.check_args(_args("--attention-backend", "flash", "--dtype", "fp32"), 2)
    with pytest.raises(ConfigError, match="te cannot run on this cuda profile.*usable here: auto, flash, sdpa"):
        profile.check_args(_args("--attention-backend", "te"), 2)
    # a rank started by hand with --device cpu that still sees CUDA is refused, not run on the GPU
    assert profile.main(["--out", str(tmp_path / "c.yaml"), "--device", "cpu"]) == 2
    assert "CUDA_VISIBLE_DEVICES=" in capsys.readouterr().err


@pytest.mark.parametrize("command, args, says", [
    ("profile", ["--out", "{tmp}/missing/c.yaml"],
     "--out {tmp}/missing/c.yaml: cannot write in {tmp}/missing: No such file or directory"),
    ("profile", ["--out", "{tmp}"], "--out {tmp}: is a folder, not a file"),
    ("profile", ["--out", "{tmp}/file"], "--out '{tmp}/file': the file name must end in .yaml or .yml"),
    ("profile", ["--out", "{tmp}/plot.PNG"], "--out '{tmp}/plot.PNG': the file name must end in .yaml or .yml"),
    ("train", ["--trace", "{tmp}/missing/t.json"], "--trace {tmp}/missing/t.json: cannot write in {tmp}/missing"),
    ("train", ["--run-dir", "{tmp}/file"], "--run-dir {tmp}/file: is a file, not a folder"),
    ("train", ["--save", "{tmp}/file/ckpt"], "--save {tmp}/file/ckpt: {tmp}/file is a file, not a folder"),
])
def test_outputs_that_cannot_be_written_are_refused_before_launching(tmp_path, capsys, launches, command, args,
                                                                      says):
    """(They were written after the run: a run whose every step trained ended in an error.)"""
    (tmp_path / "file").write_text("kept\n")
    assert cli.main([command, *(a.format(tmp=tmp_path) for a in args)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"megatron-ext: error: {says.format(tmp=tmp_path)}") and err.count("\n") == 1
    assert not launches and (tmp_path / "file").read_text() == "kept\n"


@pytest.mark.parametrize("args, says", [
    (["--lengths", "128,x"], "expected comma-separated positive lengths of at most 1,048,576, e.g. 128,512,2048, "
                            "got '128,x'"),
    (["--lengths", "0,-5"], "expected comma-separated positive lengths"),
    (["--repeats", "0"], "expected a positive integer, got '0'"),
])
def test_bad_sweep_options_are_usage_errors(tmp_path, capsys, launches, args, says):
    with pytest.raises(SystemExit) as e:
        cli.main(["profile", "--out", str(tmp_path / "c.yaml"), *args])
    assert e.value.code == 2 and says in capsys.readouterr().err and not launches
