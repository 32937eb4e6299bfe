"""FAISS indexes (optional, imported lazily): exact ``IndexFlatL2`` (GPU where faiss's GPU
support works) and approximate ``IndexIVFFlat`` / ``IndexHNSWFlat``. Results as the torch
search's: fp32 squared distances clamped at 0, int64 indices (-1 at inf: not found).
"""
from __future__ import annotations

import functools
import math
import numbers
import warnings
from typing import Iterator, Optional, Tuple

import torch
from torch import Tensor

from ...validation import require_positive_int

__all__ = ["faiss_available", "faiss_gpu_usable", "require_faiss", "use_faiss_gpu",
           "build_flat", "build_approximate", "search_index", "iter_search_index",
           "check_index_options", "INDEX_OPTIONS", "FAISS_GPU_MAX_K"]

# faiss GPU indexes select at most this many neighbours per query (GPU_MAX_SELECTION_K).
FAISS_GPU_MAX_K = 2048


@functools.lru_cache(maxsize=None)
def _faiss_module():
    try:
        import faiss  # noqa: F401
    except Exception:  # absent, or a broken binary: both mean "not usable"
        return None
    return faiss


def faiss_available() -> bool:
    """True when ``import faiss`` works."""
    return _faiss_module() is not None


def require_faiss(asked: str = "search_backend='faiss' (and approximate search)"):
    """The faiss module, or ImportError saying that ``asked`` needs it and how to install it."""
    faiss = _faiss_module()
    if faiss is None:
        raise ImportError(f"{asked} needs the faiss package, which is not installed (or does "
                          f"not import): `pip install faiss-cpu` (or a faiss GPU build), or use "
                          f"search_backend='torch' without an approximate index")
    return faiss


# The index options of each approximate kind (seed: the IVF training sample and k-means).
INDEX_OPTIONS = {"ivf": ("nlist", "nprobe", "train_size", "seed"),
                 "hnsw": ("hnsw_m", "ef_construction", "ef_search")}


def check_index_options(approximate: Optional[str], options: dict, arg: str = "{}") -> None:
    """ValueError naming an option given (not None) that the index ``approximate`` does not
    use, or a bad value of one it does; ``arg`` spells the name as the caller passed it."""
    for kind, names in INDEX_OPTIONS.items():
        for name in names:
            if kind != approximate and options.get(name) is not None:
                used = ("the exact search (approximate=None)" if approximate is None
                        else f"approximate={approximate!r}")
                raise ValueError(f"{arg.format(name)}={options[name]!r} is an option of "
                                 f"approximate={kind!r} only; {used} does not use it")
    # Not left to faiss: nprobe 0 fails there naming nothing; hnsw_m < 2 crashes or hangs.
    for name in INDEX_OPTIONS.get(approximate, ()):
        v = options.get(name)
        if v is not None and name != "seed":
            require_positive_int(arg.format(name), v)
    hnsw_m = options.get("hnsw_m")
    if approximate == "hnsw" and hnsw_m is not None and hnsw_m < 2:
        raise ValueError(f"{arg.format('hnsw_m')} must be >= 2 (links per node of faiss's HNSW "
                         f"graph), got {hnsw_m}")
    seed = options.get("seed")
    if approximate == "ivf" and seed is not None and (isinstance(seed, bool)
                                                      or not isinstance(seed, numbers.Integral)):
        raise ValueError(f"{arg.format('seed')} must be an int, got {seed!r}")


@functools.lru_cache(maxsize=None)
def _gpu_resources(device_index: int):
    return _faiss_module().StandardGpuResources()


def _gpu_flat(device_index: int, d: int):
    faiss = _faiss_module()
    cfg = faiss.GpuIndexFlatConfig()
    cfg.device = device_index
    return faiss.GpuIndexFlatL2(_gpu_resources(device_index), d, cfg)


@functools.lru_cache(maxsize=None)
def faiss_gpu_usable(device_index: int = 0) -> bool:
    """True when faiss's GPU support runs on CUDA device ``device_index``: a tiny search, tried
    once per device (some wheels fail only there); else a warning."""
    faiss = _faiss_module()
    if faiss is None or not hasattr(faiss, "StandardGpuResources"):
        return False
    try:
        if faiss.get_num_gpus() <= device_index or not torch.cuda.is_available():
            return False
        import numpy as np
        index = _gpu_flat(device_index, 4)
        x = np.arange(32, dtype="float32").reshape(8, 4)
        index.add(x)
        _, ids = index.search(x[:2], 1)
        if ids[0, 0] != 0 or ids[1, 0] != 1:
            raise RuntimeError(f"probe search returned {ids.ravel().tolist()}, expected [0, 1]")
    except Exception as exc:  # noqa: BLE001 - any failure means "do not use the GPU index"
        msg = " ".join(str(exc).split())[:160]
        warnings.warn(f"faiss GPU index unusable on cuda:{device_index} ({type(exc).__name__}: "
                      f"{msg}); falling back", RuntimeWarning, stacklevel=2)
        return False
    return True


