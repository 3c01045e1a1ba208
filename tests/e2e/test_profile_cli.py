"""`megatron-ext profile` on 4 CPU ranks writes a cost model that `plan` accepts (one launch)."""
import subprocess
import sys

import yaml

from megatron_ext.cost import CostModel
from megatron_ext.runtime.profile import nonnegative_fit

import numpy as np


def test_profile_writes_a_usable_cost_model(tmp_path):
    out = tmp_path / "cost.yaml"
    done = subprocess.run([sys.executable, "-m", "megatron_ext.cli", "profile", "--out", str(out),
                           "--lengths", "64,128,256", "--repeats", "1"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    cost = CostModel.from_yaml(out)
    assert cost.num_gpus == 4
    assert cost.model.a1 >= 0 and cost.model.a2 >= 0 and cost.model.b1 >= 0
    assert cost.model.a1 + cost.model.a2 > 0
    assert 0 < cost.model.act_mb_per_token < 1
    assert all(v > 0 for v in cost.cluster.a2a_bandwidth_gbps.values()) and set(cost.cluster.a2a_bandwidth_gbps) == {2, 4}
    doc = yaml.safe_load(out.read_text())
    assert len(doc["profile"]["fwd_bwd_ms"]) == 3 and len(doc["profile"]["fit_residual_ms"]) == 3
    plan = subprocess.run([sys.executable, "-m", "megatron_ext.cli", "plan", "--cost-model", str(out),
                           "--dist", "lmsys", "--batch", "16", "--json", "--no-baselines"],
                          capture_output=True, text=True, timeout=120)
    assert plan.returncode == 0, plan.stderr


def test_nonnegative_fit_recovers_coefficients_and_never_goes_negative():
    x = np.array([100.0, 200, 400, 800, 1600])
    coef, residual = nonnegative_fit(x, 2e-5 * x * x + 0.03 * x + 4)
    assert np.allclose(coef, [2e-5, 0.03, 4], rtol=1e-6) and np.allclose(residual, 0, atol=1e-9)
    coef, _ = nonnegative_fit(x, 0.05 * x - 3)  # the best unconstrained b1 would be negative
    assert (coef >= 0).all()
