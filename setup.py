"""Install tensorsocket. Torch is required but not pinned: a CUDA build you already have is
kept; scripts/setup.sh installs torch 2.13.0 (the version the suite runs on) first on a
machine without one."""

from setuptools import find_packages, setup

setup(
    name="tensorsocket",
    version="0.1.0",
    description="Share one data loader's batches, zero-copy, with several training processes on one machine",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="MIT",
    python_requires=">=3.10",
    packages=find_packages(include=["tensorsocket", "tensorsocket.*"]),
    install_requires=[
        "torch>=2.1",
        "numpy>=1.24",
        "pyzmq>=25",
        "msgpack>=1.0",
        "Pillow>=9",
    ],
    entry_points={"console_scripts": ["tensorsocket = tensorsocket.cli:main"]},
    extras_require={
        # (producer/imagefolder_gpu.py also needs torchvision: the build made for your torch, which
        # an unpinned requirement here could replace with another torch, so it is not listed)
        # CuPy's wheels are built per CUDA major version: take the one your torch was built for
        # (torch.version.cuda); "gpu" is CUDA 12's
        "gpu": ["cupy-cuda12x>=13", "nvidia-ml-py>=12"],
        "gpu-cuda13": ["cupy-cuda13x>=14", "nvidia-ml-py>=12"],
        "bench": ["matplotlib>=3.7"],
        "stateful": ["torchdata>=0.10"],  # StatefulDataLoader: restarts resume from its own state
        # tensorsocket.ray: per-node producers on a Ray cluster, trials placed by Ray Tune
        "ray": ["ray[tune]>=2.40"],
        "optuna": ["optuna>=3.4"],  # consumer/optuna_study.py (the library itself needs nothing of it)
        "dev": [
            "pytest>=8",
            "pytest-timeout>=2.2",
            "pytest-xdist>=3.5",  # scripts/test.sh runs the suite in two processes
            "hypothesis>=6.100",
            "ruff>=0.5",
            "psutil>=5.9",
            "lightning>=2.2",  # a real client in the tests (tests/test_clients.py)
            "torchdata>=0.10",  # StatefulDataLoader under producer restarts (tests/test_restart.py)
            "ray[tune]==2.40.0",  # tests/test_ray.py (a 2-node local cluster); the version they ran on
            "optuna>=3.4",  # tests/test_optuna.py
        ],
    },
)
