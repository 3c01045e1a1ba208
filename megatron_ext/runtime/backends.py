"""The attention backends by name, torch-free: argument parsers and launchers list them without
importing torch or megatron-core. ``runtime/attention.py`` implements them."""

ATTENTION_BACKENDS = ("auto", "sdpa", "flash", "te")
# What "auto" tries, in order, where it can run the call (CUDA, fp16/bf16, a head size its kernels
# take, the package installed); else SDPA.
AUTO_ORDER = ("flash", "te")
