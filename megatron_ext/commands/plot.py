"""Pictures of simulated steps (``--plot FILE.png`` on ``megatron-ext plan`` and ``simulate``).

Two layers, so the drawing can be tested without looking at pixels:

- ``plot_data(plan, lengths, cost)`` simulates the plan and turns it into plain data: the boxes
  of the timeline (``Box``: row, height, start, end, kind, colour key, label), the memory curves
  and the title. Elastic pipelines: one row per stage (per replica and stage when data-parallel
  replicas run side by side, each replica's rows a block); a forward (``F``) and a backward (``B``)
  box per chunk and stage, and a recompute box (``R``) at the start of a backward that re-runs layers.
  FlexSP-kind plans: one row per GPU; one box (``G``) per SP group and micro-batch, spanning the
  group's GPUs for its time (without a barrier, ``StepPlan.barrier_free``, where it really runs:
  from when its own GPUs are free; no micro-batch marks then). ``PlotData.hist`` (``LengthHist``)
  puts every sequence of the batch in a power-of-two length bucket with the plan's choice for it:
  the degree of its SP group (FlexSP) or whole / cut into k slices (elastic pipelines).
- ``draw(data, path)`` renders it with matplotlib's object-oriented Figure (no pyplot, no display
  needed, the global backend untouched): the timeline
  on top, the memory per GPU of each stage (or the max over replicas, the max/mean over GPUs) below,
  in seconds and GB, then the length histogram: per bucket, a bar of sequences and a hatched bar of
  the bucket's share of the tokens, both stacked by choice (a few long sequences hold most of them).

``plot_plan`` does both; ``plot_comparison`` adds a bar per planner (``megatron-ext simulate``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from megatron_ext.cost import CostModel
from megatron_ext.errors import ConfigError
from megatron_ext.files import replacing
from megatron_ext.plan.schema import StepPlan
from megatron_ext.plan.validate import group_starts_ms, replica_groups
from megatron_ext.sim.simulator import SimResult, simulate
from megatron_ext.text import plural

# split sequences: tab10 without its grey, then colours from Set1, Set2, Dark2 and tab20b picked to stay apart
# from each other, from each other's light (forward) shade and from the grey of packed short sequences (tab20's
# light half would match the forward shades); past 20 sequences the colours come back hatched
SEQ_COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf",
              "#ffff33", "#fc8d62", "#e6ab02", "#a6761d", "#1b9e77", "#8ca252", "#d6616b", "#a6d854", "#bf5b17",
              "#e7298a", "#e7ba52"]
SEQ_HATCHES = ["", "..", "oo", "++"]
PACKED_COLOR = "#9e9e9e"
# Okabe-Ito (colour-blind safe), light to dark as the degree grows
DEGREE_COLORS = {1: "#f0e442", 2: "#56b4e9", 4: "#e69f00", 8: "#cc79a7", 16: "#009e73", 32: "#d55e00",
                 64: "#0072b2", 128: "#000000"}
# length histogram of a pipeline: whole sequences grey (as their chunks), cut ones by slices (up to 2, 4, ...)
# slices of a cut sequence, by powers of two (up to 2, 4, 8, ...): oranges, then purples, blues, greens,
# each its own colour (the last one for any more)
SLICE_COLORS = ["#fd8d3c", "#e6550d", "#a63603", "#7f2704", "#4d1802", "#6a51a3", "#54278f", "#3f007d", "#08519c",
                "#08306b", "#006d2c", "#00441b"]
DROPPED = 1 << 30  # histogram key of dropped sequences: sorts last, drawn on top
DROPPED_COLOR = "#9467bd"
RECOMPUTE_HATCH = "////"  # unlike the sequences' hatches
RECOMPUTE_MIN_PX = 5  # recompute boxes are drawn at least this wide: a 0.2% recompute is a sliver otherwise


@dataclass
class Box:
    row: float  # first row (stage, or first GPU of a group); rows grow downwards
    height: float  # rows covered (1 for a stage, the degree for a FlexSP group)
    start_s: float
    end_s: float
    kind: str  # "F" forward, "B" backward (without its recompute), "R" recompute, "G" FlexSP group
    key: int | None  # colour: split sequence id (None: packed short sequences) or the group's degree
    label: str  # e.g. "F12", "B12", "d8: 5 seq"

    @property
    def width_s(self) -> float:
        return self.end_s - self.start_s


@dataclass
class LengthHist:
    """The batch's sequences by length bucket and by what the plan did with each."""

    edges: np.ndarray  # bucket b holds lengths in [edges[b], edges[b + 1]) tokens (powers of two)
    lengths: np.ndarray  # tokens per sequence
    choice: np.ndarray  # per sequence: its index in ``choices``
    choices: list[tuple[str, str]]  # (label, colour), stacked bottom first
    title: str
    marks: list[tuple[float, str]] = field(default_factory=list)  # vertical lines: (tokens, text)

    @property
    def bucket(self) -> np.ndarray:
        return np.searchsorted(self.edges, self.lengths, side="right") - 1

    def counts(self) -> np.ndarray:
        """Sequences per (choice, bucket)."""
        return self._sum(np.ones(len(self.lengths)))

    def token_share(self) -> np.ndarray:
        """Share of the batch's tokens per (choice, bucket); sums to 1."""
        return self._sum(self.lengths / max(1, self.lengths.sum()))

    def _sum(self, weights: np.ndarray) -> np.ndarray:
        out = np.zeros((len(self.choices), len(self.edges) - 1))
        np.add.at(out, (self.choice, self.bucket), weights)
        return out


