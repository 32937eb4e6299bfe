"""Multi-process training with ``torch.distributed`` (one process per GPU, launched by torchrun).

Everything here is a no-op (or returns its input) when no process group is initialised or the
world has one process, so single-process code can call it unconditionally.

Process group:
    :func:`init_from_env` (reads torchrun's RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR /
    MASTER_PORT; NCCL when CUDA is available, else gloo), :func:`is_distributed`, :func:`rank`,
    :func:`world_size`, :func:`local_rank`, :func:`is_main_process`, :func:`local_device`,
    :func:`barrier`, :func:`shutdown`.

Data:
    :func:`shard_loader` (the same DataLoader over this rank's DistributedSampler share),
    :func:`distributed_sampler` (a DistributedSampler, or None in a single process),
    :func:`set_sampler_epoch`, :func:`per_rank_batch_size`.

Training (the embedding network in DistributedDataParallel, the loss module NOT wrapped):
    :func:`wrap_model`; :func:`global_mean` (loss semantics, below); :func:`sync_loss_parameters`
    (average the gradients of sigma and the bank weights after ``backward()``, before the
    optimiser step); :func:`broadcast_buffers`; :func:`sum_over_ranks` / :func:`mean_over_ranks`
    (totals for logs).

Refresh (called by :class:`nnkloss.bank.refresh.Refresher` when a group is initialised):
    :func:`gather_bank_rows` (every rank embedded its share; exchange the rows so that every
    rank holds the same complete bank) and :func:`neighbour_lists` (each rank searches its slice
    of the query rows against the full bank; the lists are gathered).

Loss semantics under DDP. DDP averages gradients over ranks, so plain per-rank mean losses
train on the MEAN OF PER-RANK MEANS. With the kernel loss the per-rank means are over the rows
that have a same-class neighbour, whose count differs between ranks, so this differs from the
mean over the global batch that one process with the same global batch computes.
:func:`global_mean` rescales each rank's mean by ``world_size * count / total_count`` (one
all-reduce of a scalar, no host synchronisation) so that the averaged gradient IS the gradient
of the mean over all valid rows of the global batch: single-process and DDP runs then take the
same steps. The value it returns on one rank is not the global mean; the average over ranks is.

Why the loss module is not wrapped in DDP: DDP broadcasts a module's buffers from rank 0 at
every forward, and the loss module's buffers are the (N, D) bank. The bank is instead kept
identical on every rank by the refresh (every rank ends it with the same bytes), and its two
kinds of trainable parameters (``bank.log_weights`` (N,) and ``loss.log_sigma``) are kept in
sync by :func:`sync_loss_parameters`: identical starting values + identical averaged gradients
+ the same optimiser = identical values.

Failure mode to know: the exchange is collective. If one rank raises before reaching it (a
loader error, a bad idx), the other ranks wait in it until the process group's timeout
(``init_from_env(timeout_s=...)``). Errors detected during the exchange itself (rows nobody
embedded, NaN embeddings, conflicting labels, different bank shapes) are raised on every rank.
"""
from __future__ import annotations

import datetime
import functools
import math
import numbers
import os
import time
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..validation import FLOAT_DTYPES, require_float, require_int, require_labelled
from .search import (NeighbourLists, drop_self, knn, patch_positives, resolve_search_backend,
                     synchronize)

__all__ = [
    "init_from_env", "is_distributed", "rank", "world_size", "local_rank", "is_main_process",
    "local_device", "barrier", "shutdown",
    "distributed_sampler", "shard_loader", "set_sampler_epoch", "per_rank_batch_size",
    "wrap_model", "global_mean", "sync_loss_parameters", "broadcast_buffers",
    "sum_over_ranks", "mean_over_ranks",
    "gather_bank_rows", "neighbour_lists", "check_async_refresh",
]

# Bound on the per-rank send buffer of one all_gather round (the receive side is world_size
# times this): the exchange of an (N, D) bank never needs a second (N, D) buffer.
GATHER_CHUNK_BYTES = 64 * 2**20

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float64: 3}


