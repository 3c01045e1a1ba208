"""Elastic pipelines (InfiniPipe) and their baselines: each step as chunks through pipeline stages.

``elastic_pp``: the planner (``grouping``: sequences over replicas and consecutive pipelines;
``chunk_search`` and ``chunking``: one pipeline's chunks; ``checkpointing``: per-chunk recompute;
``sequence_limits``: the longest sequence a layout runs); ``pipeline_baselines``: batch 1F1B and
Seq1F1B; ``pipeline``: what they share (options, building and scoring one pipeline, the plan).
"""
