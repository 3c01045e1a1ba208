"""The data of a run: documents, the global batch of each step, and its plan one step ahead.

- ``lengths``: lengths files, synthetic long-tailed distributions, documents cut at a maximum length;
- ``corpus``, ``tokenizer``: the demo corpus (the Python standard library) and two offline tokenizers;
- ``datasets``: Megatron indexed datasets and blends, read as whole documents;
- ``batches``: which documents each step's global batch holds (``GlobalBatches``);
- ``loader``: ``PlanningDataLoader``, a ``Step`` per training step, planned one step ahead by the
  planner process of ``plan_worker``, with fallback plans, broadcast and digest checks;
- ``sharding``: which tokens of a step each rank holds (``rank_part``).

No torch at module level: torch.distributed is imported only by the functions that broadcast a
plan, so the planner process stays torch-free.
"""
