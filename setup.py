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
    install_requires=[
        "torch==2.13.0",
        "megatron-core==0.16.1",
        "highspy>=1.7",
        "numpy>=1.24",
        "pyyaml>=6",
        "tokenizers>=0.20",
        "matplotlib>=3.7",  # --plot
    ],
    extras_require={
        "dev": ["pytest>=8", "hypothesis>=6"],
        "gpu": ["flash-attn>=2.5", "transformer-engine[pytorch]>=2.0"],
        # what Megatron-LM's training code imports beyond megatron-core (docs/megatron.md)
        "megatron-lm": ["six", "regex", "pydantic", "pybind11", "psutil"],
    },
    entry_points={"console_scripts": ["megatron-ext=megatron_ext.cli:main"]},
)
