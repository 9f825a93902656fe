"""Install gearsam_fused.

Install PyTorch first (its CPU or CUDA build, as you need), then this package without build isolation so the build
uses that torch instead of downloading another one:

    pip install torch
    pip install --no-build-isolation -e ".[test]"

``triton_kernels/`` is installed as ``gearsam_fused.triton_kernels``: a top-level module of that name belongs to a
different distribution. Compiled kernels from ``csrc/`` are added to ``ext_modules`` by the C++/CUDA backend.
"""

from setuptools import setup

PACKAGES = ["gearsam_fused", "gearsam_fused.backends", "gearsam_fused.models", "gearsam_fused.triton_kernels"]

setup(
    name="gearsam_fused",
    version="0.1.0",
    description="Exact, fused sharpness-aware minimisation (SAM, ASAM, GEAR-SAM) for PyTorch",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=PACKAGES,
    package_dir={"gearsam_fused.triton_kernels": "triton_kernels"},
    install_requires=["torch>=2.1", "numpy", "triton>=3.0; platform_system == 'Linux'"],
    extras_require={
        "demo": ["scikit-learn"],
        "test": ["pytest", "pytest-benchmark", "pytorch_optimizer>=3.0", "scikit-learn"],
    },
    entry_points={"console_scripts": ["gearsam = gearsam_fused.__main__:main"]},
    ext_modules=[],
)