# ============================================================================ process group
def init_from_env(backend: Optional[str] = None, timeout_s: float = 1800.0) -> bool:
    """Initialise the default process group from torchrun's environment, if launched by it.

    Args:
        backend: "nccl", "gloo", ... (default: "nccl" when CUDA is available, else "gloo").
        timeout_s: how long a collective may wait for the other ranks before failing.

    With NCCL the current CUDA device is set to ``cuda:LOCAL_RANK`` first (collectives use the
    current device). Returns :func:`is_distributed` (False with no torchrun variables set: a
    plain single-process run; also False under ``torchrun --nproc-per-node 1``). Idempotent:
    a group that is already initialised is kept.
    """
    if not dist.is_available():
        return False
    if dist.is_initialized():
        return is_distributed()
    present = [v for v in _TORCHRUN_VARS if v in os.environ]
    if not present:
        return False
    if len(present) != len(_TORCHRUN_VARS):
        missing = [v for v in _TORCHRUN_VARS if v not in os.environ]
        raise RuntimeError(f"a partial torch.distributed environment: {present} are set but "
                           f"{missing} are not; launch with torchrun or set all of "
                           f"{list(_TORCHRUN_VARS)}")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        lr = local_rank()
        if lr >= torch.cuda.device_count():
            raise RuntimeError(f"LOCAL_RANK={lr} but only {torch.cuda.device_count()} CUDA "
                               f"devices are visible: use --nproc-per-node <= the GPU count")
        torch.cuda.set_device(lr)
    dist.init_process_group(backend, init_method="env://",
                            timeout=datetime.timedelta(seconds=float(timeout_s)))
    return is_distributed()


def is_distributed(group=None) -> bool:
    """True when a process group is initialised and has more than one process."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def rank(group=None) -> int:
    """This process's rank in ``group`` (0 without a process group)."""
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def world_size(group=None) -> int:
    """Number of processes in ``group`` (1 without a process group)."""
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def local_rank() -> int:
    """This process's index on its machine (torchrun's LOCAL_RANK; 0 when not set)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def is_main_process() -> bool:
    """Rank 0, or a single process: the one that writes logs and checkpoints."""
    return rank() == 0


def local_device() -> torch.device:
    """``cuda:LOCAL_RANK`` when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank() % max(torch.cuda.device_count(), 1))
    return torch.device("cpu")


def barrier(group=None) -> None:
    """Wait for every rank (no-op in a single process)."""
    if is_distributed(group):
        dist.barrier(group)