@dataclass
class PlotData:
    kind: str  # "elastic_pp" | "flexsp"
    title: str
    rows: int
    row_labels: list[str]
    boxes: list[Box]
    memory: list[tuple[str, np.ndarray, np.ndarray]]  # (label, times s, GB)
    memory_title: str
    budget_gb: float
    step_time_s: float
    bubble_ratio: float
    colors: dict  # key -> colour, for the boxes' keys
    # (text, colour or [forward shade, backward shade] for a two-tone swatch, hatch)
    legend: list[tuple[str, str | list, str]] = field(default_factory=list)
    # vertical lines: (time s, text, (first row, end row) it spans: a replica's pipeline marks only its rows)
    marks: list[tuple[float, str, tuple[float, float]]] = field(default_factory=list)
    hist: LengthHist | None = None
    hatches: dict = field(default_factory=dict)  # key -> hatch, for split sequences past the colours
    separators: list[float] = field(default_factory=list)  # rows between side-by-side pipeline replicas
    # per memory curve (colour slot, line style); empty: a slot each, solid
    memory_styles: list[tuple[int, str]] = field(default_factory=list)
    notes: list[tuple[float, str]] = field(default_factory=list)  # text across the timeline at a row (idle replica)

    def count(self, kind: str) -> int:
        return sum(1 for b in self.boxes if b.kind == kind)


def _lighten(color: str, amount: float = 0.55) -> tuple[float, float, float]:
    from matplotlib.colors import to_rgb

    r, g, b = to_rgb(color)
    return (r + (1 - r) * amount, g + (1 - g) * amount, b + (1 - b) * amount)


