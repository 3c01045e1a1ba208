"""Simulated comparison of elastic pipelines (InfiniPipe) with FlexSP, Seq1F1B, batch 1F1B, static
Ulysses and ``auto`` (the faster of FlexSP and elastic_pp on every layout, per step) on the
InfiniPipe setting: LLaMA-13B, 32 A800-80GB (4 nodes x 8), CommonCrawl-like and GitHub-like
lengths, 48K and 96K max context, batch 512. Everything goes through the same simulator.

    .venv/bin/python benchmarks/elastic_pp.py                 # the tables of docs/elastic_pp.md
    .venv/bin/python benchmarks/elastic_pp.py --plots docs/img --crossover
    .venv/bin/python benchmarks/elastic_pp.py --b1-scale 1 --pp 2 --sp 8   # two replicas of 2 stages

``--b1-scale`` takes numbers: what-if multipliers of a chunk's fixed cost, which cost/fixed.py
derives (1: as derived; docs/cost_model.md).
``--plots DIR`` writes the figures of the doc (first step of the first setting); ``--crossover``
finds, per setting, the b1_scale below which elastic_pp beats FlexSP on the first step.
"""
from __future__ import annotations

import argparse
import os

import numpy as np

from megatron_ext.commands.table import DEFAULT_PLANNERS, simulate_table
from megatron_ext.cost import CostModel
from megatron_ext.data.lengths import sample_lengths


def _scale(text: str, cost: CostModel) -> float:
    return float(text)


def crossover(cost: CostModel, lengths: np.ndarray, lo: float = 0.0, hi: float = 1.0, iters: int = 7) -> float | None:
    """The b1_scale at which elastic_pp (pp x sp of the default layout) takes as long as FlexSP on
    this batch (bisection; None if elastic_pp is slower even at ``lo``, ``hi`` if faster at ``hi``)."""
    from megatron_ext.planner.api import make_plan
    from megatron_ext.planner.pp.elastic_pp import plan_elastic_pp

    flex = make_plan("flexsp", lengths, cost).estimated_step_time_s

    def faster(x: float) -> bool:
        return plan_elastic_pp(lengths, cost, b1_scale=x).estimated_step_time_s < flex

    if not faster(lo):
        return None
    if faster(hi):
        return hi
    for _ in range(iters):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if faster(mid) else (lo, mid)
    return (lo + hi) / 2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-13b")
    ap.add_argument("--cluster", default="a800-80g-8x4")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--dists", default="commoncrawl,github")
    ap.add_argument("--contexts", default="48K,96K")
    ap.add_argument("--b1-scale", nargs="+", default=["1", "0"])
    ap.add_argument("--pp", type=int, help="pipeline stages of every pipeline planner (default: one per node)")
    ap.add_argument("--sp", type=int, help="Ulysses degree of a stage; pp x sp below the GPUs: replicas side by side")
    ap.add_argument("--planners", default=",".join(DEFAULT_PLANNERS))
    ap.add_argument("--plots", metavar="DIR", help="write the doc's figures (first step of the first setting) here")
    ap.add_argument("--crossover", action="store_true", help="b1_scale where elastic_pp meets FlexSP, per setting")
    args = ap.parse_args()
    cost = CostModel.from_presets(args.model, args.cluster)
    planners = tuple(p for p in args.planners.split(",") if p)
    summary = []
    for si, scale in enumerate(args.b1_scale):
        b1 = _scale(scale, cost)
        for di, dist in enumerate(args.dists.split(",")):
            for ci, ctx in enumerate(args.contexts.split(",")):
                max_len = int(ctx.rstrip("Kk")) * 1024
                first = args.plots and di == 0 and ci == 0
                out = simulate_table(cost, dist=dist, batch=args.batch, steps=args.steps, max_seq_len=max_len,
                                     pp=args.pp, sp=args.sp, b1_scale=b1, planners=planners, keep_plans=bool(first))
                print(out["table"].split("\n\nstep s:")[0], "\n")
                by = {s["planner"]: s for s in out["summary"]}
                row = {"b1_scale": b1, "dist": dist, "ctx": ctx, **{k: v for k, v in by.items()}}
                if args.crossover:
                    row["crossover"] = crossover(cost, sample_lengths(dist, args.batch, 0, max_len))
                row["auto_choices"] = out["config"].get("auto_choices", {})
                row["ceiling_over_flexsp"] = out["floor"]["ceiling"].get("flexsp")
                summary.append(row)
                if first:
                    _figures(args.plots, cost, out, b1, f"b1-{scale}", others=si == 0)
    _print_summary(summary)


