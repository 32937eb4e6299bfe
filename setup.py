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
    packages=["nnkloss", "nnkloss.cpu", "nnkloss.ops", "nnkloss.bank", "nnkloss.bank.search",
              "nnkloss.losses", "nnkloss.evaluation", "nnkloss.experiment", "nnkloss.kernels"],
    package_dir={"nnkloss": "nnkloss", "nnkloss.kernels": "kernels"},
    # the CPU backend builds these sources on first use (nnkloss/cpu/build.py)
    package_data={"nnkloss.cpu": ["csrc/*.cpp", "csrc/*.h"]},
    install_requires=["torch>=2.4", "numpy", "tqdm", "triton>=3.0; platform_system == 'Linux'"],
    extras_require={
        "triton": ["triton>=3.0"],
        "faiss": ["faiss-cpu"],
        # GPU neighbour search with Hopper (sm_90) code. faiss-gpu-cuvs 1.15.1 carries
        # sm_75..sm_90 and needs the CUDA 13 runtime: it pairs with the CUDA 13 torch that
        # `pip install torch` gives. For a CUDA 12 build of torch use the gpu-cu12 extra
        # (faiss-gpu 1.15.1: sm_70..sm_90, CUDA 12 runtime). Not faiss-gpu-cu12: no sm_90 code.
        "gpu": ["triton>=3.0", "faiss-gpu-cuvs>=1.15.1; python_version >= '3.11'"],
        "gpu-cu12": ["triton>=3.0", "faiss-gpu>=1.15.1"],
        "vision": ["torchvision", "scipy", "Pillow"],
        "demo": ["scikit-learn", "matplotlib"],
        # repro/fashion_mnist.py's competitors (the library itself never imports it)
        "bench": ["pytorch-metric-learning>=2.0", "scikit-learn", "matplotlib"],
        "test": ["pytest", "hypothesis", "triton>=3.0", "scikit-learn", "matplotlib",
                 "faiss-cpu", "scipy", "torchvision", "Pillow", "pytorch-metric-learning>=2.0"],
    },
)
