"""The attention backends by name, torch-free: argument parsers and launchers list them without
importing torch or megatron-core. ``runtime/kernels/<name>.py`` implements each (an ``AttentionKernel``
with that ``name``); a new backend is that module and its name here."""

ATTENTION_BACKENDS = ("auto", "sdpa", "flash", "te")
# What "auto" tries, in order, where it can run the call (CUDA, fp16/bf16, a head size its kernels
# take, the package installed); else SDPA.
AUTO_ORDER = ("flash", "te")