def _chunk_keys(plan: StepPlan, lengths: np.ndarray) -> tuple[dict[tuple[int, int], int | None], dict, dict]:
    """(pipeline, chunk id) -> the split sequence it carries a slice of (None: only whole short
    sequences), and a colour and a hatch per split sequence (longest first)."""
    keys: dict[tuple[int, int], int | None] = {}
    split: set[int] = set()
    for i, p in enumerate(plan.pipelines):
        for c in p.chunks:
            k = None
            for x in c.pieces:
                if x.start > 0 or x.end < lengths[x.seq_id]:
                    k = int(x.seq_id)
            keys[(i, int(c.id))] = k
            if k is not None:
                split.add(k)
    order = sorted(split, key=lambda s: (-int(lengths[s]), s))
    colors = {s: SEQ_COLORS[j % len(SEQ_COLORS)] for j, s in enumerate(order)}
    colors[None] = PACKED_COLOR
    hatches = {s: SEQ_HATCHES[j // len(SEQ_COLORS) % len(SEQ_HATCHES)] for j, s in enumerate(order)}
    return keys, colors, hatches


def _title(plan: StepPlan, cost: CostModel, lengths: np.ndarray, layout: str, res: SimResult, detail: str) -> str:
    kept = np.setdiff1d(np.arange(len(lengths)), plan.dropped_seq_ids)
    who = plan.planner or plan.kind
    if plan.planner == "auto" and plan.solver_status.startswith("auto chose "):
        # "auto chose flexsp (12.55 s; next: ...)": the two fastest alternatives fit the title's width
        who = plan.solver_status.split(" (", 1)[0] + f" ({plan.estimated_step_time_s:.2f} s"
        alts = sorted((v["estimated_step_time_s"], k) for k, v in plan.baselines.items() if "estimated_step_time_s" in v)
        if alts:
            who += "; next: " + ", ".join(f"{k} {t:.2f} s" for t, k in alts[:2]) + \
                (f", {len(alts) - 2} more planned" if len(alts) > 2 else "")
        who += ")"
    head = (f"{who}{chr(10) if who != (plan.planner or plan.kind) else ': '}{cost.model_on_cluster} "
            f"({cost.num_gpus} GPUs), {layout}; {plural(len(kept), 'sequence')}, {int(lengths[kept].sum()):,} tokens")
    rec = f", recompute {_percent(res.recompute_ratio, 1)}" if res.recompute_ratio > 0 else ""
    unit, div = ("GB", 1024.0) if res.budget_mb >= 2048 else ("MB", 1.0)
    # peak and budget to the same precision: "29.3 of 29 GB" would read as over budget
    return (f"{head}\nstep time {res.step_time_s:.2f} s, bubble (idle GPU time) {res.bubble_ratio:.1%}{rec}, peak memory "
            f"{res.max_peak_memory_mb / div:.1f} of {res.budget_mb / div:.1f} {unit} per GPU\n{detail}")


def _tokens(n: float) -> str:
    """A length as --max-seq-len writes it: 512, 1K, 32K, 1M (K = 1024 tokens, M = 1024K)."""
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= size:
            x = n / size  # 3 significant digits, but no exponent from 1000K to 1023K
            return f"{x:.3g}{unit}" if x < 1000 else f"{x:.0f}{unit}"
    return f"{n:.0f}"


def _percent(x: float, digits: int = 0) -> str:
    """A share as a percentage with ``digits`` decimals, one more where that would round a nonzero share
    to 0% (or a partial one to 100%): 12%, 0.2%, <0.1%, 99.8%."""
    text = f"{x:.{digits}%}"
    if 0 < x < 1 and float(text[:-1]) in (0, 100):
        text = f"{x:.{digits + 1}%}"
        step = 10.0 ** -(digits + 1)
        if float(text[:-1]) == 0:
            return f"<{step:g}%"
        if float(text[:-1]) == 100:
            return f">{100 - step:g}%"
    return text


def _length_hist(plan: StepPlan, lengths: np.ndarray, keys, choices: dict[int, tuple[str, str]],
                 what: str, marks: list[tuple[float, str]] | None = None) -> LengthHist:
    """Bucket every sequence by length (powers of two: long tails need log bins) under ``keys[i]``,
    its choice (``choices``: key -> label, colour; the keys in use are stacked in key order); the
    plan's dropped sequences get a choice of their own."""
    keys = np.array(keys, dtype=np.int64)
    keys[plan.dropped_seq_ids] = DROPPED
    choices = {**choices, DROPPED: ("dropped (too long)", DROPPED_COLOR)}
    order = sorted(set(keys.tolist()))
    index = {k: i for i, k in enumerate(order)}
    span = [int(lengths.min()), int(lengths.max())] + [t for t, _ in marks or []]  # marks inside the axis too
    top = int(np.log2(max(1, max(span)))) + 1
    edges = 2.0 ** np.arange(min(int(np.log2(max(1, min(span)))), top - 1), top + 1)
    return LengthHist(edges, lengths, np.array([index[k] for k in keys], dtype=np.int64),
                      [choices[k] for k in order], f"sequence lengths of the batch by {what}; {_tail(lengths, edges)}",
                      marks or [])


def _tail(lengths: np.ndarray, edges: np.ndarray) -> str:
    """The longest buckets that hold half the tokens, e.g. 'the 12 sequences of 64K+ tokens (2%) hold 55%'."""
    for e in edges[::-1]:
        long = lengths >= e
        share = lengths[long].sum() / max(1, lengths.sum())
        if share >= 0.5:
            n = int(long.sum())
            return (f"the {plural(n, 'sequence')} of {_tokens(e)}+ tokens ({_percent(long.mean())} of them) "
                    f"{'holds' if n == 1 else 'hold'} {_percent(share)} of the tokens")
    return ""  # pragma: no cover - the first edge is at most the shortest length, so share is 1 there


def plot_data(plan: StepPlan, lengths, cost: CostModel, *, b1_scale: float = 1.0, memory_mb: float | None = None,
              result: SimResult | None = None) -> PlotData:
    """Simulate ``plan`` (unless ``result``, simulated with events, is given) and lay it out."""
    lengths = np.asarray(lengths, dtype=np.int64)
    res = result if result is not None and result.events else simulate(plan, lengths, cost, b1_scale=b1_scale,
                                                                       memory_mb=memory_mb, events=True)
    if plan.kind == "elastic_pp":
        return _pipeline_data(plan, lengths, cost, res)
    if plan.kind == "flexsp":
        return _flexsp_data(plan, lengths, cost, res)
    raise ConfigError(f"cannot plot a plan of kind {plan.kind!r}")


def _pipeline_data(plan: StepPlan, lengths: np.ndarray, cost: CostModel, res: SimResult) -> PlotData:
    P = plan.pipelines[0].stages
    sp = plan.pipelines[0].sp_degree
    groups = replica_groups(plan, cost.num_gpus)
    R = len(groups)  # replicas side by side: rows r x P + p (the simulator's)
    L_s = cost.model.num_layers // P
    keys, colors, hatches = _chunk_keys(plan, lengths)
    multi = len(plan.pipelines) > 1
    boxes = []
    for e in res.events:
        if e.kind not in ("F", "B", "R"):
            continue
        pi, cid = e.label.split(":")
        pi, cid = int(pi[1:]), int(cid)
        name = f"{pi}.{cid}" if multi else f"{cid}"
        boxes.append(Box(e.where, 1, e.start_s, e.end_s, e.kind, keys[(pi, cid)], f"{e.kind}{name}"))
    n_chunks = sum(len(p.chunks) for p in plan.pipelines)
    layout = f"{plural(P, 'stage')} x SP {sp}"
    if R > 1:
        layout = f"{R} replicas x {layout} ({plural(len(plan.pipelines), 'pipeline')})"
    elif multi:
        layout = f"{len(plan.pipelines)} pipelines x {layout}"

    def where(r: int, p: int) -> str:
        return f"replica {r}, stage {p}" if R > 1 else f"stage {p}"

    # two replicas of up to 2 stages: every (replica, stage) curve, a stage's colour shared and the replica told by
    # solid / dashed, so a stage's two curves read as a pair; more: a curve per stage, of its highest replica (what
    # the budget is about; the timeline shows which replica runs what) -- 8 crossing curves tangle
    if R == 1 or (R == 2 and P <= 2):
        memory = [(where(*divmod(i, P)), np.array([t for t, _ in pts]), np.array([v for _, v in pts]) / 1024)
                  for i, pts in enumerate(res.memory)]
        styles = [(p, "-" if r == 0 else "--") for r in range(R) for p in range(P)]
        memory_title = "memory per GPU of each replica and stage" if R > 1 else "memory per GPU of each stage"
    else:
        memory = [m for p in range(P)
                  for m in _aggregate_memory(res.memory[p::P], ((f"stage {p}, max over {R} replicas", np.max),))]
        styles = []
        memory_title = f"memory per GPU of each stage, the highest of its {R} replicas at each time"
    split = sorted((k for k in colors if k is not None), key=lambda s: (-int(lengths[s]), s))
    slices = {s: sum(1 for k in keys.values() if k == s) for s in split}
    packed = sum(1 for k in keys.values() if k is None)
    if split:
        whole = f", {packed} {'holds' if packed == 1 else 'hold'} only whole sequences (grey)" if packed else ""
        detail = (f"{n_chunks} chunks: {sum(slices.values())} hold a piece of {plural(len(split), 'sequence')} cut "
                  f"across chunks (coloured){whole}; each chunk runs forward (F) then backward (B) on every stage")
    else:
        detail = (f"{plural(n_chunks, 'chunk')} of whole sequences; each chunk runs forward (F) then backward (B) "
                  f"on every stage")
    # the shades in grey, each colour as a two-tone (forward | backward) swatch: "B" and "grey" differ
    grey = PACKED_COLOR
    legend = [("F: forward (light shade)", _lighten(grey), ""), ("B: backward (full shade)", grey, "")]
    if any(b.kind == "R" for b in boxes):
        legend.append(("recompute (hatched, at the start of a backward)", grey, RECOMPUTE_HATCH))
    if packed:
        legend.append(("grey: chunk of whole sequences only", [_lighten(grey), grey], ""))
    for s in split[:8]:
        legend.append((f"sequence {s} ({int(lengths[s]):,} tok) in {slices[s]} chunks",
                       [_lighten(colors[s]), colors[s]], hatches[s]))
    if len(split) > 8:
        repeat = " (colours repeat)" if len(split) > len(SEQ_COLORS) * len(SEQ_HATCHES) else ""
        legend.append((f"... {plural(len(split) - 8, 'more cut sequence')}{repeat}", "white", ""))
    marks = []
    for r, pipes in enumerate(groups):  # where each later pipeline of a replica starts, over the replica's rows
        for i in pipes[1:]:  # (its first forward on the replica's first stage)
            starts = [b.start_s for b in boxes if b.row == r * P and b.label.startswith(f"F{i}.")]
            if starts:
                marks.append((min(starts), f"pipeline {i}", (r * P, (r + 1) * P)))
    marks.sort()
    layers = [f"layers {p * L_s}-{(p + 1) * L_s - 1}" if L_s > 1 else f"layer {p}" for p in range(P)]
    # past 16 rows (draw's tallest timeline) two-line labels overlap: one short line each ("r1 s3")
    labels = ([f"{where(r, p)}\n{layers[p]}" for r in range(R) for p in range(P)] if R * P <= 16 else
              [f"r{r} s{p}" if R > 1 else f"stage {p}" for r in range(R) for p in range(P)])
    idle = [((r + 0.5) * P, f"replica {r} idle: no sequence to run") for r, pipes in enumerate(groups) if not pipes]
    return PlotData("elastic_pp", _title(plan, cost, lengths, layout, res, detail), R * P, labels, boxes, memory,
                    memory_title, res.budget_mb / 1024, res.step_time_s, res.bubble_ratio, colors, legend, marks,
                    _slices_hist(plan, lengths), hatches, [float(r * P) for r in range(1, R)], styles, idle)


def _slices_hist(plan: StepPlan, lengths: np.ndarray) -> LengthHist:
    """Whole (in a chunk, maybe with others) or cut into k slices across chunks; k grouped by powers
    of two (2, 3-4, 5-8, ...) so that a few colours cover any K."""
    pieces = [x for p in plan.pipelines for c in p.chunks for x in c.pieces]
    slices = np.bincount([x.seq_id for x in pieces], minlength=len(lengths))
    keys = [1 << max(0, int(k) - 1).bit_length() for k in slices]  # 1 -> 1 (whole), 2 -> 2, 3..4 -> 4, 5..8 -> 8
    choices = {k: ("whole" if k == 1 else "cut in 2" if k == 2 else f"cut in {k // 2 + 1}-{k}",
                   PACKED_COLOR if k == 1 else SLICE_COLORS[min(k.bit_length() - 2, len(SLICE_COLORS) - 1)])
               for k in set(keys)}
    chunk_tokens = [sum(x.end - x.start for x in c.pieces) for p in plan.pipelines for c in p.chunks]
    marks = [(max(chunk_tokens), f"largest chunk {_tokens(max(chunk_tokens))}")] if chunk_tokens else []
    cut = [x.end - x.start for x in pieces if slices[x.seq_id] > 1]
    if cut:
        marks.append((max(cut), f"longest slice {_tokens(max(cut))}"))
    return _length_hist(plan, lengths, keys, choices, "how each ran: whole inside a chunk, or cut into slices "
                        "across chunks", marks)


def _aggregate_memory(curves, aggregates) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """(name, times s, GB) of ``agg`` over step ``curves`` (time s, MB corners), on the union of their
    breakpoints, for each (name, agg) of ``aggregates``."""
    grid = np.unique(np.concatenate([[x for x, _ in pts] for pts in curves])) if curves else np.zeros(1)
    levels = []
    for pts in curves:
        ts = np.array([x for x, _ in pts])
        vs = np.array([v for _, v in pts])
        # the level in force just after each grid time (right-continuous step)
        idx = np.searchsorted(ts, grid, side="right") - 1
        levels.append(vs[np.clip(idx, 0, len(vs) - 1)])
    lv = np.array(levels) / 1024 if levels else np.zeros((1, 1))
    step_t = np.repeat(grid, 2)[1:]
    return [(name, step_t, np.repeat(agg(lv, axis=0), 2)[:-1]) for name, agg in aggregates]


def _flexsp_data(plan: StepPlan, lengths: np.ndarray, cost: CostModel, res: SimResult) -> PlotData:
    boxes, marks = [], []
    degrees = set()
    degree_of = np.zeros(len(lengths), dtype=np.int64)  # per sequence: its group's degree (0: dropped)
    starts, times, _ = group_starts_ms(plan, lengths, cost)
    for m, (mb, t0s, mss) in enumerate(zip(plan.micro_batches, starts, times)):
        if not plan.barrier_free:  # (without a barrier, micro-batch m starts at different times on each GPU)
            marks.append((t0s[0] / 1e3 if t0s else 0.0, f"micro-batch {m}", (0, cost.num_gpus)))
        for g, t, ms in zip(mb.groups, t0s, mss):
            d = len(g.ranks)
            degrees.add(d)
            degree_of[g.seq_ids] = d
            boxes.append(Box(min(g.ranks), d, t / 1e3, (t + ms) / 1e3, "G", d, f"d{d}: {len(g.seq_ids)} seq"))
    n = cost.num_gpus
    # memory: max and mean over GPUs
    memory = _aggregate_memory(res.memory, (("max over GPUs", np.max), ("mean over GPUs", np.mean)))
    colors = {d: DEGREE_COLORS.get(d, DEGREE_COLORS[128]) for d in degrees}
    legend = [(f"SP group of degree {d}", colors[d], "") for d in sorted(degrees)]
    layout = plural(len(plan.micro_batches), "micro-batch", "micro-batches")
    n_groups = sum(len(mb.groups) for mb in plan.micro_batches)
    detail = (f"{plural(n_groups, 'Ulysses SP group')}; each box is one group: its GPUs (rows) busy with its "
              f"sequences for the group's time; a micro-batch ends with its slowest group")
    if plan.barrier_free:
        layout = f"{plural(len(plan.micro_batches), 'pass', 'passes')} at most per GPU, no barrier"
        detail = (f"{plural(n_groups, 'Ulysses SP group')}; each box is one group: its GPUs (rows) busy with its "
                  f"sequences for the group's time; a group starts as soon as its own GPUs are free")
    hist = _length_hist(plan, lengths, degree_of, {d: (f"degree {d}", colors[d]) for d in degrees},
                        "the degree of the SP group each ran in")
    return PlotData("flexsp", _title(plan, cost, lengths, layout, res, detail), n, [f"GPU {r}" for r in range(n)], boxes,
                    memory, "memory per GPU over the GPUs", res.budget_mb / 1024, res.step_time_s, res.bubble_ratio,
                    colors, legend, marks, hist)


# ---- drawing ---------------------------------------------------------------------------------

def _new_figure(**kw):
    """A matplotlib Figure of its own on an Agg canvas (no pyplot: the caller's backend and figures
    are left alone; text is measured and PNG, SVG or PDF written without a display)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:  # pragma: no cover - matplotlib is installed with megatron_ext
        raise ConfigError("--plot needs matplotlib: pip install matplotlib") from None
    fig = Figure(**kw)
    FigureCanvasAgg(fig)
    return fig


def _draw_timeline(ax, data: PlotData, fig_width_px: float):
    """Draw the boxes; returns what fits their labels once the figure's layout is final."""
    from matplotlib.colors import to_rgb
    from matplotlib.legend_handler import HandlerTuple
    from matplotlib.patches import Patch, Rectangle

    span = max(data.step_time_s, 1e-9)
    px_per_s = fig_width_px * 0.72 / span  # the axes' width once tight_layout has made room for the legend
    px_per_pt = ax.figure.dpi / 72

    def fits(text, size, px):  # DejaVu Sans: about 0.65 em per character
        return px >= len(text) * size * 0.65 * px_per_pt + 3

    labels = []
    for b in data.boxes:
        base = data.colors.get(b.key, PACKED_COLOR)
        face = _lighten(base) if b.kind == "F" else base
        hatch = RECOMPUTE_HATCH if b.kind == "R" else data.hatches.get(b.key) or None
        width = max(b.width_s, RECOMPUTE_MIN_PX / px_per_s) if b.kind == "R" else b.width_s
        pad = 0.08 if data.kind == "elastic_pp" else 0.04
        box = Rectangle((b.start_s, b.row + pad), width, b.height - 2 * pad, facecolor=face,
                        edgecolor="black" if b.kind != "G" else "white", linewidth=0.3, hatch=hatch,
                        zorder=1.5 if b.kind == "R" else 1)  # over the start of its backward when widened
        ax.add_patch(box)
        if b.kind == "R":
            continue
        # the label, else the chunk id alone and smaller (the shade tells F from B), else none: see _fit_labels
        r, g, bl = to_rgb(face)
        label = ax.text(b.start_s + b.width_s / 2, b.row + b.height / 2, "", ha="center", va="center",
                        color="white" if 0.299 * r + 0.587 * g + 0.114 * bl < 0.5 else "black")
        labels.append((label, box, [(b.label, 7), (b.label.lstrip("FB"), 6)]))
    if data.marks:  # named above the plot (the time ticks are below); just the number where crowded
        times = [t for t, _, _ in data.marks]
        ends = times[1:] + [span * 1.01]
        names = [text if fits(text, 7, (end - t) * px_per_s) else text.split()[-1]
                 for (t, text, _), end in zip(data.marks, ends)]
        for t, _, (first, end) in data.marks:  # rows grow downwards: row 0 is the axes' top (1)
            ax.axvline(t, 1 - end / data.rows, 1 - first / data.rows, color="black", linewidth=0.8, linestyle=":")
        top = ax.secondary_xaxis("top")
        top.set_xticks(times, names, fontsize=7, ha="left")
        top.tick_params(length=3, pad=1)
    ax.set_xlim(0, span * 1.01)
    ax.set_ylim(data.rows, 0)
    if data.kind == "elastic_pp":
        ax.set_yticks(np.arange(data.rows) + 0.5)
        ax.set_yticklabels(data.row_labels, fontsize=8 if data.rows <= 8 else 7)
        # two lines with replicas: one would overrun a timeline of 4 rows
        ax.set_ylabel("pipeline stage (each a Ulysses group)" if not data.separators else
                      f"{'replica, stage' if data.rows <= 16 else 'replica r, stage s'}\n(each stage a Ulysses group)")
        # replicas run side by side on their own GPUs: a line between them, every other one shaded, so a
        # replica's rows read as a block
        edges = [0.0] + data.separators + [float(data.rows)]
        for first, end in list(zip(edges, edges[1:]))[1::2]:
            ax.axhspan(first, end, color="#eef2f7", zorder=0)
        for y in data.separators:
            ax.axhline(y, color="black", linewidth=1.2)
        for y, text in data.notes:
            ax.text(span / 2, y, text, ha="center", va="center", fontsize=9, color="#555555")
    else:
        step = max(1, data.rows // 16)
        ticks = np.arange(0, data.rows, step)
        ax.set_yticks(ticks + 0.5)
        ax.set_yticklabels([data.row_labels[i] for i in ticks], fontsize=7)
        ax.set_ylabel("GPU")
    ax.set_xlabel("time (s)")
    ax.set_title(data.title, fontsize=10, loc="left")

    def swatch(c, h):
        return Patch(facecolor=c, edgecolor="black", linewidth=0.3, hatch=h or None)

    handles = [tuple(swatch(x, h) for x in c) if isinstance(c, list) else swatch(c, h) for _, c, h in data.legend]
    title = "boxes (narrow ones: chunk id alone)" if data.kind == "elastic_pp" else \
        "boxes: one per SP group\n(its sequences' time)"
    ax.legend(handles=handles, labels=[t for t, _, _ in data.legend], handler_map={tuple: HandlerTuple(None, pad=0)},
              loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=7, frameon=False, title=title, title_fontsize=8)
    return lambda: _fit_labels(ax, labels)


def _fit_labels(ax, labels) -> None:
    """Give each box the first of its texts that fits inside it, width and height (a degree-1 group of
    64 GPUs is too thin for any), measured on the final layout, else remove its label: a label is whole
    or absent, never spilling onto a neighbour (``ax.text`` is not clipped) nor cut short."""
    renderer = ax.figure.canvas.get_renderer()
    for label, box, texts in labels:
        room = box.get_window_extent(renderer)
        for text, size in texts:
            label.set_text(text)
            label.set_fontsize(size)
            ext = label.get_window_extent(renderer)
            if ext.width + 3 <= room.width and ext.height <= room.height:
                break
        else:
            label.remove()


def _draw_memory(ax, data: PlotData) -> None:
    import matplotlib

    cmap = matplotlib.colormaps["viridis"]
    unit, f = ("GB", 1.0) if data.budget_gb >= 2 else ("MB", 1024.0)  # tiny (CPU) clusters in MB
    styles = data.memory_styles or [(i, "-") for i in range(len(data.memory))]
    slots = max((k for k, _ in styles), default=0) + 1
    for (label, t, gb), (k, line) in zip(data.memory, styles):
        ax.plot(t, gb * f, label=label, color=cmap(k / max(1, slots - 1) * 0.85), linestyle=line, linewidth=1.1,
                zorder=3)
    # a wide pale band behind the curves: a peak right at the budget stays visible on it
    ax.axhline(data.budget_gb * f, color="#d62728", alpha=0.35, linestyle="--", linewidth=3.5, zorder=2,
               label=f"budget {data.budget_gb * f:.1f} {unit}")  # as precise as the title's peak
    ax.set_xlim(0, max(data.step_time_s, 1e-9) * 1.01)
    top = max([data.budget_gb] + [float(gb.max()) for _, _, gb in data.memory if len(gb)]) * f
    ax.set_ylim(0, top * 1.08)
    ax.set_xlabel("time (s)")
    ax.set_ylabel(f"memory per GPU ({unit})")
    ax.set_title(f"{data.memory_title}: model states + activations held between forward and backward",
                 fontsize=9, loc="left")
    ax.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=7, frameon=False)
    ax.grid(axis="y", linewidth=0.3, alpha=0.6)


def _draw_hist(ax, hist: LengthHist) -> None:
    """Per bucket (x: one slot per power of two), a bar of sequences (left axis) and a hatched bar
    of the bucket's share of the tokens (right axis), both stacked by choice."""
    from matplotlib.patches import Patch

    counts, share = hist.counts(), hist.token_share() * 100
    x = np.arange(counts.shape[1])
    tok_ax = ax.twinx()
    low_n, low_s = np.zeros(len(x)), np.zeros(len(x))
    label_bg = dict(boxstyle="square,pad=0.05", facecolor="white", edgecolor="none")  # hides a mark line behind
    for (label, color), n, sh in zip(hist.choices, counts, share):
        ax.bar(x + 0.08, n, 0.4, bottom=low_n, align="edge", color=color, edgecolor="black", linewidth=0.3)
        tok_ax.bar(x + 0.52, sh, 0.4, bottom=low_s, align="edge", color=color, edgecolor="black", linewidth=0.3,
                   hatch="///")
        low_n, low_s = low_n + n, low_s + sh
    for xi, n, sh in zip(x, low_n, low_s):  # totals on top: a bucket of 1 sequence is 1 px tall otherwise
        if n:
            ax.annotate(f"{n:.0f}", (xi + 0.28, n), xytext=(0, 1), textcoords="offset points", ha="center",
                        va="bottom", fontsize=7, bbox=label_bg)
        if sh >= 1:
            tok_ax.annotate(f"{sh:.0f}%", (xi + 0.72, sh), xytext=(0, 1), textcoords="offset points", ha="center",
                            va="bottom", fontsize=7, color="#444444", bbox=label_bg)
    # the marks are named in the legend, so no text of theirs lands on a bar label or on each other
    marks = [ax.axvline(np.log2(tokens / hist.edges[0]), color="black", linewidth=0.9, linestyle=style, label=text)
             for (tokens, text), style in zip(hist.marks, ["--", ":"])]  # bucket b spans [b, b + 1)
    ax.set_xlim(0, len(x))
    ax.set_xticks(np.arange(len(hist.edges)))
    ax.set_xticklabels([_tokens(e) for e in hist.edges], fontsize=8)
    ax.set_ylim(0, max(1.0, low_n.max()) * 1.18)
    tok_ax.set_ylim(0, max(1.0, low_s.max()) * 1.18)
    ax.set_xlabel("sequence length (tokens; buckets of powers of two)")
    ax.set_ylabel("sequences")
    tok_ax.set_ylabel("share of tokens (%)", color="#444444")
    ax.set_title(hist.title, fontsize=9, loc="left")
    handles = [Patch(facecolor=c, edgecolor="black", linewidth=0.3, label=t) for t, c in hist.choices]
    handles += [Patch(facecolor="white", edgecolor="black", linewidth=0.3, label="left bar: sequences"),
                Patch(facecolor="white", edgecolor="black", linewidth=0.3, hatch="///",
                      label="right bar: share of tokens")] + marks
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.045, 1.0), fontsize=7, frameon=False)


