"""A regime map: which layout runs a step fastest, over GPUs x memory x context x model x lengths
x ZeRO stage. Per cell, one sampled batch (default 512 sequences up to the context) is planned by
FlexSP, elastic_pp, Seq1F1B, batch 1F1B, static Ulysses and ``auto`` (all at the time limit of
``megatron-ext simulate``, default 1 s) and timed by the same simulator (the three pipeline
planners on SP over a node and as many stages as divide the layers and the nodes, the rest of
the GPUs replicas; ``auto`` on every layout); the compute floor of the
batch (``CostModel.compute_floor_ms``) bounds every plan from below, and auto's bound (the least
of its candidates' lower bounds: FlexSP's and every layout's, ``PipelineCost.lower_bound_ms``)
every plan auto could choose: a target past it is out of reach on this cost model.

Clusters of N GPUs are the presets ``a100-40g-8x<N/8>`` (40 GB: 28 GB usable, the FlexSP
paper's) and ``a800-80g-8x<N/8>`` (80 GB: 72 GB usable, InfiniPipe's); models ``gpt-7b``,
``gpt-13b``, ``gpt-30b`` (the FlexSP paper's, 64 heads: Ulysses up to degree 64), or with
``--family llama`` ``llama-7b/13b/30b`` (32 / 40 / 52 heads: Ulysses up to 32 / 8 / 4, so FlexSP
holds far shorter sequences). A planner that cannot run a cell (model states over the memory, a
sequence no group holds) is marked in its row with the reason.

    .venv/bin/python benchmarks/regimes.py --out benchmarks/results/regimes       # the whole map
    .venv/bin/python benchmarks/regimes.py --gpus 32,128 --models 13b --jobs 2 --out runs/regimes
    .venv/bin/python benchmarks/regimes.py --planners auto --jobs 2 --out benchmarks/results/regimes  # auto anew

Runs in parts: rows go to ``<out>.json`` (the cells of earlier runs with the same ``--out`` are
kept, the ones rerun replaced), then ``<out>.csv``, ``<out>.md`` (the table and how far auto is
from the targets) and ``<out>.png`` (auto's speedup over FlexSP and auto / floor, per cell) are
written from every row there. ``--jobs N`` plans N cells at once in worker processes.
"""
from __future__ import annotations

import argparse
import csv
import itertools
import json
import os
from concurrent.futures import ProcessPoolExecutor

PLANNERS = ("flexsp", "elastic_pp", "seq1f1b", "batch_1f1b", "static_ulysses", "auto")
CLUSTERS = {40: "a100-40g-8x{nodes}", 80: "a800-80g-8x{nodes}"}
KEYS = ("model", "gpus", "memory_gb", "context", "dist", "zero")


def _tokens(text: str) -> int:
    text = text.strip().upper()
    return int(text[:-1]) * 1024 if text.endswith("K") else int(text)


