"""--plot: the drawing data of known plans (boxes, memory curves, length histogram), the files, the CLI flags."""
from __future__ import annotations

import argparse

import numpy as np
import pytest

from megatron_ext.cost import CostModel
from megatron_ext.cost.pipeline import PipelineCost
from megatron_ext.plan import StepPlan
from megatron_ext.planner import PlannerOptions, make_plan
from megatron_ext.planner.pp.elastic_pp import plan_elastic_pp
from megatron_ext.planner.pp.pipeline import build_pipeline
from megatron_ext.sim import simulate
from megatron_ext.commands.plot import (DEGREE_COLORS, DROPPED_COLOR, PACKED_COLOR, SEQ_COLORS, SEQ_HATCHES, LengthHist,
                                   _draw_hist, _lighten, _percent, _new_figure, _tail, _tokens, draw, plot_comparison,
                                   plot_data, plot_plan)

COST = CostModel.from_presets("llama-13b", "a800-80g-8x4")
PNG = b"\x89PNG\r\n\x1a\n"


def _pipeline_plan(recompute: str):
    """Two stages x SP 16 of llama-7b on 32 GPUs; chunks: two slices of sequence 0 (the second with
    sequence 1), and sequence 2 alone."""
    cost = CostModel.from_presets("llama-7b", "a800-80g-8x4")
    pc = PipelineCost(cost, 2, 16)
    lengths = np.array([20000, 3000, 5000])
    built = build_pipeline([[(0, 0, 12000)], [(0, 12000, 20000), (1, 0, 3000)], [(2, 0, 5000)]], pc, recompute)
    plan = StepPlan(kind="elastic_pp", num_gpus=32, planner="test", pipelines=[built.to_pipeline(pc)])
    return cost, lengths, plan


def test_pipeline_boxes_of_a_known_plan():
    cost, lengths, plan = _pipeline_plan("none")
    data = plot_data(plan, lengths, cost)
    n, P = 3, 2
    assert data.kind == "elastic_pp" and data.rows == P
    assert data.count("F") == n * P and data.count("B") == n * P and data.count("R") == 0
    # every chunk's F and B once per stage, on its stage's row, inside the step
    for kind in "FB":
        labels = sorted((b.row, b.label) for b in data.boxes if b.kind == kind)
        assert labels == sorted((p, f"{kind}{c}") for p in range(P) for c in range(n))
    assert all(0 <= b.start_s < b.end_s <= data.step_time_s + 1e-9 for b in data.boxes)
    # colours: the chunks holding slices of sequence 0 share its colour; sequence 2 alone is "packed"
    keys = {b.label: b.key for b in data.boxes if b.row == 0}
    assert keys["F0"] == keys["F1"] == keys["B1"] == 0 and keys["F2"] is None
    assert data.colors[None] == PACKED_COLOR
    # the stage rows never overlap in time
    for p in range(P):
        spans = sorted((b.start_s, b.end_s) for b in data.boxes if b.row == p and b.kind in "FB")
        assert all(b0 >= e1 - 1e-9 for (_, e1), (b0, _) in zip(spans, spans[1:]))
    # memory: one curve per stage, peaking where the simulator says
    res = simulate(plan, lengths, cost)
    assert len(data.memory) == P
    for (_, t, gb), peak in zip(data.memory, res.peak_memory_mb):
        assert gb.max() * 1024 == pytest.approx(peak, rel=1e-9)
        assert (np.diff(t) >= -1e-12).all() and t[-1] == pytest.approx(data.step_time_s)
    assert "bubble" in data.title and f"{data.step_time_s:.2f} s" in data.title


def test_recompute_boxes():
    cost, lengths, plan = _pipeline_plan("full")  # every layer of every chunk recomputed on every stage
    data = plot_data(plan, lengths, cost)
    assert data.count("R") == 3 * 2 and data.count("B") == 3 * 2
    for r in (b for b in data.boxes if b.kind == "R"):  # a recompute box ends where its backward starts
        b = next(x for x in data.boxes if x.kind == "B" and x.row == r.row and x.label[1:] == r.label[1:])
        assert r.end_s == pytest.approx(b.start_s)


