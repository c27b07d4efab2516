"""megatron_psrl: training-time prefix sharing for agentic RL on Megatron-core."""

import sys

from setuptools import find_packages, setup

# megatron-core 0.17+ declares Requires-Python >= 3.12; on 3.11 the 0.16 line is the newest.
if sys.version_info < (3, 12):
    MEGATRON_CORE = "megatron-core>=0.16.1,<0.17"
else:
    MEGATRON_CORE = "megatron-core>=0.16.1"

setup(
    name="megatron_psrl",
    version="0.1.0",
    description=(
        "Exact training-time prefix sharing (tree packing + prefix K/V reuse) for the update "
        "phase of agentic RL on Megatron-core"
    ),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_psrl", "megatron_psrl.*"]),
    install_requires=[
        "torch>=2.4",
        MEGATRON_CORE,
        "safetensors>=0.4",
        "numpy>=1.24",
        "tqdm>=4.60",
        "pyarrow>=14",
        "matplotlib>=3.7",
        # megatron-core's torch_dist checkpoint writer reports its memory with psutil (it raises without it).
        "psutil>=5.9",
    ],
    extras_require={
        # GPU kernels; apex (fused norms / optimizers) is optional and built from source,
        # see docs/installation.md.
        "gpu": ["transformer-engine[pytorch]>=1.13", "flash-attn>=2.6"],
        # pytest-randomly: the suite runs in a random order, its seed printed (README, "Testing").
        # transformers 5.10+: the per-sample references of every family, Qwen3.5 and Qwen3-Next included
        "test": ["pytest>=7", "pytest-randomly>=3.15", "transformers>=5.10", "hypothesis>=6", "tensorboard>=2.14"],
        # The verl training engine (megatron_psrl.integrations.verl; docs/integrations.md). verl is
        # pinned: its engine interface changes between releases. uvicorn and fastapi: verl's worker
        # layer (verl.workers.engine_workers, the TrainingWorker tests) imports them, and verl does
        # not declare them.
        "verl": ["verl==0.9.1", "uvicorn", "fastapi"],
        # Experiment tracking (--tensorboard-dir needs tensorboard, --wandb-project needs wandb).
        "logging": ["tensorboard>=2.14", "wandb>=0.16"],
    },
    scripts=[],
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
