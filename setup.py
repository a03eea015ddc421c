from setuptools import find_packages, setup

setup(
    name="megatron-oases",
    version="0.1.0",
    description="Oases overlapped tensor-model-parallel training and per-layer TMP planning for "
    "Megatron-Core",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["megatron_oases", "megatron_oases.*"]),
    # cluster profiles, model configs, the comparison matrix: megatron_oases.resources finds them
    package_data={"megatron_oases": ["py.typed", "configs/*.yaml", "configs/*/*.yaml"]},
    python_requires=">=3.12",
    install_requires=[
        "megatron-core>=0.18,<0.21",
        "torch>=2.6",
        "psutil",  # megatron-core's torch_dist checkpoints need it, the wheel does not declare it
        "einops",  # --use-megatron-fsdp's device mesh needs it; megatron-core lists it only in 'dev'
        "pulp>=2.7,<3",  # 2.x bundles the CBC solver the ILP uses; 3+ ships none
        "numpy",
        "pyyaml",
        "matplotlib",
    ],
    extras_require={
        "test": ["pytest", "pytest-timeout", "pytest-xdist", "scipy", "black", "isort"],
        # GPU-only extras: install your own CUDA torch first.
        "gpu": ["transformer-engine", "apex"],
    },
    entry_points={
        "console_scripts": [
            "oases=megatron_oases.cli:main",
            "oases-pretrain-gpt=megatron_oases.training.pretrain:console_main",
            "oases-pretrain-hybrid=megatron_oases.training.pretrain:hybrid_console_main",
        ]
    },
)
