"""Glue to Megatron-LM: ``pretrain_gpt.py --flexsp`` and ``--elastic-pp`` (docs/megatron.md).

- ``arguments``: the argument group (--flexsp, --elastic-pp, ...) and the check that explains conflicts;
- ``hooks``: ``wrap_pretrain_gpt``, what the patched pretrain_gpt.py installs (patches/);
- ``step``: the datasets provider and forward-backward functions of --flexsp and --elastic-pp runs, and their logs;
- ``data``: mock and indexed documents, splits, the planning data loader of a split;
- ``model``: Megatron's GPT (or its pipeline stage) with Ulysses core attention;
- ``cost``: ``--cost-model`` references and the SP-degree cap (pure Python: the planner process loads it);
- ``launch``: runs a Megatron-LM script, on CPU ranks when there is no CUDA.

Only ``step`` imports torch when loaded; megatron-core and Megatron-LM (``megatron.training``) are
imported inside the functions that use them, so ``arguments`` and ``cost`` load without either.
"""
