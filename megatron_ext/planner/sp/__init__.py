"""FlexSP and its baselines: each step as micro-batches of sequence-parallel (Ulysses) groups.

``flexsp``: FlexSP (``blaster``: its micro-batch splits and buckets); ``baselines``: static
Ulysses, BatchAda, megatron-core's BalancedCPScheduler; ``timelines``: FlexSP without barriers
between micro-batches (ZeRO 0/1/2); ``step``: their groups as a StepPlan, placed on rank blocks by
``placement``.
"""