def _to_numpy_f32(t: Tensor):
    return t.detach().to("cpu", torch.float32).contiguous().numpy()


def _cuda_index(device: torch.device) -> int:
    return torch.cuda.current_device() if device.index is None else device.index


def use_faiss_gpu(device: torch.device, k: int = 1) -> bool:
    """Whether a faiss index for ``device`` inputs runs on the GPU (else on the CPU)."""
    return (device.type == "cuda" and k <= FAISS_GPU_MAX_K
            and faiss_gpu_usable(_cuda_index(device)))


def _add_in_chunks(index, base: Tensor, chunk_rows: int = 1 << 18) -> None:
    # Chunks keep the fp32 host copy of a GPU/bf16 base bounded.
    for b0 in range(0, base.shape[0], chunk_rows):
        index.add(_to_numpy_f32(base[b0:b0 + chunk_rows]))


def build_flat(base: Tensor, k: int):
    """Exact ``IndexFlatL2`` holding ``base`` (GPU index when usable for k results)."""
    d = base.shape[1]
    index = (_gpu_flat(_cuda_index(base.device), d) if use_faiss_gpu(base.device, k)
             else require_faiss().IndexFlatL2(d))
    _add_in_chunks(index, base)
    return index


def build_approximate(base: Tensor, kind: str, k: int, nlist: Optional[int] = None,
                      nprobe: Optional[int] = None, train_size: Optional[int] = None,
                      seed: Optional[int] = None, hnsw_m: Optional[int] = None,
                      ef_construction: Optional[int] = None, ef_search: Optional[int] = None):
    """An ``IndexIVFFlat`` ("ivf") or ``IndexHNSWFlat`` ("hnsw") holding ``base``, for ``k``
    results; options as :func:`~.knn.knn`, checked by the caller."""
    faiss = require_faiss(f"approximate={kind!r}")
    n, d = base.shape
    seed = 0 if seed is None else int(seed)
    if kind == "ivf":
        # Default: ~4 sqrt(N) lists, each keeping >= 39 training points (faiss warns below).
        nlist = (int(max(1, min(4 * math.isqrt(max(n, 1)), n // 39))) if nlist is None
                 else int(nlist))
        if not 1 <= nlist <= n:
            raise ValueError(f"nlist must be in [1, N={n}], got {nlist}")
        quantizer = faiss.IndexFlatL2(d)
        index = faiss.IndexIVFFlat(quantizer, d, nlist, faiss.METRIC_L2)
        index.cp.seed = seed
        train_n = min(n, 256 * nlist if train_size is None else int(train_size))
        if train_n < nlist:
            raise ValueError(f"train_size={train_n} is smaller than nlist={nlist}")
        g = torch.Generator().manual_seed(seed)
        sample = torch.randperm(n, generator=g)[:train_n].sort().values
        index.train(_to_numpy_f32(base[sample.to(base.device)]))
        _add_in_chunks(index, base)
        index.nprobe = min(nlist, max(8, nlist // 8)) if nprobe is None else int(nprobe)
        if use_faiss_gpu(base.device, k + 1) and index.nprobe <= FAISS_GPU_MAX_K:
            dev = _cuda_index(base.device)
            index = faiss.index_cpu_to_gpu(_gpu_resources(dev), dev, index)
        return index
    # HNSW: CPU only in faiss.
    index = faiss.IndexHNSWFlat(d, 32 if hnsw_m is None else int(hnsw_m), faiss.METRIC_L2)
    index.hnsw.efConstruction = 64 if ef_construction is None else int(ef_construction)
    _add_in_chunks(index, base)
    index.hnsw.efSearch = max(int(ef_search) if ef_search is not None else 64, 2 * k + 2)
    return index


def iter_search_index(index, queries: Tensor, k: int, chunk_rows: int = 1 << 14
                      ) -> Iterator[Tuple[int, Tensor, Tensor]]:
    """Yield ``(row0, distances, indices)`` on the queries' device per chunk of query rows."""
    for q0 in range(0, queries.shape[0], chunk_rows):
        dd, ii = index.search(_to_numpy_f32(queries[q0:q0 + chunk_rows]), k)
        dist, ids = torch.from_numpy(dd), torch.from_numpy(ii)
        dist.masked_fill_(ids < 0, math.inf)  # faiss: -1 with a huge distance
        dist.clamp_min_(0.0)  # as the torch search
        yield q0, dist.to(queries.device), ids.to(queries.device)


def search_index(index, queries: Tensor, k: int) -> Tuple[Tensor, Tensor]:
    """(Q >= 1, k) fp32 distances and int64 indices from a faiss index, on the queries' device."""
    blocks = list(iter_search_index(index, queries, k))
    return torch.cat([b[1] for b in blocks]), torch.cat([b[2] for b in blocks])