def draw(data: PlotData, path=None, *, extra=None):
    """Render ``data`` (timeline, memory, the length histogram; ``extra(ax)`` draws a last panel) to
    ``path``; returns the figure."""
    # pipelines: rows tall enough for two-line labels up to 16 rows, one line past that
    rows_h = (3.2 if data.rows <= 4 else min(8.0, 0.6 * data.rows)) if data.kind == "elastic_pp" else 4.2
    panels = [(rows_h, lambda ax: _draw_timeline(ax, data, ax.figure.get_figwidth() * ax.figure.dpi)),
              (2.0, lambda ax: _draw_memory(ax, data))]
    if data.hist is not None:
        panels.append((2.2, lambda ax: _draw_hist(ax, data.hist)))
    if extra:
        panels.append((1.8, extra))
    heights = [h for h, _ in panels]
    fig = _new_figure(figsize=(15, sum(heights) + 1.2))
    axes = fig.subplots(len(heights), 1, gridspec_kw={"height_ratios": heights})
    finish = [fill(ax) for ax, (_, fill) in zip(axes, panels)]
    fig.tight_layout()
    for f in finish:  # what needs the final layout (the timeline's labels)
        if f:
            f()
    if path is not None:
        name = Path(path).name
        with replacing(path) as tmp:  # (the format from the name: the temporary one's says nothing, nor ".png"'s suffix)
            fig.savefig(tmp, dpi=110, format=name.rsplit(".", 1)[1].lower() if "." in name else None)
    return fig


