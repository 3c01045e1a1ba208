"""`megatron-ext report RUN_DIR`: how well the cost model predicted a training run.

``megatron-ext train --run-dir DIR`` writes one JSON record per step to ``DIR/steps.jsonl`` with
the measured and predicted time of the step and of each micro-batch. The report prints the
distribution of the relative error, its bias, and whether it drifts over the run, and says when
the cost model should be re-measured (``megatron-ext profile``).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from megatron_ext.errors import ConfigError

DRIFT_THRESHOLD = 0.15  # median absolute error above which the model is called off


def load_run(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "steps.jsonl"
    try:
        lines = path.read_text().splitlines()
    except OSError:
        raise ConfigError(f"no run records at {path} (write them with `megatron-ext train --run-dir {run_dir}`)") from None
    try:
        records = [json.loads(line) for line in lines if line.strip()]
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: malformed record ({e})") from None
    if not records:
        raise ConfigError(f"{path} holds no steps")
    return records


def _errors(measured, predicted) -> np.ndarray:
    m, p = np.asarray(measured, dtype=float), np.asarray(predicted, dtype=float)
    keep = m > 0
    return (p[keep] - m[keep]) / m[keep]


def fidelity(records: list[dict]) -> dict:
    """Relative errors (predicted - measured) / measured per step and per micro-batch, skipping
    the first step (start-up costs), with their median, p90, bias and drift."""
    body = records[1:] or records
    step_err = _errors([r["step_time_s"] for r in body], [r["predicted_step_time_s"] for r in body])
    mb_err = _errors([t for r in body for t in r.get("micro_batch_times_s", [])],
                     [t for r in body for t in r.get("predicted_micro_batch_times_s", [])])
    thirds = np.array_split(np.abs(step_err), 3) if len(step_err) >= 3 else [np.abs(step_err)] * 3
    out = {
        "steps": len(body),
        "step_median_abs_error": float(np.median(np.abs(step_err))),
        "step_p90_abs_error": float(np.percentile(np.abs(step_err), 90)),
        "step_bias": float(np.median(step_err)),  # < 0: the model predicts too little time
        "micro_batch_median_abs_error": float(np.median(np.abs(mb_err))) if mb_err.size else None,
        "micro_batch_p90_abs_error": float(np.percentile(np.abs(mb_err), 90)) if mb_err.size else None,
        "drift": float(np.median(thirds[-1]) - np.median(thirds[0])),
    }
    out["recalibrate"] = out["step_median_abs_error"] > DRIFT_THRESHOLD or out["drift"] > DRIFT_THRESHOLD / 2
    return out


def report_table(records: list[dict]) -> str:
    f = fidelity(records)
    lines = [f"{records[0].get('planner', '?')}: {f['steps']} steps (the first is left out)",
             f"step time error:        median {f['step_median_abs_error']:.1%}, p90 {f['step_p90_abs_error']:.1%}, "
             f"bias {f['step_bias']:+.1%} ({'over' if f['step_bias'] > 0 else 'under'}-predicts)"]
    if f["micro_batch_median_abs_error"] is not None:
        lines.append(f"micro-batch time error: median {f['micro_batch_median_abs_error']:.1%}, "
                     f"p90 {f['micro_batch_p90_abs_error']:.1%}")
    lines.append(f"drift (last third - first third of the run): {f['drift']:+.1%}")
    if f["recalibrate"]:
        lines.append("the cost model is off for this machine: re-measure it with "
                     "`megatron-ext profile --out my-cost.yaml` and pass --cost-model my-cost.yaml")
    else:
        lines.append("the cost model fits this run")
    return "\n".join(lines)