def _figures(directory: str, cost: CostModel, out: dict, b1: float, tag: str, others: bool) -> None:
    """elastic_pp's first step with every planner's bars (``elastic_pp_<tag>.png``) and, with
    ``others``, the first steps of seq1f1b and flexsp (``<planner>_timeline.png``)."""
    from megatron_ext.commands.plot import plot_comparison, plot_plan

    os.makedirs(directory, exist_ok=True)
    plans = out["plans"]
    written = []
    if "elastic_pp" in plans:
        plan, lens = plans["elastic_pp"]
        path = os.path.join(directory, f"elastic_pp_{tag}.png")
        source = f"{out['config']['source']}; b1_scale {b1:.3g}"
        plot_comparison(plan, lens, cost, out["summary"], "elastic_pp", path, source, b1_scale=b1)
        written.append(path)
    for name in ("seq1f1b", "flexsp") if others else ():
        if name in plans:
            plan, lens = plans[name]
            path = os.path.join(directory, f"{name}_timeline.png")
            plot_plan(plan, lens, cost, path, b1_scale=b1)
            written.append(path)
    print("figures:", ", ".join(written), "\n")


def _print_summary(rows: list[dict]) -> None:
    def cell(row, name, key="step_time_s"):
        s = row.get(name)
        return None if not s or "error" in s else s.get(key)

    head = (f"{'b1_scale':>8} {'data':<12}{'ctx':>4} {'elastic_pp s':>12} {'bubble':>7} {'vs flexsp':>9} {'vs seq1f1b':>10} "
            f"{'vs batch_1f1b':>13} {'ceiling':>8} {'auto s':>7}  auto chose")
    print("summary (speedup = that planner's total time / elastic_pp's; ceiling: FlexSP's total time / the "
          "compute floor's, the most any plan could gain over FlexSP; auto: choices over the steps)")
    print(head)
    for r in rows:
        e = cell(r, "elastic_pp")
        parts = [f"{r['b1_scale']:>8.3g} {r['dist']:<12}{r['ctx']:>4}",
                 f"{e:>12.2f}" if e else f"{'-':>12}",
                 f"{cell(r, 'elastic_pp', 'bubble_ratio'):>7.1%}" if e else f"{'-':>7}"]
        for name, w in (("flexsp", 9), ("seq1f1b", 10), ("batch_1f1b", 13)):
            sp = cell(r, name, "speedup_of_elastic_pp")
            parts.append(f"{sp:>{w - 1}.2f}x" if sp else f"{'-':>{w}}")
        c = r.get("ceiling_over_flexsp")
        parts.append(f"{c:>7.2f}x" if c else f"{'-':>8}")
        a = cell(r, "auto")
        parts.append(f"{a:>7.2f}" if a else f"{'-':>7}")
        parts.append(" " + ", ".join(f"{k} x{v}" for k, v in r.get("auto_choices", {}).items()))
        if "crossover" in r:
            c = r["crossover"]
            parts.append(f"  (elastic_pp beats flexsp below b1_scale {c:.2f})" if c is not None else
                         "  (elastic_pp never beats flexsp)")
        print(" ".join(parts))


if __name__ == "__main__":
    main()
