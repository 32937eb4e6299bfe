"""Fused nearest-neighbour Gaussian kernel loss: the forward and the centre-gradient scatter.

Plain tensors in and out, following the forward contract (nnkloss/ops/CONTRACT.md: its rules
2-5 define z_j = (c_j - x) / sigma, scaled before squaring, u_j = ||z_j||^2, the logits and
the loss; grad_x = (1/sigma) sum_j (p_j - p^R_j) z_j). The forward streams a row's list in
[BLOCK_K, D] tiles through two online-softmax accumulators (all / same-class), each with its
own running max so that neither underflows. A row with a non-finite u_j or log-weight comes
out NaN everywhere (counted apart: max does not propagate NaN reliably), never as "no
positive". Launch rules: kernels/config.py.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from .config import (MAX_SINGLE_PASS_BLOCK_D, FwdConfig, cdiv, centre_grad_config,  # noqa: F401
                     default_config, pow2_ceil, sm_count)
# Partials the last program of a MEAN launch reads per step (8 a thread of one warp).
MEAN_BLOCK = tl.constexpr(256)


@triton.jit
def _aligned_row_offsets(idx, stride, ROW_ALIGN: tl.constexpr):
    """idx * stride, written so that Triton knows it is a multiple of ROW_ALIGN (the launcher
    checked stride and base): what lets it emit 128-bit gathers at any row width."""
    return idx * (stride // ROW_ALIGN) * ROW_ALIGN


@triton.jit
def _gather_rows(ptr, idx, row_mask, stride, dd, dmask, ROW_ALIGN: tl.constexpr,
                 COMPUTE: tl.constexpr):
    """Load the [BLOCK_K, BLOCK_D] tile ptr[idx[k], dd[d]] (0 where masked), as COMPUTE."""
    rows = _aligned_row_offsets(idx, stride, ROW_ALIGN)
    tile = tl.load(ptr + rows[:, None] + dd[None, :],
                   mask=row_mask[:, None] & dmask[None, :], other=0.0)
    return tile.to(COMPUTE)


@triton.jit
def _gather_scaled_diff(cen_ptr, idx, nonpad, stride_cn, x, inv_sigma, dd, dmask,
                        ROW_ALIGN: tl.constexpr, COMPUTE: tl.constexpr):
    """z = (c_idx - x) * (1/sigma) on one tile (0 for padding), and u = sum_d z^2 of it."""
    c = _gather_rows(cen_ptr, idx, nonpad, stride_cn, dd, dmask, ROW_ALIGN, COMPUTE)
    z = tl.where(nonpad[:, None], (c - x[None, :]) * inv_sigma, 0.0)
    return z, tl.sum(z * z, axis=1)


@triton.jit
def _list_entries(nbr_ptr, row, stride_nb, kk, K):
    """The list entries kk of a row as int64, -1 (padding) past K."""
    return tl.load(nbr_ptr + row * stride_nb + kk, mask=kk < K, other=-1).to(tl.int64)


@triton.jit
def _entry_meta(idx, clab_ptr, w_ptr, kk, K, N, label, HAS_W: tl.constexpr,
                COMPUTE: tl.constexpr):
    """Masks and log-weights of one tile of list entries (``_list_entries``); ``past``: entries
    >= N (value checks off), which read nothing and make their row non-finite (CONTRACT.md 9)."""
    kmask = kk < K
    nonpad = kmask & (idx >= 0)
    past = nonpad & (idx >= N)
    inbank = nonpad & ~past
    safe = tl.where(inbank, idx, 0)
    clab = tl.load(clab_ptr + safe, mask=inbank, other=0)
    if HAS_W:
        w = tl.load(w_ptr + safe, mask=inbank, other=0.0).to(COMPUTE)
        valid = nonpad & (w != 0)
        # log of a NaN/negative weight is NaN, of inf is inf: counted as bad by the caller.
        logw = tl.log(tl.where(valid, w, 1.0))
    else:
        valid = nonpad
        logw = tl.zeros_like(kk).to(COMPUTE)
    same = valid & (clab == label)
    return kmask, nonpad, past, safe, valid, same, logw


@triton.jit
def _online_update(m, s, logits):
    """One online-logsumexp step: returns (new max, rescale factor, exp weights, new sum)."""
    m_new = tl.maximum(m, tl.max(logits, axis=0))
    # Nothing valid yet (m_new -inf): shift by 0, so that exp(-inf - 0) = 0, not nan.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_safe)
    p = tl.exp(logits - m_safe)
    s_new = s * alpha + tl.sum(p, axis=0)
    return m_new, alpha, p, s_new


@triton.jit
def _lse(m, s):
    return tl.where(s > 0, m + tl.log(tl.where(s > 0, s, 1.0)), float("-inf"))


@triton.jit
def _nk_fwd_kernel(
    emb_ptr, lab_ptr, cen_ptr, clab_ptr, nbr_ptr, w_ptr, sigma_ptr,
    loss_ptr, lse_all_ptr, lse_pos_ptr, gx_ptr, dist_ptr,
    counted_ptr, part_ptr, part_n_ptr, ticket_ptr, mean_ptr, divisor_ptr,
    B, K, D, N,
    stride_eb, stride_cn, stride_nb, stride_gb, stride_db,
    HAS_W: tl.constexpr, COMPUTE: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, SINGLE_PASS: tl.constexpr,
    STORE_DIST: tl.constexpr, ROW_ALIGN: tl.constexpr, EMB_ALIGN: tl.constexpr,
    ROWS: tl.constexpr, GRAD_X: tl.constexpr, PREFETCH_INDEX: tl.constexpr,
    MEAN: tl.constexpr,
):
    """ROWS query rows per program. GRAD_X False: the forward-only build (gx_ptr untouched).
    PREFETCH_INDEX: load the next tile's list entries during this tile (the same values).
    MEAN: also the counted rows and their mean and divisor (step 5, deterministic).
    Memory traffic per row: reads K * (D * sizeof(bank) + sizeof(nbr) + sizeof(label) [+ 4
    weight]) and the row (the centres again on the two-phase path); writes loss, lse_all,
    lse_pos, D * 4 of grad_x (GRAD_X) and K * 4 of dist (STORE_DIST, or the two-phase scratch).
    """
    # Step 0: per-program constants. Rows past B repeat row B-1: no row mask is needed.
    sigma = tl.load(sigma_ptr).to(COMPUTE)
    inv_sigma = 1.0 / sigma
    offs_k = tl.arange(0, BLOCK_K)
    offs_d = tl.arange(0, BLOCK_D)
    # Column masks constant over whole vectors (row_align divides D): wide loads.
    Dc = (D // ROW_ALIGN) * ROW_ALIGN
    De = (D // EMB_ALIGN) * EMB_ALIGN
    for r in range(ROWS):
        row = tl.minimum(tl.program_id(0).to(tl.int64) * ROWS + r, B - 1)
        label = tl.load(lab_ptr + row)
        erow = _aligned_row_offsets(row, stride_eb, EMB_ALIGN)

        zero = tl.sum(tl.zeros([BLOCK_K], dtype=COMPUTE), axis=0)
        m_all = zero + float("-inf")
        s_all = zero
        m_pos = zero + float("-inf")
        s_pos = zero
        n_bad = tl.sum(tl.zeros([BLOCK_K], dtype=tl.int32), axis=0)
        acc_all = tl.zeros([BLOCK_D], dtype=COMPUTE)
        acc_pos = tl.zeros([BLOCK_D], dtype=COMPUTE)
        if SINGLE_PASS:
            dmask = offs_d < Dc
            x = tl.load(emb_ptr + erow + offs_d, mask=offs_d < De, other=0.0).to(COMPUTE)

        # Step 1: stream the list in [BLOCK_K, D] tiles: gather, scaled distances, online
        # logsumexp of all / same-class logits (and, single pass, the weighted sums of z).
        # PREFETCH_INDEX: a tile then waits on one round trip to memory instead of two.
        if PREFETCH_INDEX:
            idx_next = _list_entries(nbr_ptr, row, stride_nb, offs_k, K)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + offs_k
            if PREFETCH_INDEX:
                idx = idx_next
                idx_next = _list_entries(nbr_ptr, row, stride_nb, kk + BLOCK_K, K)
            else:
                idx = _list_entries(nbr_ptr, row, stride_nb, kk, K)
            kmask, nonpad, past, safe, valid, same, logw = _entry_meta(
                idx, clab_ptr, w_ptr, kk, K, N, label, HAS_W, COMPUTE)
            inbank = nonpad & ~past
            # Distances of zero-weight entries are computed too: the weight gradient needs them.
            if SINGLE_PASS:
                z, u = _gather_scaled_diff(cen_ptr, safe, inbank, stride_cn, x, inv_sigma,
                                           offs_d, dmask, ROW_ALIGN, COMPUTE)
            else:
                u = tl.zeros([BLOCK_K], dtype=COMPUTE)
                for d0 in range(0, D, BLOCK_D):
                    dd = d0 + offs_d
                    dm = dd < Dc
                    xc = tl.load(emb_ptr + erow + dd, mask=dd < De, other=0.0).to(COMPUTE)
                    zc, uc = _gather_scaled_diff(cen_ptr, safe, inbank, stride_cn, xc, inv_sigma,
                                                 dd, dm, ROW_ALIGN, COMPUTE)
                    u += uc
            # An entry past the bank: distance NaN, so that step 2 counts its row non-finite.
            u = tl.where(past, float("nan"), u)
            if STORE_DIST:
                tl.store(dist_ptr + row * stride_db + kk, u, mask=kmask)
            # Step 2: non-finite entries are counted (the row's outputs become NaN, contract
            # item 6), then neutralised so that the arithmetic below stays finite.
            fin_u = tl.abs(u) < float("inf")  # False for NaN too
            fin_w = tl.abs(logw) < float("inf")
            n_bad += tl.sum(((nonpad & ~fin_u) | (valid & ~fin_w)).to(tl.int32), axis=0)
            ok = valid & fin_u & fin_w
            logit = tl.where(ok, logw - 0.5 * tl.where(ok, u, 0.0), float("-inf"))
            logit_pos = tl.where(same, logit, float("-inf"))
            m_all, alpha_all, p_all, s_all = _online_update(m_all, s_all, logit)
            m_pos, alpha_pos, p_pos, s_pos = _online_update(m_pos, s_pos, logit_pos)
            if SINGLE_PASS and GRAD_X:
                z = tl.where(ok[:, None], z, 0.0)
                acc_all = acc_all * alpha_all + tl.sum(p_all[:, None] * z, axis=0)
                acc_pos = acc_pos * alpha_pos + tl.sum(p_pos[:, None] * z, axis=0)

        # Step 3: row scalars. Rows without a same-class entry: loss 0, lse_pos -inf, grad 0.
        is_bad = n_bad > 0
        has_pos = s_pos > 0
        lse_all = _lse(m_all, s_all)
        lse_pos = _lse(m_pos, s_pos)
        loss = tl.where(has_pos, lse_all - lse_pos, 0.0)
        tl.store(lse_all_ptr + row, tl.where(is_bad, float("nan"), lse_all))
        tl.store(lse_pos_ptr + row, tl.where(is_bad, float("nan"), lse_pos))
        tl.store(loss_ptr + row, tl.where(is_bad, float("nan"), loss))
        if MEAN:
            # A counted row has a same-class entry or is non-finite (its NaN reaches the mean).
            tl.store(counted_ptr + row, (is_bad | has_pos).to(tl.int8))
        grow = row * stride_gb

        # Step 4: grad_x = (1/sigma) sum_j (p_j - p^R_j) z_j (not in the forward-only build).
        # Probabilities are normalised by the computed sums (never exp(l - lse)).
        if GRAD_X and SINGLE_PASS:
            scale_all = tl.where(has_pos, inv_sigma / tl.where(s_all > 0, s_all, 1.0), 0.0)
            scale_pos = tl.where(has_pos, inv_sigma / tl.where(has_pos, s_pos, 1.0), 0.0)
            gx = acc_all * scale_all - acc_pos * scale_pos
            tl.store(gx_ptr + grow + offs_d, tl.where(is_bad, float("nan"), gx),
                     mask=offs_d < D)
        if GRAD_X and not SINGLE_PASS:
            # Two-phase path for wide D: the final maxima and sums are known now; u is re-read
            # from dist (this program's own stores, made visible first).
            tl.debug_barrier()
            m_all_s = tl.where(m_all == float("-inf"), 0.0, m_all)
            m_pos_s = tl.where(m_pos == float("-inf"), 0.0, m_pos)
            inv_s_all = 1.0 / tl.where(s_all > 0, s_all, 1.0)
            inv_s_pos = 1.0 / tl.where(has_pos, s_pos, 1.0)
            for d0 in range(0, D, BLOCK_D):
                dd = d0 + offs_d
                dm = dd < Dc
                xc = tl.load(emb_ptr + erow + dd, mask=dd < De, other=0.0).to(COMPUTE)
                g = tl.zeros([BLOCK_D], dtype=COMPUTE)
                for k0 in range(0, K, BLOCK_K):
                    kk = k0 + offs_k
                    idx = _list_entries(nbr_ptr, row, stride_nb, kk, K)
                    kmask, nonpad, past, safe, valid, same, logw = _entry_meta(
                        idx, clab_ptr, w_ptr, kk, K, N, label, HAS_W, COMPUTE)
                    u = tl.load(dist_ptr + row * stride_db + kk, mask=kmask, other=0.0)
                    ok = valid & (tl.abs(u) < float("inf")) & (tl.abs(logw) < float("inf"))
                    logit = logw - 0.5 * tl.where(ok, u, 0.0)
                    p_all = tl.where(ok, tl.exp(logit - m_all_s) * inv_s_all, 0.0)
                    p_pos = tl.where(ok & same, tl.exp(logit - m_pos_s) * inv_s_pos, 0.0)
                    coef = tl.where(has_pos, p_all - p_pos, 0.0)
                    zc, uc = _gather_scaled_diff(cen_ptr, safe, ok, stride_cn, xc, inv_sigma,
                                                 dd, dm, ROW_ALIGN, COMPUTE)
                    g += tl.sum(coef[:, None] * zc, axis=0)
                g = g * inv_sigma
                tl.store(gx_ptr + grow + dd, tl.where(is_bad, float("nan"), g), mask=dd < D)

    # Step 5: the counted mean. Each program sums its own rows' stored losses and flags; the
    # last to take the ticket sums the partials in program order and resets the ticket.
    if MEAN:
        pid = tl.program_id(0)
        tl.debug_barrier()  # this program's stores of loss and counted, visible to its threads
        own = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)
        mine = own < B
        part = tl.sum(tl.load(loss_ptr + own, mask=mine, other=0.0), axis=0)
        part_n = tl.sum(tl.load(counted_ptr + own, mask=mine, other=0).to(tl.int32), axis=0)
        tl.store(part_ptr + pid, part)
        tl.store(part_n_ptr + pid, part_n)
        tl.debug_barrier()
        programs = tl.num_programs(0)
        ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel")
        if ticket == programs - 1:
            offs = tl.arange(0, MEAN_BLOCK)
            total = tl.zeros([MEAN_BLOCK], dtype=COMPUTE)
            count = tl.zeros([MEAN_BLOCK], dtype=tl.int32)
            for p0 in range(0, programs, MEAN_BLOCK):
                pm = p0 + offs < programs
                total += tl.load(part_ptr + p0 + offs, mask=pm, other=0.0, volatile=True)
                count += tl.load(part_n_ptr + p0 + offs, mask=pm, other=0, volatile=True)
            divisor = tl.maximum(tl.sum(count, axis=0), 1).to(COMPUTE)
            tl.store(mean_ptr, tl.sum(total, axis=0) / divisor)
            tl.store(divisor_ptr, divisor)
            tl.atomic_xchg(ticket_ptr, 0)


@triton.jit
def _nk_centre_grad_kernel(
    emb_ptr, cen_ptr, nbr_ptr, coef_ptr, gcen_ptr,
    K, D, N,
    stride_eb, stride_cn, stride_nb, stride_fb, stride_gn,
    COMPUTE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
    ROW_ALIGN: tl.constexpr, EMB_ALIGN: tl.constexpr,
):
    """grad_centres[j] += coef[b, k] * (x_b - c_j) for each neighbours[b, k] = j in [0, N).

    Program (b, d-block). Memory traffic per row: reads K * (D * sizeof(bank) + sizeof(nbr) + 4)
    + D * sizeof(emb); atomic adds K * D * sizeof(compute) (coef 0 skipped)."""
    # Step 0: the row's embedding block.
    row = tl.program_id(0).to(tl.int64)
    dblock = tl.program_id(1)
    offs_k = tl.arange(0, BLOCK_K)
    dd = dblock * BLOCK_D + tl.arange(0, BLOCK_D)
    dm = dd < (D // ROW_ALIGN) * ROW_ALIGN
    erow = _aligned_row_offsets(row, stride_eb, EMB_ALIGN)
    x = tl.load(emb_ptr + erow + dd, mask=dd < (D // EMB_ALIGN) * EMB_ALIGN,
                other=0.0).to(COMPUTE)
    # Step 1: gather each tile of centres, scatter coef * (x - c).
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        kmask = kk < K
        idx = tl.load(nbr_ptr + row * stride_nb + kk, mask=kmask, other=-1).to(tl.int64)
        coef = tl.load(coef_ptr + row * stride_fb + kk, mask=kmask, other=0.0).to(COMPUTE)
        # An entry past the bank (value checks off) is skipped, as padding is (CONTRACT.md 9).
        valid = kmask & (idx >= 0) & (idx < N) & (coef != 0)
        safe = tl.where(valid, idx, 0)
        c = _gather_rows(cen_ptr, safe, valid, stride_cn, dd, dm, ROW_ALIGN, COMPUTE)
        contrib = coef[:, None] * (x[None, :] - c)
        tl.atomic_add(gcen_ptr + safe[:, None] * stride_gn + dd[None, :], contrib,
                      mask=valid[:, None] & dm[None, :])


def _compute_dtype(emb: torch.Tensor) -> torch.dtype:
    return torch.float64 if emb.dtype == torch.float64 else torch.float32


def _tl_dtype(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def unit_column_stride(*tensors: torch.Tensor):
    """The 2-D ``tensors`` with unit column stride, copied only where they have another."""
    return tuple(t if t.stride(1) == 1 else t.contiguous() for t in tensors)


def row_align(D: int, t: torch.Tensor) -> int:
    """Largest A (elements, a power of two, at most 16 bytes) dividing D, the row stride of
    ``t`` and its base: what a kernel may promise about every row start (1: nothing)."""
    a = max(1, 16 // t.element_size())
    while a > 1:
        if (D % a == 0 and (t.stride(0) % a == 0 or t.shape[0] <= 1)
                and t.data_ptr() % (a * t.element_size()) == 0):
            return a
        a //= 2
    return 1


def _check_config(cfg: FwdConfig):
    for name in ("block_k", "block_d", "rows"):
        v = getattr(cfg, name)
        if v < 1 or v & (v - 1):
            raise ValueError(f"config.{name} must be a power of two, got {v}")


def neighbour_kernel_fwd(emb, labels, centres, centre_labels, neighbours, weights, sigma,
                         max_block_d: int = MAX_SINGLE_PASS_BLOCK_D,
                         config: Optional[FwdConfig] = None, store_dist: bool = True,
                         need_grad_x: bool = True, mean: bool = False):
    """Launch the fused forward (nnkloss/ops/CONTRACT.md).

    Args:
        emb: (B, D) fp16/bf16/fp32/fp64, row stride arbitrary, unit column stride.
        labels: (B,) int32/int64. centres: (N, D) fp16/bf16/fp32/fp64, unit column stride.
        centre_labels: (N,) int32/int64 (may differ from ``labels``' dtype).
        neighbours: (B, K) int32/int64, ``-1`` = padding, unit column stride.
        weights: (N,) float or None (all ones). sigma: 0-dim float tensor on the same device.
        max_block_d: widest D block in registers (tests lower it to reach the two-phase path).
        config: explicit launch configuration; default :func:`default_config`.
        store_dist: write the (B, K) scaled distances (the backward for weights, sigma or
            centres needs them); False returns an empty (B, 0) tensor.
        need_grad_x: compute grad_x; False launches the forward-only build and returns an
            empty (B, 0) grad_x.
        mean: also return the contract's ``counted`` (B,) bool, ``mean`` and ``divisor``.

    Returns:
        The contract's loss, lse_all, lse_pos, grad_x (B, D) or (B, 0) and dist (B, K) or
        (B, 0), in the compute dtype; with ``mean`` then counted, mean and divisor.
    """
    B, D = emb.shape
    K = neighbours.shape[1]
    N = centres.shape[0]
    cdt = _compute_dtype(emb)
    dev = emb.device
    loss = torch.empty(B, device=dev, dtype=cdt)
    lse_all = torch.empty(B, device=dev, dtype=cdt)
    lse_pos = torch.empty(B, device=dev, dtype=cdt)
    grad_x = torch.empty(B, D if need_grad_x else 0, device=dev, dtype=cdt)
    dist = torch.empty(B, K if store_dist else 0, device=dev, dtype=cdt)
    align = row_align(D, centres)
    cfg = config if config is not None else default_config(
        K, D, max_block_d, centres.element_size(), need_grad_x, B, sm_count(dev),
        cdt.itemsize, align * centres.element_size() >= 4)
    _check_config(cfg)
    out = (loss, lse_all, lse_pos, grad_x, dist)
    programs = cdiv(B, cfg.rows)
    if mean:
        counted = torch.empty(B, device=dev, dtype=torch.bool)
        parts = torch.empty(programs * 2, device=dev, dtype=cdt)  # sums, then counts
        part_n = parts[programs:].view(torch.int32)[:programs]
        out = out + (counted, torch.empty((), device=dev, dtype=cdt),
                     torch.empty((), device=dev, dtype=cdt))
    if B == 0 or K == 0:
        # No entry: no positive, nothing to read. An empty bank (N 0) is launched: its entries
        # are padding or past the bank (NaN rows, CONTRACT.md 9).
        for t in out:
            t.zero_()
        lse_all.fill_(float("-inf"))
        lse_pos.fill_(float("-inf"))
        if mean:
            out[7].fill_(1.0)
        return out
    single = cfg.single_pass(D)
    write_dist = store_dist or (need_grad_x and not single)  # the two-phase scratch
    dbuf = torch.empty(B, K, device=dev, dtype=cdt) if write_dist and not store_dist else dist
    w = weights if weights is not None else centres  # dummy pointer when HAS_W is False
    gx = grad_x if need_grad_x else loss  # dummy pointer, never written without GRAD_X
    _nk_fwd_kernel[(programs,)](
        emb, labels, centres, centre_labels, neighbours, w, sigma,
        loss, lse_all, lse_pos, gx, dbuf,
        *((counted.view(torch.int8), parts, part_n, ticket(dev), out[6], out[7]) if mean
          else (loss,) * 6),
        B, K, D, N,
        emb.stride(0), centres.stride(0), neighbours.stride(0), gx.stride(0),
        dbuf.stride(0) if write_dist else 0,
        HAS_W=weights is not None, COMPUTE=_tl_dtype(cdt),
        BLOCK_K=cfg.block_k, BLOCK_D=cfg.block_d, SINGLE_PASS=single,
        STORE_DIST=write_dist, ROW_ALIGN=align, EMB_ALIGN=row_align(D, emb),
        ROWS=cfg.rows, GRAD_X=need_grad_x, PREFETCH_INDEX=bool(cfg.prefetch_index),
        MEAN=bool(mean), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


@functools.lru_cache(maxsize=None)
def ticket(device: torch.device, slot: int = 0) -> torch.Tensor:
    """A zeroed int32 counter on ``device`` per ``slot`` (0: the forward's mean, 1: the batch
    lists' counts), made once: launches leave it at 0. A slot's launches share one stream."""
    return torch.zeros(4, dtype=torch.int32, device=device)


def centre_grad(emb, centres, neighbours, coef):
    """Scatter ``coef[b, k] * (emb[b] - centres[neighbours[b, k]])`` into an (N, D) gradient
    in the compute dtype (fp64 for fp64 ``emb``, else fp32).

    Args:
        emb: (B, D) float; centres: (N, D) float; neighbours: (B, K) int32/int64, -1 = padding
            (any strides: copied where the columns are not adjacent);
        coef: (B, K) float, contiguous (zero entries are skipped; already holds 1/sigma^2).
    """
    B, D = emb.shape
    N = centres.shape[0]
    K = neighbours.shape[1]
    cdt = _compute_dtype(emb)
    grad = torch.zeros(N, D, device=emb.device, dtype=cdt)
    if B == 0 or N == 0 or K == 0:
        return grad
    emb, centres, neighbours = unit_column_stride(emb, centres, neighbours)
    block_k, block_d = centre_grad_config(K, D)
    grid = (B, cdiv(D, block_d))
    _nk_centre_grad_kernel[grid](
        emb, centres, neighbours, coef, grad,
        K, D, N,
        emb.stride(0), centres.stride(0), neighbours.stride(0), coef.stride(0), grad.stride(0),
        COMPUTE=_tl_dtype(cdt), BLOCK_K=block_k, BLOCK_D=block_d,
        ROW_ALIGN=row_align(D, centres), EMB_ALIGN=row_align(D, emb),
    )
    return grad
