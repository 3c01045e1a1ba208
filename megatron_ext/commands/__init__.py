"""The ``megatron-ext`` commands: parsing their options, starting their ranks, printing what they
find and writing the files the user asks for. The top layer: the engines below (spec, cost, plan,
sim, planner, data, runtime, megatron) import nothing from here (tests/unit/test_layers.py).

- ``cli``: the entry point ``main`` (the ``megatron-ext`` console script; ``python -m
  megatron_ext.commands.cli``); ``args``: the argument groups commands share;
- ``plan``, ``simulate`` (with ``table``: the comparison of every planner), ``bench``, ``report``:
  one module per command; ``plot``: the pictures of ``--plot``;
- ``train`` and ``profile``: the launcher side of each and the module every rank runs under
  torchrun (``launch``: the checks before any rank starts, then runtime/supervisor.py);
  ``scale``: ``bench planner --gpus``, plan quality and latency across cluster sizes.
"""
