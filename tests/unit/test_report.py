import json

import pytest

from megatron_ext.commands.cli import main
from megatron_ext.errors import ConfigError
from megatron_ext.commands.report import fidelity, load_run


def _write(tmp_path, records):
    (tmp_path / "steps.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return tmp_path


def _rec(step, measured, predicted, mb=()):
    return {"step": step, "planner": "flexsp", "step_time_s": measured, "predicted_step_time_s": predicted,
            "micro_batch_times_s": [m for m, _ in mb], "predicted_micro_batch_times_s": [p for _, p in mb]}


def test_fidelity_by_hand(tmp_path):
    # The first step is left out; errors (p - m) / m of the rest: +10%, -20%, +10%.
    recs = [_rec(0, 9.0, 1.0), _rec(1, 1.0, 1.1, [(0.5, 0.5), (0.5, 0.6)]), _rec(2, 1.0, 0.8), _rec(3, 2.0, 2.2)]
    f = fidelity(load_run(_write(tmp_path, recs)))
    assert f["steps"] == 3
    assert f["step_median_abs_error"] == pytest.approx(0.1)
    assert f["step_bias"] == pytest.approx(0.1)
    assert f["micro_batch_median_abs_error"] == pytest.approx(0.1)
    assert not f["recalibrate"]


def test_drift_needs_three_steps_a_third(tmp_path, capsys):
    # 3 steps after the first, the last 17% off and the others 8%: each third is one step's noise
    short = [_rec(0, 9.0, 1.0), _rec(1, 1.0, 1.08), _rec(2, 1.0, 1.08), _rec(3, 1.0, 1.17)]
    f = fidelity(short)
    assert f["drift"] is None and not f["recalibrate"]
    assert main(["report", str(_write(tmp_path, short))]) == 0
    assert "drift: not measured (under 9 steps after the first)" in capsys.readouterr().out
    # 9 steps: a real drift, 8% to 17%, is said
    long = [_rec(0, 9.0, 1.0)] + [_rec(k, 1.0, 1.08) for k in range(1, 7)] + [_rec(k, 1.0, 1.17) for k in range(7, 10)]
    f = fidelity(long)
    assert f["drift"] == pytest.approx(0.09) and f["recalibrate"]


def test_recalibration_is_suggested_when_the_model_is_off(tmp_path, capsys):
    recs = [{**_rec(k, 1.0, 0.5), "model": "tiny4"} for k in range(5)]
    assert fidelity(recs)["recalibrate"]
    assert main(["report", str(_write(tmp_path, recs))]) == 0
    assert "megatron-ext profile --model tiny4 --out" in capsys.readouterr().out


def test_advice_for_records_that_do_not_name_the_model(tmp_path, capsys):
    """(It printed a placeholder to paste: --model <this run's model>.)"""
    assert main(["report", str(_write(tmp_path, [_rec(k, 1.0, 0.5) for k in range(3)]))]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        "the cost model is off for this machine: re-measure it with `megatron-ext profile --out my-cost.yaml`, "
        "adding the --model the run trained, and pass --cost-model my-cost.yaml")


def test_a_file_of_several_runs_or_planners_says_so(tmp_path, capsys):
    """(The header named the first record's planner alone; two runs read as one.)"""
    twice = [_rec(0, 1.0, 1.0), _rec(1, 1.0, 1.0), _rec(0, 1.0, 1.0), _rec(1, 1.0, 1.0)]
    f = fidelity(twice)
    assert f["runs"] == 2 and f["planners"] == ["flexsp"]
    assert main(["report", str(_write(tmp_path, twice))]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1] == ("note: these records are of 2 runs, reported as one run (the step numbers start over where a "
                      "run was added)")
    both = [_rec(0, 1.0, 1.0), {**_rec(1, 1.0, 1.0), "planner": "static_ulysses"}, _rec(2, 1.0, 1.0)]
    assert main(["report", str(_write(tmp_path, both))]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("flexsp, static_ulysses: 2 steps") and out[1] == ("note: these records are of 2 "
                                                                               "planners, reported as one run")
    # a fallback plan's planner (batchada) is the same run's
    late = [_rec(0, 1.0, 1.0), {**_rec(1, 1.0, 1.0), "planner": "batchada", "plan_source": "fallback"}]
    assert fidelity(late)["planners"] == ["flexsp"] and fidelity(late)["runs"] == 1
    assert main(["report", str(_write(tmp_path, late))]) == 0
    assert "note:" not in capsys.readouterr().out


def test_train_ends_with_the_same_advice_when_the_model_is_off():
    """`train`'s last line gives report's error; when the model is off, report's advice follows."""
    from megatron_ext.commands.train import _summary

    off = [{**_rec(k, 1.0, 0.5), "model": "tiny", "tokens": 100, "plan_source": "planner"} for k in range(4)]
    text = _summary("flexsp", off)
    assert text.startswith("flexsp: 4 steps, median step 1.00 s, 100 tokens/s (after the first step); "
                           "cost-model error 50% (median)\n")
    assert text.splitlines()[1] == ("  the cost model is off for this machine: re-measure it with `megatron-ext "
                                    "profile --model tiny --out my-cost.yaml` and pass --cost-model my-cost.yaml")
    fits = [{**r, "predicted_step_time_s": 0.95} for r in off]
    assert _summary("flexsp", fits).endswith("cost-model error 5% (median)")


def test_a_cut_off_last_line_and_a_compare_folder(tmp_path, capsys):
    # a run killed while writing its last record: the others are reported, with a note
    recs = [_rec(k, 1.0, 1.1) for k in range(3)]
    (tmp_path / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"step": 3, "step_ti')
    assert len(load_run(tmp_path)) == 3
    assert "its last line is cut off" in capsys.readouterr().err
    # ... but a bad line that ends is still one
    (tmp_path / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"step": 3, "step_ti\n')
    with pytest.raises(ConfigError, match="line 4 is not a JSON record"):
        load_run(tmp_path)
    # train --compare's folder: a folder a planner
    for planner in ("flexsp", "static_ulysses"):
        (tmp_path / "cmp" / planner).mkdir(parents=True)
        _write(tmp_path / "cmp" / planner, recs)
    with pytest.raises(ConfigError, match="holds the runs of `train --compare`: report one of them, .*cmp/flexsp, "):
        load_run(tmp_path / "cmp")


def test_missing_or_malformed_run(tmp_path, capsys):
    with pytest.raises(ConfigError, match="no run records"):
        load_run(tmp_path)
    (tmp_path / "other.jsonl").write_text('{"loss": 1.0}\n')
    with pytest.raises(ConfigError, match="not step records"):
        load_run(tmp_path / "other.jsonl")
    (tmp_path / "steps.jsonl").write_text(json.dumps(_rec(0, 1.0, 1.0)) + "\n{not json\n")
    assert main(["report", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith(f"megatron-ext: error: {tmp_path / 'steps.jsonl'}: line 2 is not a "
                                              f"JSON record (Expecting property name enclosed in double quotes, "
                                              f"column 2)")


@pytest.mark.parametrize("record, match", [
    (_rec(3, 0, 1.0), "record 2 \\(step 3\\): step_time_s must be a number of seconds from 1e-9 to 1e\\+07, got 0"),
    (_rec(3, None, 1.0), "step_time_s must be a number of seconds from 1e-9 to 1e\\+07, got None"),
    (_rec(3, 1.0, "x"), "predicted_step_time_s must be a number of seconds from 1e-9 to 1e\\+07, got 'x'"),
    (_rec(3, True, 1.0), "step_time_s must be a number of seconds"),
    (_rec(3, 1e308, 1.0), "step_time_s must be a number of seconds from 1e-9 to 1e\\+07, got 1e\\+308"),  # (inf, NaN)
    (_rec(-1, 1.0, 1.0), "step must be a step number, got -1"),
    ({**_rec(3, 1.0, 1.0), "micro_batch_times_s": [0.5, 0.5], "predicted_micro_batch_times_s": [1.0]},
     "2 measured micro-batch times against 1 predicted"),
    ({**_rec(3, 1.0, 1.0), "micro_batch_times_s": [0.5, -1]}, "lists of seconds from 1e-9"),
    (_rec(3, 1e-320, 1.0), "step_time_s must be a number of seconds from 1e-9 to 1e\\+07, got 1e-320"),  # (inf)
    ({**_rec(3, 1.0, 1.0), "planner": [1]}, "planner must be a name, got \\[1\\]"),
    ({**_rec(3, 1.0, 1.0), "kind": "elastic_pp"}, "a pipeline step's degrees must be a list of SP degrees"),
    ({**_rec(3, 1.0, 1.0), "kind": "elastic_pp", "degrees": [2]}, "a pipeline step names no stages"),
    ({**_rec(3, 1.0, 1.0), "kind": "elastic_pp", "degrees": [2], "stages": 0}, "stages must be a positive integer"),
    ({**_rec(3, 1.0, 1.0), "degrees": [2], "ops_per_stage": 5}, "ops_per_stage must list each stage's operations"),
    ({**_rec(3, 1.0, 1.0), "degrees": [2], "ops_per_stage": [[[1, 2]]]}, "ops_per_stage must list each stage's"),
    ({**_rec(3, 1.0, 1.0), "degrees": [2], "ops_per_stage": [[["F0", 0.1, 1e300]]]}, "seconds from 0 to 1e\\+07"),
    ({**_rec(3, 1.0, 1.0), "degrees": [2], "ops_per_stage": [[["F0", 0.1, 0.1]]]},
     "ops_per_stage needs activation_peak_mb_per_stage"),
    # (a KeyError and an IndexError in the report, below)
    ({k: v for k, v in _rec(3, 1.0, 1.0).items() if k != "step"} | {"degrees": [2], "ops_per_stage": [[]]},
     "a pipeline step's record needs its step number"),
    ({**_rec(3, 1.0, 1.0), "degrees": [2], "stages": 2, "replicas": 1, "ops_per_stage": [[]] * 4},
     "ops_per_stage has 4 rows, not one per stage of each replica \\(2 stages x 1 replica\\)"),
    ({**_rec(3, 1.0, 1.0), "degrees": [2], "stages": 3, "ops_per_stage": [[]] * 4}, "ops_per_stage has 4 rows"),
])
def test_records_that_cannot_be_reported_on_are_refused(tmp_path, capsys, record, match):
    with pytest.raises(ConfigError, match=match):
        load_run(_write(tmp_path, [_rec(2, 1.0, 1.0), record]))
    assert main(["report", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith("megatron-ext: error:")


def test_one_record_of_no_planner(tmp_path, capsys):
    """Nothing is left out of a run of one step; a record without a planner is a run's."""
    assert main(["report", str(_write(tmp_path, [{"step_time_s": 1.0, "predicted_step_time_s": 1.0}]))]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "run: 1 step" and out[1].endswith("bias +0.0%")  # (no "under-predicts" at 0)


def test_a_pipelined_step_measures_no_micro_batches():
    recs = [_rec(0, 1.0, 1.0), {**_rec(1, 1.0, 1.1), "micro_batch_times_s": [], "predicted_micro_batch_times_s": [0.6]},
            _rec(2, 1.0, 1.1, [(0.5, 0.55)])]
    assert fidelity(recs)["micro_batch_median_abs_error"] == pytest.approx(0.1)


def _pp_rec(step, peaks, ops):
    return {**_rec(step, 1.0, 0.9), "planner": "elastic_pp", "degrees": [2], "activation_room_mb": 30.0,
            "activation_peak_mb_per_stage": peaks, "planned_activation_mb_per_stage": [25.0, 26.0],
            "ops_per_stage": ops}


def test_pipeline_runs_report_stage_times_and_memory(tmp_path, capsys):
    ops = [[["F0", 0.3, 0.2], ["B0", 0.6, 0.4]], [["F0", 0.2, 0.2], ["B0", 0.4, 0.4]]]
    recs = [_pp_rec(0, [40.0, 40.0], ops), _pp_rec(1, [24.0, 27.0], ops), _pp_rec(2, [26.0, 31.0], ops)]
    f = fidelity(recs)  # the first step is left out, its memory too
    assert f["layouts"] == {"pp2 x sp2": 2} and len(f["pipelines"]) == 1
    pipe = f["pipelines"][0]
    assert pipe["stage_op_time_ratio"] == pytest.approx([1.5, 1.0])
    assert pipe["activation_peak_mb_per_stage"] == [26.0, 31.0]
    assert pipe["steps_over_memory_budget"] == [(2, 1)]
    assert main(["report", str(_write(tmp_path, recs))]) == 0
    out = capsys.readouterr().out
    assert "stage 0 1.50x, stage 1 1.00x" in out and "OVER the budget at (step, stage) [(2, 1)]" in out
    # a stage predicted at a denormal time has no ratio (it was inf, and --json wrote Infinity)
    tiny = [[["F0", 0.3, 5e-324], ["B0", 0.6, 0.0]], [["F0", 0.2, 0.2], ["B0", 0.4, 0.4]]]
    assert fidelity([_pp_rec(0, [1.0, 1.0], tiny), _pp_rec(1, [1.0, 1.0], tiny)])["pipelines"][0][
        "stage_op_time_ratio"] == [None, 1.0]


def test_pipeline_replicas_are_named_by_replica_and_stage(tmp_path, capsys):
    ops = [[["F0", 0.3, 0.2], ["B0", 0.6, 0.4]], [["F0", 0.2, 0.2], ["B0", 0.4, 0.4]]] * 2
    recs = [{**_pp_rec(k, [20.0] * 4, ops), "stages": 2, "planned_activation_mb_per_stage": [25.0] * 4}
            for k in range(3)]
    assert main(["report", str(_write(tmp_path, recs))]) == 0
    out = capsys.readouterr().out
    assert "replica 0 stage 0 1.50x, replica 0 stage 1 1.00x, replica 1 stage 0 1.50x" in out
    assert "replica 1 stage 1 20.0 / 25.0" in out


def test_pipeline_waits_are_told_apart_from_a_wrong_profile(tmp_path, capsys):
    ops = [[["F0", 0.2, 0.2], ["B0", 0.4, 0.4]], [["F0", 0.21, 0.2], ["B0", 0.4, 0.4]]]
    recs = [{**_pp_rec(k, [20.0, 20.0], ops), "step_time_s": 2.0, "predicted_step_time_s": 1.2} for k in range(4)]
    assert main(["report", str(_write(tmp_path, recs))]) == 0
    out = capsys.readouterr().out
    assert "so the profile holds" in out and "megatron-ext profile" not in out


def test_auto_runs_report_each_layout_apart(tmp_path, capsys):
    """auto's steps may be FlexSP or pipelines of different replica counts: each pipeline layout
    gets its own stage rows (not one table over rows that do not line up)."""
    one = [[["F0", 0.3, 0.2], ["B0", 0.6, 0.4]]]
    recs = [{**_rec(0, 1.0, 0.9), "planner": "auto"}, {**_rec(1, 1.0, 0.9), "planner": "auto"},
            {**_pp_rec(2, [20.0, 21.0], one * 2), "planner": "auto", "stages": 1,
             "planned_activation_mb_per_stage": [25.0] * 2},
            {**_pp_rec(3, [35.0], one), "planner": "auto", "stages": 1, "degrees": [4],
             "planned_activation_mb_per_stage": [25.0]}]
    f = fidelity(recs)
    assert f["layouts"] == {"flexsp": 1, "pp1 x sp2 x dp2": 1, "pp1 x sp4": 1}
    assert [p["layout"] for p in f["pipelines"]] == ["pp1 x sp2 x dp2", "pp1 x sp4"]
    assert f["pipelines"][1]["steps_over_memory_budget"] == [(3, 0)]
    assert main(["report", str(_write(tmp_path, recs))]) == 0
    out = capsys.readouterr().out
    assert "ran 1 flexsp, 1 pp1 x sp2 x dp2, 1 pp1 x sp4" in out
    assert "pp1 x sp2 x dp2 (1 step): stage operations, measured / predicted time: replica 0 stage 0 1.50x" in out
    assert "pp1 x sp4 (1 step): activation peak per stage" in out and "OVER the budget at (step, stage) [(3, 0)]" in out


def test_odd_files_and_fields_are_one_line_or_quoted(tmp_path, capsys):
    (tmp_path / "bin.jsonl").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError, match="bin.jsonl is not text"):
        load_run(tmp_path / "bin.jsonl")
    (tmp_path / "big.jsonl").write_text('{"step_time_s": ' + "9" * 5000 + ', "predicted_step_time_s": 1}\n')
    with pytest.raises(ConfigError, match="line 1 holds a number of over 4,300 digits"):
        load_run(tmp_path / "big.jsonl")
    off = [{**_rec(i, 1.0, 0.5), "model": "my model; rm -rf x"} for i in range(3)]  # the model is off by half
    assert main(["report", str(_write(tmp_path, off))]) == 0
    assert "profile --model 'my model; rm -rf x' --out" in capsys.readouterr().out
