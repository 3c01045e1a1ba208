"""Device choice and train's ZeRO stage (runtime/device.py, runtime/train.py): what runs where,
refused in one line before any rank starts."""
from __future__ import annotations

import argparse

import pytest
import torch

from megatron_ext.errors import ConfigError
from megatron_ext.runtime.device import choose_device, rank_device
from megatron_ext.runtime.train import TRAIN_ZERO_STAGE, train_cost_model


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU machines only")
def test_device_choice_without_cuda():
    assert choose_device("auto", 4) == "cpu" and choose_device("cpu", 64) == "cpu"
    assert rank_device() == torch.device("cpu")
    with pytest.raises(ConfigError, match="--device cuda: CUDA is not available"):
        choose_device("cuda", 1)


def _args(**kw):
    return argparse.Namespace(**{"cost_model": None, "model": None, "cluster": None, "max_ring": 1,
                                 "planner": "flexsp", **kw})


def test_train_plans_with_its_max_ring():
    assert train_cost_model(_args()).max_ring == 1
    cost = train_cost_model(_args(max_ring=2))
    assert cost.max_ring == 2
    for bad in (0, 3, -2):
        with pytest.raises(ConfigError, match=f"--max-ring must be a power of two \\(1: no ring\\), got {bad}"):
            train_cost_model(_args(max_ring=bad))


def test_a_models_recompute_is_left_to_the_pipelines(tmp_path):
    from megatron_ext.spec import PRESET_DIR

    f = tmp_path / "tiny-recompute.yaml"
    f.write_text((PRESET_DIR / "models" / "tiny.yaml").read_text() + "recompute: full\nrecompute_layers: 1\n")
    assert train_cost_model(_args(model=str(f))).model.recomputed_layers == 1  # FlexSP runs it (model_recompute)
    for planner in ("elastic_pp", "auto"):  # pipelines choose each chunk's
        assert train_cost_model(_args(model=str(f), planner=planner)).model.recomputed_layers == 0


def test_train_plans_at_the_stage_it_runs(tmp_path):
    preset = train_cost_model(_args())
    assert preset.zero_stage == TRAIN_ZERO_STAGE == 0
    # every model state on every rank: fewer tokens fit than the ZeRO-3 preset default claims
    from megatron_ext.cost import CostModel
    assert preset.token_capacity(1) < CostModel.from_presets("tiny", "cpu-4").token_capacity(1)
    unstated = tmp_path / "cost.yaml"
    unstated.write_text("model: tiny\ncluster: cpu-4\n")
    assert train_cost_model(_args(cost_model=str(unstated))).zero_stage == 0
    stated = tmp_path / "zero3.yaml"
    stated.write_text("model: tiny\ncluster: cpu-4\nzero_stage: 3\n")
    with pytest.raises(ConfigError, match="says zero_stage: 3, but train keeps every model state on every rank"):
        train_cost_model(_args(cost_model=str(stated)))
    half = tmp_path / "bf16.yaml"  # what `profile` writes on CUDA by default
    half.write_text("model: tiny\ncluster: cpu-4\ndtype: bf16\n")
    with pytest.raises(ConfigError, match="measured in bf16, but train runs fp32: .*profile --dtype fp32"):
        train_cost_model(_args(cost_model=str(half)))
    (tmp_path / "fp32.yaml").write_text("model: tiny\ncluster: cpu-4\ndtype: fp32\n")
    assert train_cost_model(_args(cost_model=str(tmp_path / "fp32.yaml"))).zero_stage == 0
    # (--model and --cluster were dropped without a word)
    for given, says in (({"model": "gpt-7b"}, "--model with"), ({"model": "tiny", "cluster": "cpu-4"}, "--model and "
                                                                                                     "--cluster with")):
        with pytest.raises(ConfigError, match=f"^{says} --cost-model: the cost model holds its model and cluster; "
                                              f"give one or the other$"):
            train_cost_model(_args(cost_model=str(unstated), **given))


def test_micro_batch_nvtx_ranges_open_and_close_in_turn():
    from megatron_ext.runtime.schedule import StepTimes
    from megatron_ext.runtime.timing import DeviceClock

    log = []

    class RecordingClock(DeviceClock):  # CPU marks, NVTX calls recorded as a GPU would make them
        def range_start(self, name):
            log.append(("start", name))
            return name

        @staticmethod
        def range_end(handle):
            if handle is not None:
                log.append(("end", handle))

    times = StepTimes(RecordingClock())
    times.start_micro_batch("SP group d2 ranks 0..1: seqs 3")
    times.start_micro_batch()
    times.finish()
    first, second = "micro-batch 0: SP group d2 ranks 0..1: seqs 3", "micro-batch 1: idle"
    assert log == [("start", first), ("end", first), ("start", second), ("end", second)]
    assert len(times.micro_batches) == 2 and all(t >= 0 for t in times.micro_batches)
    assert DeviceClock("cpu").range_start("x") is None  # no NVTX on CPU