def test_flexsp_boxes_are_groups():
    lengths = np.array([60000, 20000, 9000, 3000, 3000, 800, 500, 100])
    plan = make_plan("flexsp", lengths, COST)
    data = plot_data(plan, lengths, COST)
    assert data.kind == "flexsp" and data.rows == COST.num_gpus
    groups = [g for mb in plan.micro_batches for g in mb.groups]
    assert data.count("G") == len(groups)
    assert sorted(b.height for b in data.boxes) == sorted(g.degree for g in groups)
    assert {b.key for b in data.boxes} <= set(data.colors)
    assert len(data.marks) == len(plan.micro_batches)
    assert data.memory[0][2].max() * 1024 == pytest.approx(simulate(plan, lengths, COST).max_peak_memory_mb)


def test_barrier_free_boxes_are_where_each_group_runs(tmp_path):
    """A timelines plan: each group's box starts when its own GPUs are free (the simulator's events),
    GPU sets run different numbers of passes, no micro-batch marks; the file renders."""
    cost = CostModel.from_presets("llama-13b", "a800-80g-8x4", zero_stage=2)
    lengths = np.array([60000] + [20000] * 3 + [3000] * 40 + [500] * 100)
    plan = make_plan("timelines", lengths, cost)
    res = simulate(plan, lengths, cost)
    data = plot_data(plan, lengths, cost, result=res)
    groups = [g for mb in plan.micro_batches for g in mb.groups]
    assert plan.barrier_free and data.count("G") == len(groups) and not data.marks
    starts = {(e.where, round(e.start_s, 9)) for e in res.events}
    assert all((int(b.row), round(b.start_s, 9)) in starts for b in data.boxes)
    assert len({b.start_s for b in data.boxes}) > len(plan.micro_batches)  # not in lockstep
    assert max(b.end_s for b in data.boxes) + cost.step_sync_ms / 1e3 == pytest.approx(res.step_time_s)
    assert "no barrier" in data.title
    plot_plan(plan, lengths, cost, tmp_path / "timelines.png")
    assert (tmp_path / "timelines.png").read_bytes().startswith(PNG)


def _hist_cells(hist) -> dict[tuple[str, int], int]:
    """(choice label, bucket) -> sequences, recounted from the per-sequence arrays."""
    cells: dict[tuple[str, int], int] = {}
    for c, b in zip(hist.choice, hist.bucket):
        key = (hist.choices[c][0], int(b))
        cells[key] = cells.get(key, 0) + 1
    return cells


def _check_hist_totals(hist, lengths) -> None:
    counts = hist.counts()
    assert counts.sum() == len(lengths) and hist.token_share().sum() == pytest.approx(1.0)
    assert np.allclose(np.log2(hist.edges), np.round(np.log2(hist.edges)))  # power-of-two buckets
    for i, n in enumerate(lengths):  # every sequence in the bucket that holds its length
        assert hist.edges[hist.bucket[i]] <= n < hist.edges[hist.bucket[i] + 1]
    labels = [label for label, _ in hist.choices]
    for (label, b), n in _hist_cells(hist).items():
        assert counts[labels.index(label), b] == n


def test_flexsp_length_histogram_by_degree():
    lengths = np.array([60000, 20000, 9000, 3000, 3000, 800, 500, 100])
    plan = make_plan("flexsp", lengths, COST)
    data = plot_data(plan, lengths, COST)
    hist = data.hist
    _check_hist_totals(hist, lengths)
    degree = {s: g.degree for mb in plan.micro_batches for g in mb.groups for s in g.seq_ids}
    assert len(set(degree.values())) > 1  # the check below tells degrees apart
    for i in range(len(lengths)):  # each sequence stacked under its own group's degree, in that degree's colour
        label, color = hist.choices[hist.choice[i]]
        assert label == f"degree {degree[i]}" and color == data.colors[degree[i]]
    assert hist.edges[hist.bucket[0]] == 32768 and hist.edges[hist.bucket[-1]] == 64
    # the longest buckets holding half the tokens: 60000 alone holds 60000 / 96900
    assert "the 1 sequence of 32K+ tokens (12% of them) holds 62% of the tokens" in hist.title