def plot_plan(plan: StepPlan, lengths, cost: CostModel, path, **kw) -> PlotData:
    """Simulate ``plan`` and write its picture to ``path`` (PNG, or any format matplotlib knows)."""
    data = plot_data(plan, lengths, cost, **kw)
    draw(data, path)
    return data


def plot_comparison(plan: StepPlan, lengths, cost: CostModel, summary: list[dict], main: str, path,
                    source: str = "", **kw) -> PlotData:
    """``megatron-ext simulate --plot``: the main planner's first step (timeline + memory) and the
    mean step time of every planner over all steps, split into busy and idle (bubble) time."""
    data = plot_data(plan, lengths, cost, **kw)
    data.title = "first step: " + data.title
    rows = [s for s in summary if "error" not in s]

    def bars(ax):
        names = [s["planner"] for s in rows]
        t = np.array([s["step_time_s"] for s in rows])
        idle = t * np.array([s["bubble_ratio"] for s in rows])
        y = np.arange(len(rows))
        ax.barh(y, t - idle, color=["#3182bd" if n == main else "#9ecae1" for n in names],
                label=f"busy (dark: {main}, drawn above)")
        ax.barh(y, idle, left=t - idle, color="#fdae6b", label="idle (bubble)")
        main_t = next((s["step_time_s"] for s in rows if s["planner"] == main), None)
        for yi, s, ti in zip(y, rows, t):
            note = f" {ti:.2f} s"
            if main_t and s["planner"] != main:
                note += f"  ({ti / main_t:.2f}x the time of {main})"
            ax.text(ti, yi, note, va="center", fontsize=7)
        ax.set_yticks(y)
        ax.set_yticklabels(names, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlim(0, t.max() * 1.35 if len(t) else 1)
        ax.set_xlabel("mean simulated step time (s)")
        ax.set_title(f"every planner on the same batches ({source})" if source else "every planner on the same batches",
                     fontsize=9, loc="left")
        ax.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=7, frameon=False)

    draw(data, path, extra=bars if rows else None)
    return data


__all__ = ["Box", "LengthHist", "PlotData", "draw", "plot_comparison", "plot_data", "plot_plan"]
