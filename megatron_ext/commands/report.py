"""`megatron-ext report RUN`: how well the cost model predicted a training run.

``megatron-ext train --run-dir DIR`` writes one JSON record per step to ``DIR/steps.jsonl`` with
the measured and predicted time of the step and of each micro-batch (pipelines: of each stage's
operations, and each stage's activation memory). Megatron-LM's ``pretrain_gpt.py --flexsp`` or
``--elastic-pp`` with ``--planner-log FILE`` writes records of the same schema
(``runtime/records.py``), with the step and micro-batch times. The report prints the distribution
of the relative error, its bias, and whether it drifts over the run; for pipelines, how much
longer the operations ran than predicted and the activation peaks against the planner's; and it
says when the cost model should be re-measured (``megatron-ext profile``).
"""
from __future__ import annotations

import json
import shlex
import sys
from collections import Counter
from pathlib import Path

import numpy as np

from megatron_ext.commands.args import path_arg
from megatron_ext.errors import ConfigError
from megatron_ext.files import TooBigError
from megatron_ext.spec import is_int, is_number
from megatron_ext.text import plural

DRIFT_THRESHOLD = 0.15  # median absolute error above which the model is called off
DRIFT_MIN_STEPS = 9  # steps (after the first) for the drift: three a third


def add_report_command(sub) -> None:
    rp = sub.add_parser("report", help="how well the cost model predicted a run: a `train --run-dir` directory, or "
                                        "Megatron-LM's --planner-log file")
    rp.add_argument("run_dir", type=path_arg, metavar="RUN", help="a `train --run-dir` directory (or its steps.jsonl), or the JSONL "
                                                   "file of pretrain_gpt.py --planner-log")
    rp.add_argument("--json", action="store_true", help="the figures (errors, drift, pipeline stages) as JSON")
    rp.set_defaults(func=cmd_report)


def cmd_report(args) -> int:
    records = load_run(args.run_dir)
    print(json.dumps(fidelity(records), indent=1) if args.json else report_table(records))
    return 0


RECORD_LINE_LIMIT = 2**28  # bytes: a step with its plan of a million sequences is under a tenth of it


def _record_lines(path: Path) -> list[str]:
    """The lines of a records file, each read up to ``RECORD_LINE_LIMIT`` (a log of a long run may be
    gigabytes; a device such as /dev/zero, or the wrong file, would be one endless line)."""
    lines = []
    with open(path, encoding="utf-8") as f:
        while line := f.readline(RECORD_LINE_LIMIT + 1):
            if len(line) > RECORD_LINE_LIMIT:
                raise TooBigError(f"line {len(lines) + 1} is over {RECORD_LINE_LIMIT:,} characters")
            lines.append(line)
    return lines


def load_run(run: str | Path) -> list[dict]:
    """The step records of a ``train --run-dir`` directory, or of a JSONL file: its
    ``steps.jsonl`` or a Megatron-LM ``--planner-log``."""
    path = Path(run)
    if path.is_dir():
        runs = [] if (path / "steps.jsonl").exists() else sorted(p.parent for p in path.glob("*/steps.jsonl"))
        if runs:  # (train --compare: a folder a planner)
            raise ConfigError(f"{path} holds the runs of `train --compare`: report one of them, "
                              + ", ".join(map(str, runs)))
        path = path / "steps.jsonl"
    try:
        lines = _record_lines(path)
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not text (step records are JSON lines)") from None
    except TooBigError as e:
        raise ConfigError(f"{path}: {e}: not step records") from None
    except OSError:
        raise ConfigError(f"no run records at {path} (write them with `megatron-ext train --run-dir DIR`, or "
                          f"Megatron-LM's pretrain_gpt.py --planner-log FILE)") from None
    records = []
    for n, line in enumerate(lines, 1):
        try:
            if line.strip():
                records.append(json.loads(line))
        except json.JSONDecodeError as e:
            if n == len(lines) and not line.endswith("\n"):  # (a run killed while writing it)
                print(f"note: {path}: its last line is cut off (a run stopped while writing it): left out",
                      file=sys.stderr)
                continue
            raise ConfigError(f"{path}: line {n} is not a JSON record ({e.msg}, column {e.colno})") from None
        except ValueError:  # (what else json's int() refuses: over 4,300 digits)
            raise ConfigError(f"{path}: line {n} holds a number of over 4,300 digits") from None
    if not records:
        raise ConfigError(f"{path} holds no steps")
    if not all(isinstance(r, dict) and "step_time_s" in r and "predicted_step_time_s" in r for r in records):
        raise ConfigError(f"{path}: not step records of `megatron-ext train` or Megatron-LM's --planner-log")
    for i, r in enumerate(records, 1):
        why = _bad_record(r)
        if why:
            raise ConfigError(f"{path}: record {i}" + (f" (step {r['step']})" if "step" in r else "") + f": {why}")
    return records