def shutdown() -> None:
    """Destroy the default process group if one is initialised."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# ============================================================================ data
def distributed_sampler(dataset, shuffle: bool, seed: int = 0, drop_last: bool = False):
    """A :class:`~torch.utils.data.DistributedSampler` over ``dataset``, or None in a single
    process (then use the DataLoader's own ``shuffle``).

    Each rank gets ``ceil(len / world)`` indices; the sampler repeats indices to pad the last
    ranks (``drop_last=False``), so the refresh sees some rows twice (handled) and an epoch of
    training sees them twice too. Call :func:`set_sampler_epoch` every epoch when shuffling.
    """
    if not is_distributed():
        return None
    from torch.utils.data import DistributedSampler
    return DistributedSampler(dataset, num_replicas=world_size(), rank=rank(), shuffle=shuffle,
                              seed=seed, drop_last=drop_last)


def shard_loader(loader, shuffle: Optional[bool] = None, split_batch: bool = True,
                 seed: int = 0):
    """The same DataLoader, but over this rank's DistributedSampler share (single process:
    ``loader`` itself, untouched).

    Args:
        loader: a :class:`~torch.utils.data.DataLoader` built with ``batch_size`` (not a
            ``batch_sampler``); its dataset, workers, collate_fn, pin_memory, drop_last, ...
            are kept.
        shuffle: shuffle the share every epoch (default: whether ``loader`` shuffled, i.e. has
            a RandomSampler). Call :func:`set_sampler_epoch` every epoch (the Trainer does).
        split_batch: divide ``batch_size`` by the world size so that one step still consumes
            ``batch_size`` rows in all (training); False keeps it per rank (embedding passes).
        seed: the DistributedSampler's shuffle seed (the same on every rank).
    """
    if not is_distributed():
        return loader
    from torch.utils.data import DataLoader, RandomSampler
    if not isinstance(loader, DataLoader):
        raise TypeError(f"shard_loader needs a torch DataLoader, got {type(loader).__name__}")
    if loader.batch_size is None:
        raise ValueError("shard_loader needs a DataLoader built with batch_size, not with a "
                         "batch_sampler: give that one a DistributedSampler yourself")
    if shuffle is None:
        shuffle = isinstance(loader.sampler, RandomSampler)
    batch = per_rank_batch_size(loader.batch_size) if split_batch else loader.batch_size
    options = dict(num_workers=loader.num_workers, collate_fn=loader.collate_fn,
                   pin_memory=loader.pin_memory, drop_last=loader.drop_last,
                   timeout=loader.timeout, worker_init_fn=loader.worker_init_fn,
                   multiprocessing_context=loader.multiprocessing_context,
                   persistent_workers=loader.persistent_workers)
    if loader.num_workers > 0:
        options["prefetch_factor"] = loader.prefetch_factor
    sampler = distributed_sampler(loader.dataset, shuffle=shuffle, seed=seed)
    return DataLoader(loader.dataset, batch_size=batch, sampler=sampler, **options)


def set_sampler_epoch(loader, epoch: int) -> None:
    """``loader.sampler.set_epoch(epoch)`` when the loader has a sampler with that method (a
    DistributedSampler reshuffles only when told the epoch); otherwise nothing."""
    sampler = getattr(loader, "sampler", None)
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(int(epoch))


def per_rank_batch_size(global_batch: int) -> int:
    """The per-rank batch size that makes ``global_batch`` rows per optimiser step."""
    w = world_size()
    if global_batch < 1 or global_batch % w:
        raise ValueError(f"the global batch size {global_batch} must be a positive multiple of "
                         f"the world size {w}")
    return global_batch // w


# ============================================================================ communication
def _comm_device(group, data_device: torch.device) -> torch.device:
    """Where tensors must live for collectives on ``group``: NCCL needs the current CUDA
    device, gloo takes CPU tensors; a mixed "cpu:gloo,cuda:nccl" group follows the data."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and ("gloo" not in backend or data_device.type == "cuda"):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_gather_same(t: Tensor, group) -> List[Tensor]:
    """all_gather of a tensor that has the same shape on every rank."""
    out = [torch.empty_like(t) for _ in range(world_size(group))]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def _all_gather_rows(local: Tensor, counts: Sequence[int], place: Callable[[int, int, Tensor], None],
                     group, comm: torch.device, chunk_bytes: int = GATHER_CHUNK_BYTES) -> None:
    """Gather a variable number of rows from every rank, in rounds of bounded size.

    ``local``: (counts[rank], *row_shape), the same row shape and dtype on every rank.
    ``counts``: rows per rank, known to every rank (the loop must be identical everywhere).
    Each round pads this rank's next rows to the round's length, all_gathers, and calls
    ``place(r, first, rows)`` with rank r's rows ``first .. first + len(rows)`` (valid rows
    only, on ``comm``).
    """
    w = len(counts)
    most = max(counts) if counts else 0
    if most == 0:
        return
    row_shape = tuple(local.shape[1:])
    row_bytes = max(1, math.prod(row_shape) * local.element_size())
    chunk = max(1, min(most, chunk_bytes // row_bytes))
    for c0 in range(0, most, chunk):
        m = min(chunk, most - c0)
        send = torch.zeros((m,) + row_shape, dtype=local.dtype, device=comm)
        mine = local[c0:c0 + m]
        send[:mine.shape[0]] = mine.to(comm)
        bufs = [torch.empty_like(send) for _ in range(w)]
        dist.all_gather(bufs, send, group=group)
        for r in range(w):
            got = min(m, max(0, counts[r] - c0))
            if got:
                place(r, c0, bufs[r][:got])


# ============================================================================ refresh: bank rows
def check_async_refresh() -> None:
    """Refuse a background refresh under torch.distributed.

    Its collectives would run on a side thread concurrently with DDP's gradient all-reduces
    (collectives must be issued in the same order on every rank), and each rank would swap the
    new bank in at whatever step its own thread finished, so ranks would train on different
    banks. Use synchronous ``refresh()``: its cost is split across the ranks.
    """
    if is_distributed():
        raise RuntimeError("asynchronous refresh is not supported under torch.distributed "
                           "(ranks would swap banks at different steps, and its collectives "
                           "would race DDP's); use Refresher(..., async_mode=False)")


@torch.no_grad()
def gather_bank_rows(centres: Tensor, labels: Tensor, written: Tensor, group=None,
                     chunk_bytes: int = GATHER_CHUNK_BYTES) -> Tuple[Tensor, Tensor]:
    """Complete a bank from every rank's share: afterwards all ranks hold identical tensors.

    Args:
        centres: (N, D) float, this rank's embeddings in the rows it wrote (others: anything).
        labels: (N,) int64, likewise.
        written: (N,) bool, the rows this rank wrote (its DistributedSampler share; a row that
            its loader yielded twice holds the embedding written last, as in one process).
        group: process group (default: the world).
        chunk_bytes: per-rank send size of one all_gather round (bounds extra memory).

    Returns:
        ``(centres, labels)``: the same tensors, filled in place with every rank's rows.

    Rows written by several ranks (DistributedSampler repeats indices to give every rank the
    same count; a loader without a sampler repeats all of them) are taken from the LOWEST
    rank that wrote them: a rule every rank evaluates on the same gathered indices, so every
    rank ends with the same bytes even where two ranks' embeddings of a row differ in the last
    bits (different batch compositions). Only the owning rank sends a row's values.

    Raises (on every rank, the bank's previous contents untouched by the caller):
        ValueError: no rank wrote some rows; NaN/inf embeddings; two ranks gave one row
            different labels; the ranks' banks differ in N, D or dtype.
    """
    require_float("centres", centres, 2, FLOAT_DTYPES)
    require_int("labels", labels, 1)
    n, d = centres.shape
    dev = centres.device
    w, me = world_size(group), rank(group)
    comm = _comm_device(group, dev)
    local_idx = written.to(dev).nonzero().flatten()  # ascending: a deterministic order
    local_rows = centres[local_idx]
    bad_rows = int((~torch.isfinite(local_rows)).any(1).sum()) if local_rows.numel() else 0

    # 1. Shapes, counts and NaN counts of every rank (one small fixed-size all_gather).
    header = torch.tensor([n, d, _DTYPE_CODES.get(centres.dtype, -1), local_idx.numel(), bad_rows],
                          dtype=torch.long, device=comm)
    headers = torch.stack(_all_gather_same(header, group)).tolist()
    if any(h[:3] != headers[0][:3] for h in headers):
        shapes = [f"rank {r}: N={h[0]}, D={h[1]}, dtype code {h[2]}" for r, h in enumerate(headers)]
        raise ValueError("the ranks' banks differ in size or dtype (" + "; ".join(shapes) + ")")
    nonfinite = [h[4] for h in headers]
    if sum(nonfinite):
        raise ValueError(f"the model produced NaN/inf embeddings for {sum(nonfinite)} rows "
                         f"(per rank: {nonfinite}); the bank was left unchanged")
    counts = [h[3] for h in headers]

    # 2. Every rank's (idx, label) pairs, then the owner of each row: the lowest rank with it.
    pairs = torch.stack([local_idx, labels[local_idx].long()], 1)
    got: List[Optional[Tensor]] = [None] * w

    def keep_pairs(r: int, first: int, rows: Tensor) -> None:
        rows = rows.to(dev)
        got[r] = rows if got[r] is None else torch.cat([got[r], rows])

    _all_gather_rows(pairs, counts, keep_pairs, group, comm, chunk_bytes)
    empty = torch.empty(0, 2, dtype=torch.long, device=dev)
    got = [empty if g is None else g for g in got]
    if any(int(g[:, 0].min()) < 0 or int(g[:, 0].max()) >= n for g in got if g.numel()):
        raise ValueError(f"a rank wrote rows outside the bank's 0..{n - 1}")
    owner = torch.full((n,), w, dtype=torch.long, device=dev)
    new_labels = torch.empty(n, dtype=torch.long, device=dev)
    for r in reversed(range(w)):  # lower ranks overwrite higher ones: the lowest rank wins
        owner[got[r][:, 0]] = r
        new_labels[got[r][:, 0]] = got[r][:, 1]
    missing = int((owner == w).sum())
    if missing:
        first = (owner == w).nonzero()[:5].flatten().tolist()
        raise ValueError(f"no rank's loader yielded {missing} of the bank's {n} rows (first "
                         f"missing idx: {first}); give the refresh loader a DistributedSampler "
                         f"over the whole training set; the bank was left unchanged")
    for r in range(w):
        clash = new_labels[got[r][:, 0]] != got[r][:, 1]
        if bool(clash.any()):
            i = int(got[r][clash.nonzero()[0, 0], 0])
            raise ValueError(f"row {i} has label {int(new_labels[i])} on rank "
                             f"{int(owner[i])} but {int(got[r][clash, 1][0])} on rank {r}; the "
                             f"ranks' datasets differ")

    # 3. The centre rows, each sent by its owner only, in the owner's ascending idx order.
    owned = [g[:, 0][owner[g[:, 0]] == r] for r, g in enumerate(got)]
    mine = local_rows[owner[local_idx] == me]

    def place_rows(r: int, first: int, rows: Tensor) -> None:
        centres[owned[r][first:first + rows.shape[0]]] = rows.to(dev)

    _all_gather_rows(mine, [o.numel() for o in owned], place_rows, group, comm, chunk_bytes)
    labels.copy_(new_labels)
    return centres, labels


# ============================================================================ refresh: lists
def _query_slice(n: int, r: int, w: int) -> Tuple[int, int]:
    """Rows [start, stop) of the N queries that rank r searches (sizes differ by at most 1)."""
    return r * n // w, (r + 1) * n // w


def _search_excluding_self(centres: Tensor, start: int, stop: int, k: int, search_backend: str,
                           knn_options: dict) -> Tuple[Tensor, Tensor]:
    """The k nearest other centres of rows start..stop-1, against the full bank.

    Searches k + 1 and removes each row's own index (or, where more than k exact duplicates
    crowd it out, the farthest entry) -- how :func:`nnkloss.bank.search.knn`'s faiss backends exclude
    self. Only exact ties can order differently from a one-process ``exclude_self`` search.
    """
    n = centres.shape[0]
    dist_, ids = knn(centres[start:stop], centres, min(k + 1, n), search_backend, **knn_options)
    return drop_self(dist_, ids, torch.arange(start, stop, device=ids.device), k)


@torch.no_grad()
def neighbour_lists(centres: Tensor, labels: Tensor, k: int, search_backend: str = "auto",
                    ensure_positive: bool = False, group=None,
                    chunk_bytes: int = GATHER_CHUNK_BYTES, **knn_options) -> NeighbourLists:
    """:func:`nnkloss.bank.search.neighbour_lists` with the queries split across ranks.

    Every rank must pass the same (N, D) ``centres`` and (N,) ``labels`` (as
    :func:`gather_bank_rows` leaves them). Rank r searches rows ``r*N//W .. (r+1)*N//W - 1``
    against the full bank with :func:`nnkloss.bank.search.knn` (``search_backend``,
    ``knn_options`` as there;
    an approximate index is built over the full bank on every rank, with the same seed), then
    the (N, k) indices and distances, ``has_positive`` and ``num_patched`` are gathered, so
    every rank returns the same :class:`~nnkloss.bank.search.NeighbourLists`. ``seconds`` covers the
    search and the exchange. In a single process this is :func:`nnkloss.bank.search.neighbour_lists`.
    """
    if not is_distributed(group):
        from .search import neighbour_lists as single
        return single(centres, labels, k, search_backend, ensure_positive=ensure_positive,
                      **knn_options)
    n = require_labelled("centres", centres, "labels", labels)
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or not 1 <= k <= n - 1:
        raise ValueError(f"k must be an int in [1, N - 1 = {n - 1}], got {k!r}")
    labels = labels.to(centres.device).long()
    dev = centres.device
    w, me = world_size(group), rank(group)
    comm = _comm_device(group, dev)
    approximate = knn_options.get("approximate")
    used = (f"faiss-{approximate}" if approximate is not None
            else resolve_search_backend(search_backend, dev))

    synchronize(dev)
    t0 = time.perf_counter()
    start, stop = _query_slice(n, me, w)
    dist_, ids = _search_excluding_self(centres, start, stop, k, search_backend, knn_options)
    nb_labels = labels[ids.clamp_min(0)]
    has_pos = ((nb_labels == labels[start:stop].unsqueeze(1)) & (ids >= 0)).any(1)
    patched = 0
    if ensure_positive and not bool(has_pos.all()):
        patched = patch_positives(centres, labels, start, dist_, ids, has_pos, search_backend,
                                   knn_options)

    slices = [_query_slice(n, r, w) for r in range(w)]
    counts = [b - a for a, b in slices]
    out_i = torch.empty(n, k, dtype=torch.long, device=dev)
    out_d = torch.empty(n, k, dtype=torch.float32, device=dev)
    out_p = torch.empty(n, dtype=torch.bool, device=dev)

    def placer(out: Tensor) -> Callable[[int, int, Tensor], None]:
        def place(r: int, first: int, rows: Tensor) -> None:
            a = slices[r][0] + first
            out[a:a + rows.shape[0]] = rows.to(dev, out.dtype)
        return place

    _all_gather_rows(ids, counts, placer(out_i), group, comm, chunk_bytes)
    _all_gather_rows(dist_.float(), counts, placer(out_d), group, comm, chunk_bytes)
    _all_gather_rows(has_pos.to(torch.uint8), counts, placer(out_p), group, comm, chunk_bytes)
    total = torch.tensor([patched], dtype=torch.long, device=comm)
    dist.all_reduce(total, group=group)
    synchronize(dev)
    return NeighbourLists(out_i, out_d, out_p, int(total), time.perf_counter() - t0, used)


# ============================================================================ training
def wrap_model(model: nn.Module, device: Optional[torch.device] = None, **ddp_options) -> nn.Module:
    """``DistributedDataParallel(model)`` under torch.distributed, else ``model`` itself.

    ``device``: where the model lives (default: its first parameter's device); for CUDA the
    wrapper gets ``device_ids=[device.index]``. ``ddp_options`` go to DDP (e.g.
    ``find_unused_parameters=True``). Keep the unwrapped ``model`` for ``state_dict()`` (no
    "module." prefix) and for the Refresher (it embeds in eval mode under no_grad, where DDP
    adds nothing). Wrap only the embedding network, not the loss module (see the module doc).
    """
    if not is_distributed():
        return model
    from torch.nn.parallel import DistributedDataParallel
    if device is None:
        p = next(iter(model.parameters()), None)
        device = p.device if p is not None else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        ddp_options.setdefault("device_ids", [index])
        ddp_options.setdefault("output_device", index)
    return DistributedDataParallel(model, **ddp_options)


def global_mean(loss: Tensor, count, group=None) -> Tensor:
    """Rescale a per-rank mean loss so that DDP's gradient average is the gradient of the mean
    over the whole global batch.

    Args:
        loss: 0-dim mean over ``count`` rows of this rank's batch (e.g. a NeighbourKernelLoss
            with reduction="mean"; its ``last_num_valid`` is the count).
        count: rows in that mean, a 0-dim tensor or int (0 allowed: the loss is then 0).

    Returns ``loss * world_size * count / total_count`` (``loss`` itself in a single process).
    One all-reduce of a scalar on the loss's stream, no host synchronisation. Averaged over
    ranks (what DDP does to the gradients, and what a log should show) it equals
    ``sum of all ranks' row losses / total_count``.
    """
    if not is_distributed(group):
        return loss
    c = torch.as_tensor(count, device=loss.device).detach().to(torch.float64)
    comm = _comm_device(group, loss.device)
    total = c.reshape(1).to(comm, copy=True)
    dist.all_reduce(total, group=group)
    scale = c * world_size(group) / total.to(loss.device).reshape(()).clamp_min(1.0)
    return loss * scale.to(loss.dtype)


@torch.no_grad()
def sync_loss_parameters(loss_module: nn.Module, group=None) -> None:
    """Average the gradients of ``loss_module``'s trainable parameters over the ranks.

    Call after ``backward()`` and before gradient clipping and ``optimizer.step()``, on every
    rank, every step. For a NeighbourKernelLoss these are ``log_sigma`` (when learned) and
    ``bank.log_weights`` (when learned; an (N,) gradient); any other criterion's parameters
    (a softmax head) work the same way. The embedding network's gradients are DDP's business.

    Semantics match DDP's: every rank's gradient becomes ``sum over ranks / world_size`` (a rank
    whose gradient is None contributes zeros); a parameter without a gradient on every rank
    keeps None. All gradients travel in one flat all-reduce (cost per step: the parameters'
    size, N x 4 bytes for learned bank weights). No host synchronisation on NCCL.
    """
    if not is_distributed(group):
        return
    params = [p for p in loss_module.parameters() if p.requires_grad]
    if not params:
        return
    dtype = functools.reduce(torch.promote_types, [p.dtype for p in params])
    comm = _comm_device(group, params[0].device)
    parts = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).to(comm, dtype)
             for p in params]
    present = torch.tensor([p.grad is not None for p in params], dtype=dtype, device=comm)
    flat = torch.cat(parts + [present])
    dist.all_reduce(flat, group=group)
    flat[:-len(params)] /= world_size(group)
    flags = flat[-len(params):]
    offset = 0
    for i, p in enumerate(params):
        g = flat[offset:offset + p.numel()].view(p.shape)
        offset += p.numel()
        if p.grad is None:
            # None on every rank keeps None (an unused parameter stays untouched by SGD etc.);
            # reading the flag syncs, but only for parameters that had no gradient here.
            if bool(flags[i] > 0):
                p.grad = g.to(p.device, p.dtype).clone()
        else:
            p.grad.copy_(g)


