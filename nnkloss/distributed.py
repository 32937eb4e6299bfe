"""The ``torch.distributed`` runtime (one process per GPU, launched by torchrun): process group,
sharded loaders, DDP helpers, reductions; no-ops without a process group or in a world of one.
The loss module is not wrapped in DDP (which would broadcast the bank every forward):
:func:`sync_loss_parameters` averages its gradients instead."""
from __future__ import annotations

import datetime
import functools
import os
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = [
    "init_from_env", "is_distributed", "rank", "world_size", "local_rank", "is_main_process",
    "local_device", "barrier", "shutdown", "comm_device",
    "distributed_sampler", "shard_loader", "set_sampler_epoch", "per_rank_batch_size",
    "wrap_model", "global_mean", "sync_loss_parameters", "broadcast_buffers",
    "sum_over_ranks", "mean_over_ranks",
]

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def init_from_env(dist_backend: Optional[str] = None, timeout_s: float = 1800.0) -> bool:
    """Initialise the default process group from torchrun's environment, if launched by it.
    ``dist_backend``: default "nccl" with CUDA (device ``cuda:LOCAL_RANK``), else "gloo";
    ``timeout_s``: a collective's wait. Returns :func:`is_distributed`."""
    if not dist.is_available() or dist.is_initialized():
        return is_distributed()
    present = [v for v in _TORCHRUN_VARS if v in os.environ]
    if not present:
        return False
    if len(present) != len(_TORCHRUN_VARS):
        missing = [v for v in _TORCHRUN_VARS if v not in present]
        raise RuntimeError(f"a partial torch.distributed environment: {present} are set but "
                           f"{missing} are not; launch with torchrun or set all of "
                           f"{list(_TORCHRUN_VARS)}")
    if dist_backend is None:
        dist_backend = "nccl" if torch.cuda.is_available() else "gloo"
    if dist_backend == "nccl":
        lr = local_rank()
        if lr >= torch.cuda.device_count():
            raise RuntimeError(f"LOCAL_RANK={lr} but only {torch.cuda.device_count()} CUDA "
                               f"devices are visible: use --nproc-per-node <= the GPU count")
        torch.cuda.set_device(lr)
    dist.init_process_group(dist_backend, init_method="env://",
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
    return (torch.device("cuda", local_rank() % max(torch.cuda.device_count(), 1))
            if torch.cuda.is_available() else torch.device("cpu"))


def barrier(group=None) -> None:
    """Wait for every rank (no-op in a single process)."""
    if is_distributed(group):
        dist.barrier(group)


def shutdown() -> None:
    """Destroy the default process group if one is initialised."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def distributed_sampler(dataset, shuffle: bool, seed: int = 0, drop_last: bool = False):
    """A :class:`~torch.utils.data.DistributedSampler` over ``dataset`` (None in one process);
    call :func:`set_sampler_epoch` every epoch when shuffling."""
    if not is_distributed():
        return None
    from torch.utils.data import DistributedSampler
    return DistributedSampler(dataset, num_replicas=world_size(), rank=rank(), shuffle=shuffle,
                              seed=seed, drop_last=drop_last)


def shard_loader(loader, shuffle: Optional[bool] = None, split_batch: bool = True,
                 seed: int = 0):
    """``loader`` (a DataLoader with ``batch_size`` over its whole dataset) over this rank's
    DistributedSampler share, other settings kept. ``shuffle``: default the loader's.
    ``split_batch``: divide ``batch_size`` by the world size (False: embedding passes)."""
    if not is_distributed():
        return loader
    from torch.utils.data import DataLoader, RandomSampler, SequentialSampler
    if not isinstance(loader, DataLoader):
        raise TypeError(f"shard_loader needs a torch DataLoader, got {type(loader).__name__}")
    if loader.batch_size is None:
        raise ValueError("shard_loader needs a DataLoader built with batch_size, not with a "
                         "batch_sampler: give that one a DistributedSampler yourself")
    sampler = loader.sampler
    whole = (type(sampler) is SequentialSampler or (
        type(sampler) is RandomSampler and not sampler.replacement
        and sampler.num_samples == len(loader.dataset)))
    if not whole:
        raise ValueError(f"shard_loader needs a loader over its whole dataset (shuffle=True or "
                         f"False), got one with a {type(sampler).__name__}, which "
                         f"DistributedSampler shares would not follow: give that loader a "
                         f"sampler that shards it yourself")
    if shuffle is None:
        shuffle = isinstance(loader.sampler, RandomSampler)
    batch = per_rank_batch_size(loader.batch_size) if split_batch else loader.batch_size
    options = {name: getattr(loader, name) for name in (  # prefetch_factor: None w/o workers
        "num_workers", "collate_fn", "pin_memory", "drop_last", "timeout", "worker_init_fn",
        "multiprocessing_context", "persistent_workers", "prefetch_factor")}
    sampler = distributed_sampler(loader.dataset, shuffle=shuffle, seed=seed)
    return DataLoader(loader.dataset, batch_size=batch, sampler=sampler, **options)


def set_sampler_epoch(loader, epoch: int) -> None:
    """``loader.sampler.set_epoch(epoch)`` where the sampler has it."""
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


def comm_device(group, data_device: torch.device) -> torch.device:
    """Where tensors must live for collectives on ``group``: the current CUDA device for NCCL,
    the CPU for gloo; a mixed group follows ``data_device``."""
    backend = str(dist.get_backend(group)).lower()
    nccl = "nccl" in backend and ("gloo" not in backend or data_device.type == "cuda")
    return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")


def wrap_model(model: nn.Module, device: Optional[torch.device] = None, **ddp_options) -> nn.Module:
    """``DistributedDataParallel(model, **ddp_options)`` under torch.distributed, else
    ``model``. Wrap only the embedding network; keep ``model`` for state dicts."""
    if not is_distributed():
        return model
    from torch.nn.parallel import DistributedDataParallel
    device = (next(model.parameters(), torch.empty(0)).device if device is None
              else torch.device(device))
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        ddp_options.setdefault("device_ids", [index])
        ddp_options.setdefault("output_device", index)
    return DistributedDataParallel(model, **ddp_options)


def global_mean(loss: Tensor, count, group=None) -> Tensor:
    """``loss * world_size * count / total_count`` for a rank's mean ``loss`` over ``count``
    rows, so that DDP's gradient average is that of the global-batch mean (no host sync)."""
    if not is_distributed(group):
        return loss
    c = torch.as_tensor(count, device=loss.device).detach().to(torch.float64)
    comm = comm_device(group, loss.device)
    total = c.reshape(1).to(comm, copy=True)
    dist.all_reduce(total, group=group)
    scale = c * world_size(group) / total.to(loss.device).reshape(()).clamp_min(1.0)
    return loss * scale.to(loss.dtype)


@torch.no_grad()
def sync_loss_parameters(loss_module: nn.Module, group=None) -> None:
    """Average ``loss_module``'s trainable gradients over the ranks, as DDP does (a rank's
    None counts as zeros; None everywhere stays None), on every rank after ``backward()``."""
    if not is_distributed(group):
        return
    params = [p for p in loss_module.parameters() if p.requires_grad]
    if not params:
        return
    dtype = functools.reduce(torch.promote_types, [p.dtype for p in params])
    comm = comm_device(group, params[0].device)
    parts = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).to(comm, dtype)
             for p in params]
    present = torch.tensor([p.grad is not None for p in params], dtype=dtype, device=comm)
    flat = torch.cat(parts + [present])
    dist.all_reduce(flat, group=group)
    flat[:-len(params)] /= world_size(group)
    grads = flat[:-len(params)].split([p.numel() for p in params])
    # The presence flags are read (a host sync on a GPU) only where a local gradient is None.
    flags = flat[-len(params):].tolist() if any(p.grad is None for p in params) else None
    for i, (p, g) in enumerate(zip(params, grads)):
        if p.grad is not None:
            p.grad.copy_(g.view(p.shape))
        elif flags[i] > 0:
            p.grad = g.view(p.shape).to(p.device, p.dtype).clone()


@torch.no_grad()
def sum_over_ranks(value):
    """The sum of ``value`` (number or tensor) over all ranks, of the same type."""
    if not is_distributed():
        return value
    if not isinstance(value, Tensor):  # a number: summed as a float64 tensor
        t = torch.tensor(value, dtype=torch.float64, device=local_device())
        return type(value)(sum_over_ranks(t).item())
    t = value.detach().to(comm_device(None, value.device), copy=True)
    dist.all_reduce(t)
    return t.to(value.device)


def mean_over_ranks(value):
    """The mean of ``value`` (a number or a tensor) over all ranks (itself in one process)."""
    return sum_over_ranks(value) / world_size() if is_distributed() else value


@torch.no_grad()
def broadcast_buffers(module: nn.Module, src: int = 0, group=None) -> None:
    """Overwrite every buffer of ``module`` with rank ``src``'s, so that ranks embed alike."""
    if not is_distributed(group):
        return
    for buf in module.buffers():
        t = buf.to(comm_device(group, buf.device))
        dist.broadcast(t, src=src, group=group)
        if t is not buf:
            buf.copy_(t)
