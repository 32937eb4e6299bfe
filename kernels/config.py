"""Launch rules of the fused forward and the centre-gradient scatter: tile, warps, rows.

Plain Python, no Triton: the launchers call these on every launch, on the host. The figures
behind each rule (GPU sweeps, the static build report) are in docs/PERFORMANCE.md,
"The launch rule and its evidence"; the build gate (tests/test_kernels_build_gate.py) holds
every default build spill-free with at least 16 resident warps per SM.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

# Widest power-of-two D held in registers (the single-pass path); wider rows take the
# two-phase path: distances first, then the weighted sums chunk by chunk over D.
MAX_SINGLE_PASS_BLOCK_D = 4096
# Bytes of the gathered centre tile each thread holds.
BYTES_PER_THREAD = 64
# Rows of a one-warp training tile (fp32 / 2-byte banks), at least this many elements a thread.
TRAIN_ROWS = 2
TRAIN_MIN_ELEMS_PER_THREAD = 8
# Warps per SM below which a batch's tiles lengthen: by Little's law a GPU needs about 8
# one-warp tiles of 2 KB per SM in flight to keep its memory busy.
SMALL_BATCH_WARPS_PER_SM = 8
# Elements a thread of such a batch's tiles (half for 8-byte elements; half again from
# FEW_WARPS_PER_SM up). Below FEW_WARPS_PER_SM a row also takes up to 4 warps.
SMALL_BATCH_ELEMS_PER_THREAD = 64
FEW_WARPS_PER_SM = 2
# Elements of one centre-gradient tile: each is an atomic add with its own 64-bit address,
# so registers grow with the tile; 2048 keeps every build at 16 resident warps per SM.
CENTRE_GRAD_TILE = 2048


# Triton's next_power_of_2 and cdiv are constexpr functions whose call wrapper costs
# microseconds on the host; these are plain expressions.
def pow2_ceil(n: int) -> int:
    """The smallest power of two >= max(n, 1) (``triton.next_power_of_2(max(n, 1))``)."""
    return 1 << (max(n, 1) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers, b > 0 (``triton.cdiv``)."""
    return -(-a // b)


@dataclass(frozen=True)
class FwdConfig:
    """Launch configuration of the forward kernel.

    block_k: neighbours per tile (power of two); block_d: columns per tile (power of two; the
    single-pass path when it covers D); num_warps / num_stages: as for any Triton launch;
    rows: query rows per program (for rows too small to fill a tile).
    """
    block_k: int
    block_d: int
    num_warps: int = 4
    num_stages: int = 2
    rows: int = 1
    # Load the next tile's list entries during this one (the kernel's PREFETCH_INDEX): a tile
    # then waits on one dependent load instead of two. The same outputs bit for bit; off until
    # a GPU has timed it (benchmarks/tune_loss.py times the default with it).
    prefetch_index: bool = False

    def single_pass(self, D: int) -> bool:
        return self.block_d >= D


def default_config(K: int, D: int, max_block_d: int = MAX_SINGLE_PASS_BLOCK_D,
                   elem_size: int = 4, grad_x: bool = True, B: Optional[int] = None,
                   sms: Optional[int] = None, compute_size: int = 4,
                   aligned: bool = True) -> FwdConfig:
    """The forward's tile for lists of K entries of D columns, a bank of ``elem_size`` bytes.

    1. The whole row in registers up to D = 4096, on the fewest warps whose threads hold at
       most 16 of its elements (8 for 8-byte ones): warps split a row's columns, never the
       list, since every tile reduces over the list six times and a reduction across warps
       goes through shared memory between barriers.
    2. block_k: the rows that give each thread BYTES_PER_THREAD of the bank; 4 rows a program
       when one warp's tile holds the whole list. A one-warp training tile (grad_x: it also
       holds two weighted sums of z) of a 4- or 2-byte bank takes TRAIN_ROWS rows instead.
    3. Two-phase (D > 4096): at most 16 elements a thread, and a training row spreads over
       16 warps (at 32 elements, or a training row at 8 warps, ptxas spills); its tiles never
       lengthen.
    4. A batch whose programs give an SM (``sms`` of them) under SMALL_BATCH_WARPS_PER_SM
       warps lengthens its tiles: each program walks its list alone, and the time goes by
       tiles, each waiting on its entries and then on their rows.

    fp64 computation (``compute_size`` 8) sizes the tile as an fp64 bank does: registers hold
    the gathered values in the compute dtype. Rows not ``aligned`` to 4 bytes (a 2-byte bank
    at odd D: one load an element) size it as a 4-byte bank does.
    """
    if compute_size > 4:
        elem_size = max(elem_size, compute_size)
    if not aligned:
        elem_size = max(elem_size, 4)
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
    dimension, so wide rows spread over programs), at most CENTRE_GRAD_TILE elements a tile."""
    block_d = min(pow2_ceil(D), 256)
    block_k = max(1, min(pow2_ceil(K), CENTRE_GRAD_TILE // block_d, 64))
    return block_k, block_d


def sm_count(device: torch.device) -> Optional[int]:
    """Streaming multiprocessors of a CUDA device (None elsewhere: the interpreter), asked
    once per device."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    n = _SMS.get(index)
    if n is None:
        n = _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return n


_SMS: dict = {}