def test_pipeline_length_histogram_by_slices():
    cost, lengths, plan = _pipeline_plan("none")  # sequence 0 in two slices, 1 and 2 whole
    hist = plot_data(plan, lengths, cost).hist
    _check_hist_totals(hist, lengths)
    assert [label for label, _ in hist.choices] == ["whole", "cut in 2"] and hist.choices[0][1] == PACKED_COLOR
    assert _hist_cells(hist) == {("cut in 2", 3): 1, ("whole", 0): 1, ("whole", 1): 1}  # 16K-32K; 2K-4K; 4K-8K
    assert hist.edges[0] == 2048
    assert [t for t, _ in hist.marks] == [12000, 12000]  # largest chunk: slice 0-12000; longest slice: the same
    share = hist.token_share()
    assert share[1, 3] == pytest.approx(20000 / 28000) and share[0, 0] == pytest.approx(3000 / 28000)


def test_length_histogram_keeps_dropped_sequences_apart():
    lengths = np.array([60000, 9000, 3000, 800])
    plan = make_plan("flexsp", lengths, COST, PlannerOptions(drop_over_max=True, max_seq_len=16384))
    assert plan.dropped_seq_ids == [0]
    hist = plot_data(plan, lengths, COST).hist
    _check_hist_totals(hist, lengths)
    assert hist.choices[-1] == ("dropped (too long)", DROPPED_COLOR)  # drawn on top
    assert [hist.choices[c][0] for c in hist.choice].count("dropped (too long)") == 1
    assert hist.choices[hist.choice[0]][0] == "dropped (too long)"


def test_files_are_written(tmp_path):
    cost, lengths, plan = _pipeline_plan("greedy")
    out = tmp_path / "pipe.png"
    plot_plan(plan, lengths, cost, out)
    assert out.read_bytes()[:8] == PNG and out.stat().st_size > 10_000
    lengths = np.array([30000, 9000, 4000, 1000, 500, 500])
    flex = make_plan("flexsp", lengths, COST)
    plot_plan(flex, lengths, COST, tmp_path / "flex.png")
    assert (tmp_path / "flex.png").read_bytes()[:8] == PNG
    pipe = plan_elastic_pp(lengths, COST, 4, 8, time_limit=0.3)
    summary = [{"planner": "elastic_pp", "step_time_s": pipe.estimated_step_time_s, "bubble_ratio": 0.1},
               {"planner": "flexsp", "step_time_s": flex.estimated_step_time_s, "bubble_ratio": 0.0},
               {"planner": "seq1f1b", "error": "infeasible"}]
    plot_comparison(pipe, lengths, COST, summary, "elastic_pp", tmp_path / "cmp.png", "test batch")
    assert (tmp_path / "cmp.png").read_bytes()[:8] == PNG


