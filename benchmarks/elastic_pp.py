"""Simulated comparison of elastic pipelines (InfiniPipe) with FlexSP, Seq1F1B, batch 1F1B and
static Ulysses on the InfiniPipe setting: LLaMA-13B-like model, 32 A800-80GB (4 nodes x 8),
CommonCrawl-like and GitHub-like lengths, 48K and 96K max context, batch 512.

    .venv/bin/python benchmarks/elastic_pp.py [--steps 5] [--model llama-13b] [--b1-scale 1 zero]

``--b1-scale zero`` uses PipelineCost.zero_domain_b1_scale() (the per-chunk fixed cost of a stage
that shards its parameters inside its node; see cost/pipeline.py).
"""
from __future__ import annotations

import argparse

from megatron_ext.cost import CostModel
from megatron_ext.cost.pipeline import PipelineCost, default_layout
from megatron_ext.sim import simulate_table


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-13b")
    ap.add_argument("--cluster", default="a800-80g-8x4")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--dists", default="commoncrawl,github")
    ap.add_argument("--contexts", default="48K,96K")
    ap.add_argument("--b1-scale", nargs="+", default=["1", "zero"])
    args = ap.parse_args()
    cost = CostModel.from_presets(args.model, args.cluster)
    pp, sp = default_layout(cost)
    for scale in args.b1_scale:
        b1 = PipelineCost(cost, pp, sp).zero_domain_b1_scale() if scale == "zero" else float(scale)
        for dist in args.dists.split(","):
            for ctx in args.contexts.split(","):
                max_len = int(ctx.rstrip("K")) * 1024
                out = simulate_table(cost, dist=dist, batch=args.batch, steps=args.steps, max_seq_len=max_len,
                                     b1_scale=b1)
                print(out["table"].split("\n\nstep s:")[0], "\n")


if __name__ == "__main__":
    main()