@torch.no_grad()
def sum_over_ranks(value):
    """The sum of ``value`` (a number or a tensor) over all ranks, the same type back (the
    value itself in a single process). For logs: one all-reduce; a host sync for numbers."""
    if not is_distributed():
        return value
    if isinstance(value, Tensor):
        t = value.detach().to(_comm_device(None, value.device), copy=True)
        dist.all_reduce(t)
        return t.to(value.device)
    t = torch.tensor(value, dtype=torch.float64, device=_comm_device(None, local_device()))
    dist.all_reduce(t)
    return type(value)(t.item())


def mean_over_ranks(value):
    """The mean of ``value`` (a number or a tensor) over all ranks (itself in one process)."""
    if not is_distributed():
        return value
    return sum_over_ranks(value) / world_size()


@torch.no_grad()
def broadcast_buffers(module: nn.Module, src: int = 0, group=None) -> None:
    """Overwrite every buffer of ``module`` (BatchNorm running statistics, ...) with rank
    ``src``'s. DDP broadcasts buffers at the START of each forward, so after the last step the
    ranks' running statistics differ by their last local update; a refresh syncs them first so
    that every rank embeds with the same model."""
    if not is_distributed(group):
        return
    for buf in module.buffers():
        comm = _comm_device(group, buf.device)
        t = buf.to(comm)
        dist.broadcast(t, src=src, group=group)
        if t is not buf:
            buf.copy_(t)
