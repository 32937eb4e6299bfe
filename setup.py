from setuptools import setup

# The Triton kernels live in kernels/ at the top of the repository and install as
# nnkloss.kernels.
setup(
    name="nnkloss",
    version="0.1.0",
    description="Nearest-neighbour Gaussian kernel loss for deep metric learning and "
                "classification, with fused Triton kernels",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=["nnkloss", "nnkloss.ops", "nnkloss.kernels"],
    package_dir={"nnkloss": "nnkloss", "nnkloss.kernels": "kernels"},
    # the compiled CPU path builds this source on first use (nnkloss/ops/cpu.py)
    package_data={"nnkloss.ops": ["cpu_kernel.cpp"]},
    install_requires=["torch>=2.4", "numpy", "tqdm", "triton>=3.0; platform_system == 'Linux'"],
    extras_require={
        "triton": ["triton>=3.0"],
        "faiss": ["faiss-cpu"],
        "vision": ["torchvision", "scipy", "Pillow"],
        "demo": ["scikit-learn", "matplotlib"],
        "test": ["pytest", "triton>=3.0", "scikit-learn", "matplotlib", "faiss-cpu", "scipy",
                 "torchvision", "Pillow"],
    },
)
