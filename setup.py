"""megashard: the parallel-state layer for large-model training on PyTorch."""
from setuptools import find_packages, setup

setup(
    name="megashard",
    version="0.1.0",
    description="Named device meshes, Megatron-compatible process groups and sharding utilities for PyTorch",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["megashard", "megashard.*"]),
    python_requires=">=3.10",
    # torch 2.11-2.15 is supported (CI: the suite on 2.13.0, the CPU build on local disk; the release-sensitive
    # tests on 2.11.0 and 2.15.0 from PyPI); the cap is the newest release tested.
    install_requires=["torch>=2.11,<2.16", "pyyaml>=6"],
    extras_require={
        "te": ["transformer-engine[pytorch]"],
        "dev": ["pytest>=8"],
        "plot": ["matplotlib"],
        "tensorboard": ["tensorboard>=2.10"],  # train.tensorboard: event files under the run directory
        "wandb": ["wandb>=0.17"],  # train.wandb: offline | online
        "data": ["tokenizers>=0.15"],
        "hf": ["safetensors>=0.4"],
        "hf-test": ["safetensors>=0.4", "transformers>=4.45"],
        # not installed by tools/setup.sh: with it, tests also build Megatron's GPTModel on state.pg_collection()
        "megatron-test": ["megatron-core>=0.16"],
    },
    entry_points={"console_scripts": ["megashard=megashard.cli:main"]},
)
