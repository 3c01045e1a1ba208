from setuptools import find_packages, setup

setup(
    name="megatron_ext",
    version="0.1.0",
    description="Adaptive sequence parallelism (FlexSP) and elastic pipelines for Megatron-core "
                "on long-tailed sequence lengths",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_ext", "megatron_ext.*"]),
    # the model and cluster presets that `--model NAME` / `--cluster NAME` resolve
    package_data={"megatron_ext": ["presets/models/*.yaml", "presets/clusters/*.yaml"]},
    install_requires=[
        # A range, not a pin, so the torch preinstalled in NVIDIA's NGC PyTorch containers
        # (2.8.0a0+5228986c39, 2.9.0a0+..., 2.10.0a0+...) stays; the floor is megatron-core
        # 0.16.1's own (torch>=2.6.0), and the Makefile installs the CPU wheel 2.13.0 here. Those
        # container versions are pre-releases with a local label: pip tests an installed
        # distribution against a requirement with prereleases=True, and 2.9.0a0+x >= 2.6 is true,
        # so it keeps them rather than fetching another torch.
        "torch>=2.6,<3",
        "megatron-core==0.16.1",
        "highspy>=1.7",
        "numpy>=1.24",
        "pyyaml>=6",
        "tokenizers>=0.20",
        "matplotlib>=3.7",  # --plot
        "scipy>=1.10",  # profile's non-negative least squares
        "tqdm>=4.60",  # progress bars
        "psutil>=5.9",  # megatron-core's checkpoint writers (train --save) call it
    ],
    extras_require={
        "dev": ["pytest>=8", "hypothesis>=6"],
        "gpu": ["flash-attn>=2.5", "transformer-engine[pytorch]>=2.0"],
        # what Megatron-LM's training code imports beyond megatron-core (docs/megatron.md)
        "megatron-lm": ["six", "regex", "pydantic", "pybind11"],
    },
    entry_points={"console_scripts": ["megatron-ext=megatron_ext.commands.cli:main"]},
)