MAX_SECONDS = 1e7  # a step or operation time past this (four months) is not a measurement


def _seconds(x, least: float = 1e-9) -> bool:
    # (a denormal time made the errors inf; one of 1e308 against 1e-9, inf and NaN in --json)
    return is_number(x) and least <= x <= MAX_SECONDS


def _counts(x) -> bool:
    return is_int(x) and x >= 1


def _numbers(x) -> bool:
    return isinstance(x, list) and all(is_number(v) for v in x)


def _bad_record(r: dict) -> str | None:
    """Why a step record cannot be reported on (its times, the layout it names, its pipeline
    stages' measurements), or None."""
    for key in ("step_time_s", "predicted_step_time_s"):
        if not _seconds(r[key]):
            return f"{key} must be a number of seconds from 1e-9 to {MAX_SECONDS:g}, got {r[key]!r}"
    if "step" in r and not (is_int(r["step"]) and r["step"] >= 0):
        return f"step must be a step number, got {r['step']!r}"
    mbs = [r.get(k, []) for k in ("micro_batch_times_s", "predicted_micro_batch_times_s")]
    if not all(isinstance(x, list) and all(_seconds(t) for t in x) for x in mbs):
        return (f"micro_batch_times_s and predicted_micro_batch_times_s must be lists of seconds from 1e-9 to "
                f"{MAX_SECONDS:g}")
    if mbs[0] and mbs[1] and len(mbs[0]) != len(mbs[1]):  # (a pipelined step measures none)
        return f"{len(mbs[0])} measured micro-batch times against {len(mbs[1])} predicted"
    for key in ("planner", "kind"):
        if not isinstance(r.get(key, ""), str):
            return f"{key} must be a name, got {r[key]!r}"
    if r.get("kind") != "elastic_pp" and "ops_per_stage" not in r:
        return None
    # a pipeline step: its layout, and each stage's operations [name, measured s, predicted s or null]
    if not (isinstance(r.get("degrees"), list) and r["degrees"] and all(_counts(d) for d in r["degrees"])):
        return f"a pipeline step's degrees must be a list of SP degrees, got {r.get('degrees')!r}"
    for key in ("stages", "replicas"):
        if key in r and not _counts(r[key]):
            return f"{key} must be a positive integer, got {r[key]!r}"
    ops = r.get("ops_per_stage")
    if ops is None:
        return None if "stages" in r else "a pipeline step names no stages (neither stages nor ops_per_stage)"
    if not (isinstance(ops, list) and ops and all(isinstance(st, list) for st in ops) and
            all(isinstance(op, list) and len(op) == 3 and _seconds(op[1], 0) and (op[2] is None or _seconds(op[2], 0))
                for st in ops for op in st)):
        return ("ops_per_stage must list each stage's operations as [name, measured s, predicted s or null], "
                f"seconds from 0 to {MAX_SECONDS:g}")
    if "step" not in r:  # (its stages' peaks over the room are named by step)
        return "a pipeline step's record needs its step number (step)"
    stages, rows = r.get("stages", len(ops)), len(ops)
    if rows % stages or rows != stages * r.get("replicas", rows // stages):  # a row per replica's stage
        return (f"ops_per_stage has {rows} rows, not one per stage of each replica ({plural(stages, 'stage')} x "
                f"{plural(r.get('replicas', rows // stages), 'replica')})")
    if not all(_numbers(r.get(k)) and len(r[k]) == len(ops)
               for k in ("activation_peak_mb_per_stage", "planned_activation_mb_per_stage")) \
            or not is_number(r.get("activation_room_mb")):
        return ("ops_per_stage needs activation_peak_mb_per_stage and planned_activation_mb_per_stage (a number a "
                "stage) and activation_room_mb")
    return None


def _errors(measured, predicted) -> np.ndarray:
    m, p = np.asarray(measured, dtype=float), np.asarray(predicted, dtype=float)
    return (p - m) / m


def fidelity(records: list[dict]) -> dict:
    """Relative errors (predicted - measured) / measured per step and per micro-batch, skipping
    the first step (start-up costs), with their median, p90, bias and drift."""
    body = records[1:] or records
    step_err = _errors([r["step_time_s"] for r in body], [r["predicted_step_time_s"] for r in body])
    timed = [r for r in body if len(r.get("micro_batch_times_s", [])) == len(r.get("predicted_micro_batch_times_s", []))]
    mb_err = _errors([t for r in timed for t in r.get("micro_batch_times_s", [])],
                     [t for r in timed for t in r.get("predicted_micro_batch_times_s", [])])
    # drift from thirds of DRIFT_MIN_STEPS / 3 steps or more (a third of one step is one step's noise)
    thirds = np.array_split(np.abs(step_err), 3) if len(step_err) >= DRIFT_MIN_STEPS else None
    out = {
        "steps": len(body),
        "step_median_abs_error": float(np.median(np.abs(step_err))),
        "step_p90_abs_error": float(np.percentile(np.abs(step_err), 90)),
        "step_bias": float(np.median(step_err)),  # < 0: the model predicts too little time
        "micro_batch_median_abs_error": float(np.median(np.abs(mb_err))) if mb_err.size else None,
        "micro_batch_p90_abs_error": float(np.percentile(np.abs(mb_err), 90)) if mb_err.size else None,
        "drift": None if thirds is None else float(np.median(thirds[-1]) - np.median(thirds[0])),
    }
    # a file two runs wrote (steps 0, 1, 0, 1), or runs of several planners: reported as one
    steps = [r["step"] for r in records if "step" in r]
    out["runs"] = 1 + sum(later <= earlier for earlier, later in zip(steps, steps[1:]))
    out["planners"] = list(dict.fromkeys(r["planner"] for r in records if "planner" in r and not
                                         str(r.get("plan_source", "")).endswith("fallback")))
    out["recalibrate"] = (out["step_median_abs_error"] > DRIFT_THRESHOLD
                          or (out["drift"] is not None and out["drift"] > DRIFT_THRESHOLD / 2))
    out["layouts"] = layout_counts(body)
    stages = [r for r in body if "ops_per_stage" in r]  # a run of auto may hold pipelines of several layouts
    out["pipelines"] = [_stage_fidelity(name, [r for r in stages if step_layout(r) == name])
                        for name in dict.fromkeys(step_layout(r) for r in stages)]
    return out


def step_layout(r: dict) -> str:
    """What ran a step: the planner of its SP groups (``flexsp`` for auto; ``batchada`` for a
    fallback plan), or an elastic pipeline's ``pp{P} x sp{D}``, `` x dp{R}`` with R replicas side
    by side (``train``'s record then has a row per replica's stage in ``ops_per_stage``)."""
    if r.get("kind") != "elastic_pp" and "ops_per_stage" not in r:
        return "flexsp" if r.get("planner", "auto") == "auto" else r["planner"]
    rows = len(r.get("ops_per_stage", ()))
    stages = r.get("stages", rows)
    replicas = r.get("replicas", rows // stages)
    return f"pp{stages} x sp{r['degrees'][0]}" + (f" x dp{replicas}" if replicas > 1 else "")


def layout_counts(records: list[dict]) -> dict[str, int]:
    """How many of ``records`` each layout (``step_layout``) ran, the most common first."""
    return dict(Counter(step_layout(r) for r in records).most_common())


def layouts_text(counts: dict[str, int]) -> str:
    """``layout_counts`` as "2 flexsp, 1 pp1 x sp2 x dp2"."""
    return ", ".join(f"{n} {k}" for k, n in counts.items())


def _stage_fidelity(layout: str, stages: list[dict]) -> dict:
    """Per stage of one pipeline layout: measured / predicted operation time, the activation
    peaks against the planned ones and the room, and the (step, stage) pairs over it."""
    P = len(stages[0]["ops_per_stage"])
    measured = [sum(m for r in stages for _, m, q in r["ops_per_stage"][p] if q is not None) for p in range(P)]
    predicted = [sum(q for r in stages for _, _, q in r["ops_per_stage"][p] if q is not None) for p in range(P)]
    return {
        "layout": layout, "steps": len(stages), "stages": stages[0].get("stages", P),  # below P: replicas' stages
        # (None where nothing was predicted: a denormal prediction made the ratio inf, which --json wrote)
        "stage_op_time_ratio": [m / q if q >= 1e-9 else None for m, q in zip(measured, predicted)],
        "activation_peak_mb_per_stage": np.max([r["activation_peak_mb_per_stage"] for r in stages], axis=0).tolist(),
        "planned_activation_mb_per_stage": np.max([r["planned_activation_mb_per_stage"] for r in stages],
                                                  axis=0).tolist(),
        "activation_room_mb": stages[0]["activation_room_mb"],
        "steps_over_memory_budget": [(r["step"], p) for r in stages for p, x in enumerate(r["activation_peak_mb_per_stage"])
                                     if x > r["activation_room_mb"]],
    }


def report_table(records: list[dict]) -> str:
    f = fidelity(records)
    ran = "; ran " + layouts_text(f["layouts"]) if len(f["layouts"]) > 1 else ""
    bias = f["step_bias"]
    lines = [f"{', '.join(f['planners']) or records[0].get('planner') or 'run'}: {plural(f['steps'], 'step')}"
             f"{' (the first is left out)' if len(records) > 1 else ''}{ran}"]
    mixed = [plural(f["runs"], "run")] * (f["runs"] > 1) + [f"{len(f['planners'])} planners"] * (len(f["planners"]) > 1)
    if mixed:  # (the header named the first record's planner alone)
        lines.append(f"note: these records are of {' and '.join(mixed)}, reported as one run"
                     + (" (the step numbers start over where a run was added)" if f["runs"] > 1 else ""))
    lines += [f"step time error:        median {f['step_median_abs_error']:.1%}, p90 {f['step_p90_abs_error']:.1%}, "
             f"bias {bias:+.1%}" + (f" ({'over' if bias > 0 else 'under'}-predicts)" if bias else "")]
    if f["micro_batch_median_abs_error"] is not None:
        lines.append(f"micro-batch time error: median {f['micro_batch_median_abs_error']:.1%}, "
                     f"p90 {f['micro_batch_p90_abs_error']:.1%}")
    lines.append(f"drift (last third - first third of the run): {f['drift']:+.1%}" if f["drift"] is not None else
                 f"drift: not measured (under {DRIFT_MIN_STEPS} steps after the first)")
    for pipe in f["pipelines"]:
        S = pipe["stages"]
        replicas = S != len(pipe["stage_op_time_ratio"])  # then each row is one replica's stage
        head = f"{pipe['layout']} ({plural(pipe['steps'], 'step')}): " \
            if len(f["layouts"]) > 1 else ""

        def row(p):
            return f"replica {p // S} stage {p % S}" if replicas else f"stage {p}"

        lines.append(head + "stage operations, measured / predicted time: "
                     + ", ".join(f"{row(p)} {x:.2f}x" for p, x in enumerate(pipe["stage_op_time_ratio"]) if x is not None))
        lines.append(head + "activation peak per stage, MB (measured / planned; room "
                     f"{pipe['activation_room_mb']:.1f}): "
                     + ", ".join((f"{row(p)} " if replicas else "") + f"{m:.1f} / {q:.1f}"
                                 for p, (m, q) in enumerate(zip(pipe["activation_peak_mb_per_stage"],
                                                                pipe["planned_activation_mb_per_stage"])))
                     + ("; within the budget at every step" if not pipe["steps_over_memory_budget"] else
                        f"; OVER the budget at (step, stage) {pipe['steps_over_memory_budget']}"))
    lines += advice(records, f)
    return "\n".join(lines)


def advice(records: list[dict], f: dict) -> list[str]:
    """What to do about the cost model after a run (``f``: its ``fidelity``): nothing, re-profile
    it, or, for pipelines whose operations took their predicted time, the waits between stages."""
    lines: list[str] = []
    ratios = [x for pipe in f["pipelines"] for x in pipe["stage_op_time_ratio"] if x is not None]
    if ratios and min(ratios) > 1 + DRIFT_THRESHOLD / 2:
        lines.append(f"every stage's operations ran {min(ratios):.2f}x or more their predicted time: profile this "
                     "model (`megatron-ext profile --model ...`), whose pipeline step measures the overhead per "
                     "operation (docs/cost_model.md)")
    ops_fit = bool(ratios) and max(abs(x - 1) for x in ratios) <= DRIFT_THRESHOLD
    if ops_fit and f["recalibrate"]:
        lines.append("the stages' operations took about the predicted time, so the profile holds: the error is time "
                     "stages spent waiting for each other beyond the simulated bubble (on ranks sharing cores, "
                     "processes waiting to be scheduled); a `profile` of this model with as many stages measures "
                     "it as pipeline_op_overhead_ms")
    elif f["recalibrate"]:
        model = records[0].get("model")  # (quoted: a record's text goes into a command to paste)
        if isinstance(model, str) and model:
            lines.append("the cost model is off for this machine: re-measure it with `megatron-ext profile --model "
                         f"{shlex.quote(model)} --out my-cost.yaml` and pass --cost-model my-cost.yaml")
        else:  # (a --cost-model run, or Megatron-LM's: the records do not name it)
            lines.append("the cost model is off for this machine: re-measure it with `megatron-ext profile --out "
                         "my-cost.yaml`, adding the --model the run trained, and pass --cost-model my-cost.yaml")
    else:
        lines.append("the cost model fits this run")
    return lines