def cell(spec: dict) -> dict:
    """One cell's row: every planner's simulated step (or why it cannot run), the floor, auto's choice."""
    from megatron_ext.commands.table import simulate_table
    from megatron_ext.cost import CostModel
    from megatron_ext.data.lengths import sample_lengths
    from megatron_ext.errors import MegatronExtError

    row = {k: spec[k] for k in KEYS}
    cluster = CLUSTERS[spec["memory_gb"]].format(nodes=spec["gpus"] // 8)
    cost = CostModel.from_presets(spec["model"], cluster, spec["zero"])
    row["cluster"] = cluster
    lengths = sample_lengths(spec["dist"], spec["batch"], spec["seed"], spec["context"])
    row["floor_s"] = cost.compute_floor_ms(lengths) / 1e3
    # the pipeline planners: SP over a node, as many stages as divide the layers and the nodes
    # (one per node where they do), the rest replicas; auto tries every layout itself
    sp = min(cost.cluster.gpus_per_node, cost.degrees[-1])
    for name in spec.get("planners", PLANNERS):
        layout = {"sp": sp} if name in ("elastic_pp", "seq1f1b", "batch_1f1b") else {}
        try:  # (each planner alone: a setup one cannot run must not hide the others)
            out = simulate_table(cost, lengths=lengths, planners=(name,), max_seq_len=spec["context"],
                                 time_limit=spec["time_limit"], **layout)
            r = out["rows"][0]
        except MegatronExtError as e:
            r = {"error": str(e)}
        if "error" in r:
            row[f"{name}_error"] = r["error"]
            continue
        row[f"{name}_s"] = r["step_time_s"]
        row[f"{name}_plan_s"] = r["solve_time_s"]
        if layout:
            row["pipeline_layout"] = f"pp{out['config']['pp']} x sp{out['config']['sp']}"
        if name == "auto":
            row["auto_chose"] = r["status"][len("auto chose "):].split(" (", 1)[0]
            row["bound_s"] = r["lower_bound_s"]  # (no plan of any of auto's candidates is faster)
    return row


def derived(row: dict) -> dict:
    """auto / floor, auto's speedup over FlexSP and Seq1F1B, FlexSP / floor, auto / best other, the
    bound / floor and auto / bound (None where one did not run)."""
    def ratio(a, b):
        return row[a] / row[b] if a in row and b in row else None

    others = [row[f"{p}_s"] for p in PLANNERS if p != "auto" and f"{p}_s" in row]
    return {"auto_over_floor": ratio("auto_s", "floor_s"), "auto_vs_flexsp": ratio("flexsp_s", "auto_s"),
            "auto_vs_seq1f1b": ratio("seq1f1b_s", "auto_s"), "flexsp_over_floor": ratio("flexsp_s", "floor_s"),
            "auto_over_best_other": row["auto_s"] / min(others) if "auto_s" in row and others else None,
            "bound_over_floor": ratio("bound_s", "floor_s"), "auto_over_bound": ratio("auto_s", "bound_s")}


def targets(row: dict) -> str:
    """Where auto stands against the targets (auto <= 1.15x floor and >= 1.10x over FlexSP; where
    FlexSP is >= 1.5x the floor: auto <= 1.35x floor, >= 1.3x over FlexSP, >= 1.2x over Seq1F1B)."""
    d = derived(row)
    if d["auto_over_floor"] is None:
        return "auto did not run"
    hard = d["flexsp_over_floor"] is not None and d["flexsp_over_floor"] >= 1.5
    floor_t, flex_t = (1.35, 1.3) if hard else (1.15, 1.10)
    bound = d["bound_over_floor"]  # (no plan of auto's candidates is faster: over a target, out of reach)
    miss = []

    def speedup_miss(name: str, speedup: float, target: float, other_s: float) -> str:
        # the target needs auto at the other planner's step / target (below the bound: out of reach)
        need = other_s / target / row["floor_s"]
        return (f"vs {name} {speedup:.2f}x < {target} (needs auto at {need:.2f}x the floor" +
                (f", under the bound's {bound:.2f}x: out of reach)" if bound is not None and bound > need else ")"))

    if d["auto_over_floor"] > floor_t:
        miss.append(f"floor {d['auto_over_floor']:.2f}x > {floor_t}" +
                    (f" (out of reach: bound {bound:.2f}x)" if bound is not None and bound > floor_t else ""))
    if d["auto_vs_flexsp"] is not None and d["auto_vs_flexsp"] < flex_t:
        miss.append(speedup_miss("flexsp", d["auto_vs_flexsp"], flex_t, row["flexsp_s"]))
    if hard and d["auto_vs_seq1f1b"] is not None and d["auto_vs_seq1f1b"] < 1.2:
        miss.append(speedup_miss("seq1f1b", d["auto_vs_seq1f1b"], 1.2, row["seq1f1b_s"]))
    note = " (FlexSP cannot run)" if d["auto_vs_flexsp"] is None else ""
    return ("; ".join(miss) if miss else "met") + note


def _key(row: dict) -> tuple:
    return tuple(row[k] for k in KEYS)


def _fmt(v, spec="{:.2f}") -> str:
    return "-" if v is None else spec.format(v)


def markdown(rows: list[dict]) -> str:
    head = ["model", "GPUs", "GB", "ctx", "lengths", "ZeRO", "floor s", "bound s"] + [f"{p} s" for p in PLANNERS] + \
        ["auto chose", "auto / floor", "auto / bound", "auto vs flexsp", "auto / best other", "targets"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in sorted(rows, key=_key):
        d = derived(r)
        cells = [r["model"], str(r["gpus"]), str(r["memory_gb"]), f"{r['context'] // 1024}K", r["dist"],
                 str(r["zero"]), f"{r['floor_s']:.2f}", _fmt(r.get("bound_s"))]
        cells += [_fmt(r.get(f"{p}_s")) if f"{p}_s" in r else "n/a" for p in PLANNERS]
        cells += [r.get("auto_chose", "-"), _fmt(d["auto_over_floor"]), _fmt(d["auto_over_bound"]),
                  _fmt(d["auto_vs_flexsp"], "{:.2f}x"), _fmt(d["auto_over_best_other"]), targets(r)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + ("\n\nn/a: the planner cannot run the cell (its reason is in the JSON rows). "
                               "bound: no plan of any of auto's candidates is faster (the least of their lower "
                               "bounds). auto / best other: auto's step over the fastest other planner's.\n")


def _kind(chose: str) -> str:
    """auto's choice as a kind of layout: FlexSP (with or without barriers: ``timelines``), one-stage
    replicas, or a pipeline (pp > 1)."""
    if chose in ("flexsp", "timelines"):
        return "FlexSP"
    return "replicas" if chose.startswith("elastic_pp pp1 ") else "pipeline"


def summary(rows: list[dict]) -> str:
    """One line per memory x GPUs x context: cells auto ran, what it chose, and the ranges of
    auto / floor, auto / bound, auto over FlexSP and Seq1F1B, FlexSP / floor and auto / best other."""
    def span(vals, fmt="{:.2f}"):
        vals = [v for v in vals if v is not None]
        return "-" if not vals else f"{fmt.format(min(vals))}-{fmt.format(max(vals))}"

    head = ["GB", "GPUs", "ctx", "auto ran", "auto chose", "auto / floor", "auto / bound", "auto vs flexsp",
            "auto vs seq1f1b", "flexsp / floor", "auto / best other"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for mem, gpus, ctx in sorted({(r["memory_gb"], r["gpus"], r["context"]) for r in rows}):
        cells = [r for r in rows if (r["memory_gb"], r["gpus"], r["context"]) == (mem, gpus, ctx)]
        ran = [r for r in cells if "auto_s" in r]
        d = [derived(r) for r in ran]
        kinds = {}
        for r in ran:
            kinds[_kind(r["auto_chose"])] = kinds.get(_kind(r["auto_chose"]), 0) + 1
        lines.append("| " + " | ".join([
            str(mem), str(gpus), f"{ctx // 1024}K", f"{len(ran)} of {len(cells)}",
            ", ".join(f"{k} {v}" for k, v in sorted(kinds.items())) or "-",
            span(x["auto_over_floor"] for x in d), span(x["auto_over_bound"] for x in d),
            span((x["auto_vs_flexsp"] for x in d), "{:.2f}x"),
            span((x["auto_vs_seq1f1b"] for x in d), "{:.2f}x"), span(x["flexsp_over_floor"] for x in d),
            span(x["auto_over_best_other"] for x in d)]) + " |")
    return "\n".join(lines) + "\n"


def heatmap(rows: list[dict], path: str) -> None:
    """Two panels, auto's speedup over FlexSP and auto / floor: a row per model x lengths x ZeRO,
    a column per memory x GPUs x context; cells without a value hatched."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    import numpy as np

    ys = sorted({(r["model"], r["dist"], r["zero"]) for r in rows})
    xs = sorted({(r["memory_gb"], r["gpus"], r["context"]) for r in rows})
    by = {((r["model"], r["dist"], r["zero"]), (r["memory_gb"], r["gpus"], r["context"])): derived(r) for r in rows}
    fig = Figure(figsize=(max(6.0, 0.75 * len(xs) + 3), 2 * (0.42 * len(ys) + 1.6)))
    FigureCanvasAgg(fig)
    panels = (("auto_vs_flexsp", "auto's speedup over FlexSP (x)", "RdYlGn", 0.8, 1.6),
              ("auto_over_floor", "auto's step / the compute floor", "RdYlGn_r", 1.0, 2.0))
    for i, (key, title, cmap, lo, hi) in enumerate(panels):
        ax = fig.add_subplot(2, 1, i + 1)
        grid = np.full((len(ys), len(xs)), np.nan)
        for (y, x), d in by.items():
            if d[key] is not None:
                grid[ys.index(y), xs.index(x)] = d[key]
        ax.set_facecolor("#eeeeee")
        im = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, vmin=lo, vmax=hi, aspect="auto")
        for yi, xi in itertools.product(range(len(ys)), range(len(xs))):
            v = grid[yi, xi]
            ax.text(xi, yi, "n/a" if np.isnan(v) else f"{v:.2f}", ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(xs)))
        ax.set_xticklabels([f"{m} GB\n{g} GPUs\n{c // 1024}K" for m, g, c in xs], fontsize=7)
        ax.set_yticks(range(len(ys)))
        ax.set_yticklabels([f"{m} {d} Z{z}" for m, d, z in ys], fontsize=7)
        ax.set_title(title + " (columns: memory, GPUs, context)", fontsize=9, loc="left")
        fig.colorbar(im, ax=ax, fraction=0.03, pad=0.01)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", default="32,64,128,256")
    ap.add_argument("--memory", default="40,80", help="GB per GPU: 40 (a100-40g-8xN), 80 (a800-80g-8xN)")
    ap.add_argument("--contexts", default="48K,96K,192K")
    ap.add_argument("--models", default="7b,13b,30b")
    ap.add_argument("--family", default="gpt", choices=("gpt", "llama"))
    ap.add_argument("--dists", default="commoncrawl,github")
    ap.add_argument("--zero", default="1,3")
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time-limit", type=float, default=1.0, help="planning time limit per planner (default 1 s)")
    ap.add_argument("--jobs", type=int, default=1, help="cells planned at once, in worker processes")
    ap.add_argument("--out", default="regimes", help="path prefix of the .json, .csv, .md and .png written")
    ap.add_argument("--redraw", action="store_true", help="plan nothing: the .csv, .md and .png from <out>.json")
    ap.add_argument("--planners", default=",".join(PLANNERS),
                    help="the planners to (re)plan in each cell; the others' results stay as <out>.json has them")
    args = ap.parse_args()
    ints = lambda text: [int(x) for x in text.split(",") if x]  # noqa: E731
    grid = itertools.product(ints(args.gpus), ints(args.memory), args.contexts.split(","), args.models.split(","),
                             args.dists.split(","), ints(args.zero))
    specs = [{"model": f"{args.family}-{m}", "gpus": g, "memory_gb": mem, "context": _tokens(c), "dist": d, "zero": z,
              "batch": args.batch, "seed": args.seed, "time_limit": args.time_limit,
              "planners": tuple(p for p in args.planners.split(",") if p)}
             for g, mem, c, m, d, z in ([] if args.redraw else grid)]
    store = args.out + ".json"
    rows = {}
    if os.path.exists(store):
        with open(store) as f:
            rows = {_key(r): r for r in json.load(f)}
    os.makedirs(os.path.dirname(os.path.abspath(store)), exist_ok=True)

    replanned = tuple(p for p in args.planners.split(",") if p)

    def save(row: dict) -> None:  # after every cell: a run cut short keeps what it planned
        pipelines = any(p in ("elastic_pp", "seq1f1b", "batch_1f1b") for p in replanned)
        kept = {k: v for k, v in rows.get(_key(row), {}).items()  # the planners not replanned
                if not any(k.startswith(f"{p}_") for p in replanned) and not (k == "pipeline_layout" and pipelines)}
        rows[_key(row)] = {**kept, **row}
        print(_progress(rows[_key(row)]), flush=True)  # (with the kept planners: auto vs flexsp)
        with open(store, "w") as f:
            json.dump(sorted(rows.values(), key=_key), f, indent=1)

    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as pool:
            for row in pool.map(cell, specs):
                save(row)
    else:
        for spec in specs:
            save(cell(spec))
    out = sorted(rows.values(), key=_key)
    fields = list(dict.fromkeys(k for r in out for k in (*r, *derived(r))))
    with open(args.out + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fields)
        w.writeheader()
        for r in out:
            w.writerow({**r, **derived(r)})
    with open(args.out + ".md", "w") as f:
        f.write(summary(out) + "\n" + markdown(out))
    heatmap(out, args.out + ".png")
    print(f"{len(out)} cells in {store}, {args.out}.csv, {args.out}.md, {args.out}.png")


def _progress(row: dict) -> str:
    d = derived(row)
    return (f"{row['model']} {row['gpus']} GPUs {row['memory_gb']} GB {row['context'] // 1024}K {row['dist']} "
            f"ZeRO-{row['zero']}: auto {_fmt(row.get('auto_s'))} s ({row.get('auto_chose', '-')}), "
            f"/ floor {_fmt(d['auto_over_floor'])}, vs flexsp {_fmt(d['auto_vs_flexsp'])}")


if __name__ == "__main__":
    main()
