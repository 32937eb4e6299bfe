"""The compiled CPU backend: one C++ library (``csrc/``), built on first use and loaded with
ctypes (:mod:`.build`); the op's passes (:mod:`.op`) and the exact search's GEMM and top-k
selection (:mod:`.search`) call it. Optional: where it is unavailable, its callers run torch.
"""
from . import op, search
from .build import available, build_info, library_path
from .op import *  # noqa: F401,F403 (op.__all__)
from .search import *  # noqa: F401,F403 (search.__all__)

__all__ = ["available", "build_info", "library_path", *op.__all__, *search.__all__]
