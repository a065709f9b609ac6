from setuptools import find_packages, setup

setup(
    name="autoshard",
    version="0.1.0",
    description="Automatic tensor parallelism for PyTorch by torch.fx graph rewriting",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["autoshard", "autoshard.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.4", "networkx>=3.0", "tabulate>=0.9", "numpy", "isal>=1.0"],
    extras_require={
        "test": ["pytest>=7", "transformers>=4.40", "safetensors>=0.4", "matplotlib>=3.7", "accelerate", "lightning",
                 "scipy>=1.9"],
        "optimal": ["scipy>=1.9"],     # search="optimal": HiGHS through scipy.optimize.milp
        "bench": ["matplotlib>=3.7"],
        "draw": ["matplotlib>=3.7"],
        "hf": ["transformers>=4.40", "safetensors>=0.4", "tqdm", "accelerate"],
        # benchmarks/deepspeed_autotp.py's peer; on CPU install with DS_BUILD_OPS=0 DS_ACCELERATOR=cpu
        "peers": ["deepspeed>=0.16", "transformers>=4.40"],
    },
    entry_points={"console_scripts": ["autoshard=autoshard.cli:main"]},
)
