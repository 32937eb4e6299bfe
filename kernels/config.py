"""Launch rules of the fused forward and the centre-gradient scatter: tile, warps, rows.

Plain Python, run on the host at every launch. The evidence behind each rule is in
docs/PERFORMANCE.md, "The launch rule and its evidence"; the build gate
(tests/test_kernels_build_gate.py) holds every default build spill-free.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional

import torch

# Widest D held in registers (single pass); wider rows take the two-phase path.
MAX_SINGLE_PASS_BLOCK_D = 4096
# Bytes of the gathered centre tile each thread holds.
BYTES_PER_THREAD = 64
# Rows of a one-warp training tile (fp32 / 2-byte banks), at least this many elements a thread.
TRAIN_ROWS = 2
TRAIN_MIN_ELEMS_PER_THREAD = 8
# Warps per SM below which a batch's tiles lengthen (Little's law: 8 one-warp tiles an SM).
SMALL_BATCH_WARPS_PER_SM = 8
# Elements a thread of such a batch's tiles (halved for 8-byte elements, and again from
# FEW_WARPS_PER_SM up); below FEW_WARPS_PER_SM a row also takes up to 4 warps.
SMALL_BATCH_ELEMS_PER_THREAD = 64
FEW_WARPS_PER_SM = 2
# Elements of one centre-gradient tile (each an atomic add with its own 64-bit address).
CENTRE_GRAD_TILE = 2048


# Plain expressions: Triton's constexpr helpers cost microseconds a call on the host.
def pow2_ceil(n: int) -> int:
    """The smallest power of two >= max(n, 1) (``triton.next_power_of_2(max(n, 1))``)."""
    return 1 << (max(n, 1) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers, b > 0 (``triton.cdiv``)."""
    return -(-a // b)


@dataclass(frozen=True)
class FwdConfig:
    """Launch configuration of the forward kernel: block_k neighbours by block_d columns a
    tile (powers of two; single pass when block_d covers D), ``rows`` query rows a program."""
    block_k: int
    block_d: int
    num_warps: int = 4
    num_stages: int = 2
    rows: int = 1
    # The kernel's PREFETCH_INDEX (the same outputs bit for bit); off until a GPU has timed it.
    prefetch_index: bool = False

    def single_pass(self, D: int) -> bool:
        return self.block_d >= D


def default_config(K: int, D: int, max_block_d: int = MAX_SINGLE_PASS_BLOCK_D,
                   elem_size: int = 4, grad_x: bool = True, B: Optional[int] = None,
                   sms: Optional[int] = None, compute_size: int = 4,
                   aligned: bool = True) -> FwdConfig:
    """The forward's tile for lists of K entries of D columns, a bank of ``elem_size`` bytes
    (fp64 computation sizes it as an fp64 bank, rows not 4-byte ``aligned`` as a 4-byte one).

    1. The row in registers up to D = 4096, on the fewest warps whose threads hold at most 16
       of its elements (8 of 8 bytes): warps split columns, never the list.
    2. block_k: BYTES_PER_THREAD of the bank a thread; 4 rows a program when one warp holds
       the whole list; a one-warp training tile of a 4- or 2-byte bank takes TRAIN_ROWS rows.
    3. Two-phase (D > 4096): at most 16 elements a thread, a training row over up to 16 warps.
    4. A batch giving the ``sms`` SMs under SMALL_BATCH_WARPS_PER_SM warps each lengthens its
       tiles (each waits on its entries, then on their rows).
    """
    if compute_size > 4 or not aligned:
        elem_size = max(elem_size, compute_size if compute_size > 4 else 4)
    block_d = min(pow2_ceil(D), max_block_d)
    kp2 = pow2_ceil(K)
    row_elems = 8 if elem_size > 4 else 16  # of one row, a thread
    num_warps = 1
    while num_warps < 16 and block_d > row_elems * 32 * num_warps:
        num_warps *= 2
    per_thread = max(1, BYTES_PER_THREAD // elem_size)  # of the tile, a thread
    block_k = max(1, min(kp2, per_thread * 32 * num_warps // block_d))
    rows = 4 if K * D <= per_thread * 32 else 1
    if grad_x and num_warps == 1 and elem_size <= 4 and rows == 1:
        block_k = min(kp2, max(TRAIN_ROWS, TRAIN_MIN_ELEMS_PER_THREAD * 32 // block_d))
    if block_d < D:
        if grad_x and elem_size <= 4:
            while num_warps < 16 and block_d > 8 * 32 * num_warps:
                num_warps *= 2
            block_k = 16 * 32 * num_warps // block_d
        block_k = max(1, min(block_k, kp2, 16 * 32 * num_warps // block_d))
        return FwdConfig(block_k, block_d, num_warps, 2, rows)
    warps_per_sm = cdiv(B, rows) * num_warps / sms if B is not None and sms else math.inf
    if warps_per_sm < SMALL_BATCH_WARPS_PER_SM:
        elems = SMALL_BATCH_ELEMS_PER_THREAD * row_elems // 16
        if warps_per_sm >= FEW_WARPS_PER_SM:
            elems //= 2
        while (num_warps < 4 and warps_per_sm < FEW_WARPS_PER_SM
               and elems * 32 * num_warps // block_d < kp2):
            num_warps *= 2
            warps_per_sm *= 2
        block_k = min(kp2, max(block_k, elems * 32 * num_warps // block_d))
    return FwdConfig(block_k, block_d, num_warps, 2, rows)


def centre_grad_config(K: int, D: int):
    """(block_k, block_d) of the centre-gradient scatter: D blocks of up to 256 columns (a grid
    axis), at most CENTRE_GRAD_TILE elements a tile."""
    block_d = min(pow2_ceil(D), 256)
    block_k = max(1, min(pow2_ceil(K), CENTRE_GRAD_TILE // block_d, 64))
    return block_k, block_d


def sm_count(device: torch.device) -> Optional[int]:
    """Streaming multiprocessors of a CUDA device, asked once (None elsewhere)."""
    if device.type != "cuda":
        return None
    return _sms(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