def test_cli_plot_flags(tmp_path, capsys):
    from megatron_ext.commands import cli

    base = ["--model", "llama-13b", "--cluster", "a800-80g-8x4", "--dist", "github", "--batch", "48",
            "--max-seq-len", "32K", "--no-baselines", "--time-limit", "0.3"]
    for planner in ("elastic_pp", "flexsp", "auto"):
        out = tmp_path / f"{planner}.png"
        assert cli.main(["plan", "--planner", planner, "--plot", str(out), *base]) == 0
        assert out.read_bytes()[:8] == PNG
        assert f"plot written to {out}" in capsys.readouterr().err
    out = tmp_path / "sim.png"
    assert cli.main(["simulate", "--model", "llama-7b", "--cluster", "a800-80g-8x1", "--dist", "github",
                     "--batch", "16", "--steps", "1", "--max-seq-len", "16K", "--pp", "2", "--sp", "4",
                     "--planners", "elastic_pp,flexsp", "--time-limit", "0.3", "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG
    # an unwritable path is one line on stderr, exit status 2, before planning
    bad = tmp_path / "missing-dir" / "x.png"
    capsys.readouterr()
    assert cli.main(["plan", "--planner", "elastic_pp", "--plot", str(bad), *base]) == 2
    assert capsys.readouterr().err == f"megatron-ext: error: --plot {bad}: cannot write in {bad.parent}: " \
                                      f"No such file or directory\n"


def _lab(color) -> np.ndarray:
    """CIE L*a*b* (D65): Euclidean distances there are perceived colour differences."""
    from matplotlib.colors import to_rgb

    c = np.array(to_rgb(color))
    c = np.where(c > 0.04045, ((c + 0.055) / 1.055) ** 2.4, c / 12.92)
    xyz = np.array([[0.4124, 0.3576, 0.1805], [0.2126, 0.7152, 0.0722], [0.0193, 0.1192, 0.9505]]) @ c
    f = np.cbrt(np.maximum(xyz / np.array([0.9505, 1.0, 1.089]), 0.008856))
    return np.array([116 * f[1] - 16, 500 * (f[0] - f[1]), 200 * (f[1] - f[2])])


def _min_distance(colors) -> float:
    lab = [_lab(c) for c in colors]
    return min(np.linalg.norm(a - b) for i, a in enumerate(lab) for b in lab[i + 1:])


def test_palettes_are_distinct():
    assert _min_distance(DEGREE_COLORS[d] for d in (1, 2, 4, 8, 16, 32, 64)) > 20
    # the cut sequences' colours, in both shades (forward light, backward full), and the grey of whole ones
    assert _min_distance(SEQ_COLORS + [PACKED_COLOR]) > 15
    full = [_lab(c) for c in SEQ_COLORS + [PACKED_COLOR]]
    for i, c in enumerate(SEQ_COLORS + [PACKED_COLOR]):
        assert min(np.linalg.norm(_lab(_lighten(c)) - x) for j, x in enumerate(full) if j != i) > 12


def test_many_cut_sequences_get_their_own_look():
    cost = CostModel.from_presets("llama-7b", "a800-80g-8x4")
    pc = PipelineCost(cost, 2, 16)
    n = len(SEQ_COLORS) + 5
    lengths = np.full(n, 4000)
    built = build_pipeline([[(s, half * 2000, half * 2000 + 2000)] for s in range(n) for half in (0, 1)], pc, "none")
    data = plot_data(StepPlan(kind="elastic_pp", num_gpus=32, planner="test", pipelines=[built.to_pipeline(pc)]),
                     lengths, cost)
    looks = {(data.colors[s], data.hatches[s]) for s in range(n)}
    assert len(looks) == n and {h for _, h in looks} == set(SEQ_HATCHES[:2])
    assert data.legend[-1][0] == f"... {n - 8} more cut sequences"  # no colour repeats


def _overlaps(boxes) -> list:
    return [(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:] if a.overlaps(b)]


def test_timeline_labels_do_not_collide():
    lengths = np.array([60000, 20000, 9000, 3000, 3000, 800, 500, 100])
    flex = plot_data(make_plan("flexsp", lengths, COST), lengths, COST)
    fig = draw(flex)
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    marks = [t.get_window_extent(renderer) for t in ax.child_axes[0].get_xticklabels()]
    assert [t.get_text() for t in ax.child_axes[0].get_xticklabels()] == [m for _, m, _ in flex.marks]
    assert {rows for _, _, rows in flex.marks} == {(0, COST.num_gpus)}  # a micro-batch spans every GPU
    ticks = [t.get_window_extent(renderer) for t in ax.get_xticklabels() if t.get_text()]
    assert not any(m.overlaps(t) for m in marks for t in ticks) and not _overlaps(marks)
    # a pipeline of many chunks: every forward and backward box wide enough gets a label, inside it
    cost, lengths, plan = _pipeline_plan("full")
    data = plot_data(plan, lengths, cost)
    fig = draw(data)
    ax = fig.axes[0]
    renderer = fig.canvas.get_renderer()
    texts = [t for t in ax.texts if t.get_text()]
    assert {t.get_text() for t in texts} <= {b.label for b in data.boxes} | {b.label[1:] for b in data.boxes}
    assert len(texts) == data.count("F") + data.count("B")  # wide boxes: all labelled
    assert not _overlaps([t.get_window_extent(renderer) for t in texts])
    # recompute boxes are drawn wide enough to see
    assert all(p.get_window_extent().width >= 4 for p in ax.patches if p.get_hatch() == "////")


def test_token_counts_read_like_max_seq_len():
    assert [_tokens(2 ** k) for k in (9, 10, 11, 19, 20, 21)] == ["512", "1K", "2K", "512K", "1M", "2M"]
    assert _tokens(12000) == "11.7K" and _tokens(1.5 * 2 ** 20) == "1.5M"
    assert _tokens(1023 * 1024) == "1023K" and _tokens(1000) == "1000"  # never an exponent


def test_histogram_ticks_are_powers_of_two_in_k_and_m():
    lengths = np.array([1024, 5000, 300_000, 2 ** 20 + 5])
    hist = LengthHist(2.0 ** np.arange(10, 22), lengths, np.zeros(4, dtype=np.int64), [("all", "grey")], "t")
    ax = _new_figure().subplots()
    _draw_hist(ax, hist)
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert labels == [f"{2 ** k}K" for k in range(10)] + ["1M", "2M"]


def test_shares_never_round_to_0_or_100_percent():
    assert [_percent(x) for x in (0, 0.12, 0.004, 0.002, 0.0004, 0.996, 0.9996, 1)] == \
        ["0%", "12%", "0.4%", "0.2%", "<0.1%", "99.6%", ">99.9%", "100%"]
    assert _percent(0.0004, 1) == "0.04%" and _percent(0.00004, 1) == "<0.01%" and _percent(0.038, 1) == "3.8%"


def test_tail_wording():
    one = np.array([600_000] + [1000] * 511)  # one sequence of 512 holds 54% of the tokens
    edges = 2.0 ** np.arange(9, 21)
    assert _tail(one, edges) == "the 1 sequence of 512K+ tokens (0.2% of them) holds 54% of the tokens"
    two = np.array([600_000, 600_000] + [1000] * 510)
    assert _tail(two, edges) == "the 2 sequences of 512K+ tokens (0.4% of them) hold 70% of the tokens"


def test_title_gives_peak_and_budget_the_same_precision():
    cost, lengths, plan = _pipeline_plan("none")
    title = plot_data(plan, lengths, cost, memory_mb=30000).title
    assert "of 29.3 GB per GPU" in title  # 30000 MB: not "29.3 of 29 GB", which reads as over budget
    assert "3 chunks: 2 hold a piece of 1 sequence cut across chunks (coloured), 1 holds only whole" in title


def test_auto_title_names_the_choice_and_the_two_fastest_alternatives():
    from megatron_ext.data.lengths import sample_lengths
    from megatron_ext.planner import make_plan
    from megatron_ext.planner.auto import plan_auto

    lengths = sample_lengths("github", 128, 0, 32 * 1024)
    plan = plan_auto(lengths, COST, pp=1, b1_scale=0.06, time_limit=2.0)  # FlexSP and one-stage replicas
    chosen = plan.solver_status.split("auto chose ", 1)[1].split(" (", 1)[0]
    # the fastest alternative auto planned; auto may skip every other layout by its bounds, so
    # FlexSP planned alone stands in then
    planned = sorted(((k, v["estimated_step_time_s"]) for k, v in plan.baselines.items()
                      if "estimated_step_time_s" in v), key=lambda x: x[1])
    alt, alt_s = planned[0] if planned else ("flexsp", make_plan("flexsp", lengths, COST).estimated_step_time_s)
    plan.baselines = {alt: {"estimated_step_time_s": alt_s}}
    title = plot_data(plan, lengths, COST, b1_scale=0.06).title.split("\n")[0]
    assert title == f"auto chose {chosen} ({plan.estimated_step_time_s:.2f} s; next: {alt} {alt_s:.2f} s)"
    plan.baselines.update({f"x{i}": {"estimated_step_time_s": alt_s + 1 + i} for i in range(3)})
    assert plot_data(plan, lengths, COST, b1_scale=0.06).title.split("\n")[0].endswith(
        f"; next: {alt} {alt_s:.2f} s, x0 {alt_s + 1:.2f} s, 2 more planned)")


def test_box_labels_are_whole_and_inside_their_box():
    """Chunks from 60K tokens down to 200 (64 of them): wide boxes get "F3", narrower ones the chunk id alone,
    the narrowest none; no label is cut short or wider than its box."""
    cost = CostModel.from_presets("llama-7b", "a800-80g-8x4")
    pc = PipelineCost(cost, 2, 16)
    sizes = [60000, 30000, 12000, 6000] + [200] * 60
    built = build_pipeline([[(s, 0, n)] for s, n in enumerate(sizes)], pc, "none")
    data = plot_data(StepPlan(kind="elastic_pp", num_gpus=32, planner="test", pipelines=[built.to_pipeline(pc)]),
                     np.array(sizes), cost)
    fig = draw(data)
    ax = fig.axes[0]
    renderer = fig.canvas.get_renderer()
    boxes = [p.get_window_extent(renderer) for p in ax.patches]
    texts = {t.get_text() for t in ax.texts}
    assert {"F0", "B0"} <= texts and any(t.isdigit() for t in texts) and len(ax.texts) < data.count("F") * 2
    assert texts <= {b.label for b in data.boxes} | {b.label[1:] for b in data.boxes}
    for t in ax.texts:
        ext = t.get_window_extent(renderer)
        box = next(b for b in boxes if b.contains((ext.x0 + ext.x1) / 2, (ext.y0 + ext.y1) / 2))
        assert box.x0 < ext.x0 and ext.x1 < box.x1 and box.y0 <= ext.y0 and ext.y1 <= box.y1, t.get_text()


def test_histogram_marks_are_in_the_legend():
    cost, lengths, plan = _pipeline_plan("none")
    fig = draw(plot_data(plan, lengths, cost))
    legend = [t.get_text() for t in fig.axes[2].get_legend().get_texts()]
    assert legend[-2:] == ["largest chunk 11.7K", "longest slice 11.7K"]


def test_plot_refuses_unknown_kinds():
    from megatron_ext.errors import ConfigError

    with pytest.raises(ConfigError, match="cannot plot"):
        plot_data(StepPlan(kind="other", num_gpus=32), np.array([1]), COST, result=argparse.Namespace(events=[1]))


def _replicated(pp: int, sp: int):
    rng = np.random.default_rng(5)
    lengths = np.concatenate([rng.integers(20_000, 60_000, 3), rng.integers(100, 4000, 40)])
    plan = plan_elastic_pp(lengths, COST, pp, sp, time_limit=0.5)
    return lengths, plan, plot_data(plan, lengths, COST)


def test_replicas_get_their_own_rows_and_separators():
    lengths, plan, data = _replicated(2, 8)  # 2 replicas of 2 stages
    assert data.rows == 4 and data.separators == [2.0]
    names = ["replica 0, stage 0", "replica 0, stage 1", "replica 1, stage 0", "replica 1, stage 1"]
    assert [label.split("\n")[0] for label in data.row_labels] == names
    assert data.row_labels[3].endswith("layers 20-39")
    # each replica's boxes on its own rows: the pipelines of replica r on rows 2r and 2r + 1
    for b in data.boxes:
        pipe = int(b.label[1:].split(".")[0])
        assert b.row // 2 == plan.pipelines[pipe].replica
    assert "2 replicas x 2 stages x SP 8" in data.title and not data.notes
    # memory: a curve per replica and stage, a stage's colour shared, replica 1 dashed
    assert [name for name, _, _ in data.memory] == names
    assert data.memory_styles == [(0, "-"), (1, "-"), (0, "--"), (1, "--")]
    fig = draw(data)
    timeline, memory = fig.axes[:2]
    assert [t.get_text() for t in timeline.get_yticklabels()] == data.row_labels
    assert timeline.get_ylabel().startswith("replica, stage")
    assert [line.get_ydata()[0] for line in timeline.get_lines()] == [2.0]  # the separator
    curves = {line.get_label(): line for line in memory.get_lines()}
    for p in range(2):
        solid, dashed = curves[f"replica 0, stage {p}"], curves[f"replica 1, stage {p}"]
        assert solid.get_color() == dashed.get_color()
        assert (solid.get_linestyle(), dashed.get_linestyle()) == ("-", "--")
    assert curves["replica 0, stage 0"].get_color() != curves["replica 0, stage 1"].get_color()
    assert memory.get_title(loc="left").startswith("memory per GPU of each replica and stage")


def test_many_replicas_keep_a_memory_curve_per_stage():
    lengths, plan4, data4 = _replicated(2, 4)  # 4 replicas of 2 stages
    assert data4.rows == 8 and data4.separators == [2.0, 4.0, 6.0]
    assert data4.row_labels[5] == "replica 2, stage 1\nlayers 20-39"
    res = simulate(plan4, lengths, COST)
    assert [name for name, _, _ in data4.memory] == ["stage 0, max over 4 replicas", "stage 1, max over 4 replicas"]
    for p, (_, _, gb) in enumerate(data4.memory):
        assert gb.max() * 1024 == pytest.approx(max(res.peak_memory_mb[p::2]))
    assert "highest of its 4 replicas" in data4.memory_title


def test_a_later_pipeline_of_a_replica_is_marked_on_its_rows_only():
    pc = PipelineCost(COST, 2, 8)
    lengths = np.array([9000, 5000, 7000])
    # replica 0 runs sequence 0's pipeline, then sequence 1's; replica 1 sequence 2's
    pipes = [build_pipeline([[(s, 0, int(lengths[s]))]], pc, "none").to_pipeline(pc, r)
             for s, r in ((0, 0), (1, 0), (2, 1))]
    data = plot_data(StepPlan(kind="elastic_pp", num_gpus=32, planner="test", pipelines=pipes), lengths, COST)
    assert {b.label for b in data.boxes if b.row == 0} == {"F0.0", "B0.0", "F1.0", "B1.0"}
    assert [(text, rows) for _, text, rows in data.marks] == [("pipeline 1", (0, 2))]
    start = min(b.start_s for b in data.boxes if b.label == "F1.0" and b.row == 0)
    assert data.marks[0][0] == start
    fig = draw(data)
    dotted = [line for line in fig.axes[0].get_lines() if line.get_linestyle() == ":"]
    assert len(dotted) == 1 and list(dotted[0].get_xdata()) == [start] * 2
    assert list(dotted[0].get_ydata()) == [0.5, 1.0]  # the top half: replica 0's two rows of four


def test_an_idle_replica_still_draws(tmp_path):
    lengths = np.array([30_000])
    plan = plan_elastic_pp(lengths, COST, 2, 8)  # one sequence: replica 1 has nothing to run
    data = plot_data(plan, lengths, COST)
    assert data.rows == 4 and all(b.row < 2 for b in data.boxes)
    assert data.notes == [(3.0, "replica 1 idle: no sequence to run")]
    assert [name for name, _, _ in data.memory][2:] == ["replica 1, stage 0", "replica 1, stage 1"]
    fig = draw(data, tmp_path / "idle.png")
    assert (tmp_path / "idle.png").read_bytes().startswith(PNG)
    assert "replica 1 idle: no sequence to run" in {t.get_text() for t in fig.axes[0].texts}
