"""kernels/batch_lists.py: a batch's lists in one launch, against torch's gather, exclusion
and drop (Triton's interpreter on CPU tensors); and its CPU twin of the same contract,
nnkloss.cpu.batch_lists (one call of the compiled library), by the same checks."""
import pytest
import torch

import nnkloss
from nnkloss import cpu

INTS = [torch.int32, torch.int64]


def _kernels():
    return nnkloss.ops.backends.kernels()


class _CpuLibrary:
    """The compiled library's batch_lists where the Triton launcher's name is looked up, its
    host ints as the launcher's counts tensor."""

    @staticmethod
    def batch_lists(*args):
        lists, counts = cpu.batch_lists(*args)
        assert type(counts) is tuple and all(type(c) is int for c in counts)
        return lists, torch.tensor(counts)


def _impl(name):
    return _kernels() if name == "triton" else _CpuLibrary


# Both implementations of the contract: the Triton kernel through the interpreter, the CPU
# library where a compiler built it.
IMPLS = [pytest.param("triton", marks=pytest.mark.interpreter),
         pytest.param("cpu", marks=pytest.mark.skipif(not cpu.available(),
                                                      reason="no C++ compiler: fallback only"))]


def _torch_form(table, idx, labels, bank_labels, exclude_self):
    """The lists and counts as torch computes them, out-of-range rows handled apart."""
    N = table.shape[0]
    i = idx.long()
    in_bank = (i >= 0) & (i < N)
    safe = torch.where(in_bank, i, 0)
    lists = table[safe] if N else table.new_zeros(idx.shape[0], table.shape[1])
    if exclude_self:
        lists = lists.masked_fill(lists == safe[:, None], -1)
    own = bank_labels.long()[safe] if N else torch.zeros_like(i)
    drop = ~in_bank | (own != labels.long())
    lists = lists.masked_fill(drop[:, None], -1)
    return lists, torch.tensor([int(drop.sum()), int((~in_bank).sum())])


def _case(B, N, K, table_dtype, label_dtype, seed):
    g = torch.Generator().manual_seed(seed)
    table = torch.randint(0, N, (N, K), generator=g).to(table_dtype)
    table[torch.rand(N, K, generator=g) < 0.1] = -1
    # Every row lists itself somewhere, so that the exclusion has work to do.
    if K:
        table[torch.arange(N), torch.randint(0, K, (N,), generator=g)] = (
            torch.arange(N).to(table_dtype))
    bank_labels = torch.randint(0, 5, (N,), generator=g).to(label_dtype)
    idx = torch.randint(0, N, (B,), generator=g)
    labels = bank_labels[idx].to(torch.int64)
    return table, idx, labels, bank_labels


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("table_dtype", INTS)
@pytest.mark.parametrize("label_dtype", [torch.int16, torch.int32, torch.int64])
@pytest.mark.parametrize("B,K", [(1, 1), (37, 7), (20, 300)])
@pytest.mark.parametrize("exclude_self", [True, False])
def test_lists_exclusion_and_drop_match_torch(impl, table_dtype, label_dtype, B, K,
                                              exclude_self):
    # K 300: chunks of 256 (the second ragged) in programs of 4 rows, five of them at B 20;
    # K 7: one program of 128 rows, 37 of them live.
    table, idx, labels, bank_labels = _case(B, 50, K, table_dtype, label_dtype, B + K)
    k = _impl(impl)
    lists, counts = k.batch_lists(table, idx, labels, bank_labels, exclude_self)
    want, want_counts = _torch_form(table, idx, labels, bank_labels, exclude_self)
    assert lists.dtype == table_dtype and lists.shape == (B, K)
    assert counts.dtype == torch.int64 and counts.shape == (2,)
    assert torch.equal(lists.long(), want.long()) and torch.equal(counts, want_counts)
    assert counts.tolist() == [0, 0]
    if exclude_self:
        assert not bool((lists.long() == idx[:, None]).any())
    # Misaligned rows (one in the last program), then rows outside the bank.
    bad = labels.clone()
    bad[[0, B - 1]] += 1
    lists, counts = k.batch_lists(table, idx, bad, bank_labels, exclude_self)
    want, want_counts = _torch_form(table, idx, bad, bank_labels, exclude_self)
    assert torch.equal(lists.long(), want.long()) and torch.equal(counts, want_counts)
    assert counts.tolist() == [len({0, B - 1}), 0] and bool((lists[B - 1] == -1).all())
    far = idx.clone()
    far[0], far[B - 1] = -3, 50
    lists, counts = k.batch_lists(table, far, labels, bank_labels, exclude_self)
    want, want_counts = _torch_form(table, far, labels, bank_labels, exclude_self)
    assert torch.equal(lists.long(), want.long()) and torch.equal(counts, want_counts)
    assert counts.tolist() == [len({0, B - 1})] * 2


@pytest.mark.parametrize("impl", IMPLS)
def test_counts_add_up_over_programs_and_edges(impl):
    # K 1: programs of 1024 rows, so 5000 rows are five, each dropping rows (the last partial).
    table, idx, labels, bank_labels = _case(5000, 40, 1, torch.int64, torch.int32, 3)
    labels[::7] += 1
    idx[::11] = 40
    k = _impl(impl)
    lists, counts = k.batch_lists(table, idx, labels, bank_labels, True)
    want, want_counts = _torch_form(table, idx, labels, bank_labels, True)
    assert torch.equal(lists, want) and torch.equal(counts, want_counts)
    assert 0 < int(counts[1]) < int(counts[0])
    # An empty batch, lists of no entries, a bank of no rows, a strided table.
    lists, counts = k.batch_lists(table, idx[:0], labels[:0], bank_labels, True)
    assert lists.shape == (0, 1) and counts.tolist() == [0, 0]
    empty = torch.zeros(40, 0, dtype=torch.int32)
    lists, counts = k.batch_lists(empty, idx[:9], labels[:9], bank_labels, True)
    assert lists.shape == (9, 0) and lists.dtype == torch.int32
    assert counts.tolist() == _torch_form(empty, idx[:9], labels[:9], bank_labels, True)[1].tolist()
    lists, counts = k.batch_lists(table[:0], idx[:4], labels[:4], bank_labels[:0], True)
    assert bool((lists == -1).all()) and counts.tolist() == [4, 4]
    wide = torch.randint(0, 40, (40, 12))
    lists, _ = k.batch_lists(wide[:, ::3], idx[:30], labels[:30], bank_labels, False)
    assert torch.equal(lists, _torch_form(wide[:, ::3].contiguous(), idx[:30], labels[:30],
                                          bank_labels, False)[0])


@pytest.mark.cuda
@pytest.mark.parametrize("table_dtype", INTS)
@pytest.mark.parametrize("B,K", [(4096, 100), (128, 1000), (3000, 7)])
def test_cuda_kernel_matches_torch(table_dtype, B, K):
    """The compiled kernel on a GPU: many programs, each dropping rows (counted by atomics),
    rows outside the bank, against torch's form on the CPU."""
    table, idx, labels, bank_labels = _case(B, 5000, K, table_dtype, torch.int32, B + K)
    labels[::13] += 1
    idx[::17] = -1
    idx[5::19] = 5000
    want, want_counts = _torch_form(table, idx, labels, bank_labels, True)
    lists, counts = _kernels().batch_lists(table.cuda(), idx.cuda(), labels.cuda(),
                                           bank_labels.cuda(), True)
    assert torch.equal(lists.cpu(), want) and torch.equal(counts.cpu(), want_counts)


@pytest.mark.skipif(not cpu.available(), reason="no C++ compiler: fallback only")
def test_cpu_twin_leaves_what_it_does_not_take_to_the_caller():
    """None (the loss's torch route takes over) for float or bool labels or rows, labels whose
    length is not the batch's or the bank's, a table that is not int32 / int64; without labels
    only the rows outside the bank are dropped and counted."""
    table, idx, labels, bank_labels = _case(30, 50, 6, torch.int64, torch.int64, 5)
    for args in ((table, idx, labels.float(), bank_labels),
                 (table, idx.float(), labels, bank_labels),
                 (table, idx, labels.bool(), bank_labels),
                 (table, idx, labels[:-1], bank_labels),
                 (table, idx, labels, bank_labels[:-1]),
                 (table.to(torch.int16), idx, labels, bank_labels)):
        assert cpu.batch_lists(*args, True) is None
    far = idx.clone()
    far[[2, 9]] = torch.tensor([50, -1])
    lists, counts = cpu.batch_lists(table, far, None, None, True)
    want, _ = _torch_form(table, far, bank_labels[far.clamp(0, 49)], bank_labels, True)
    assert torch.equal(lists, want) and counts == (2, 2)
    assert cpu.gather_lists(table, far, True) is None  # its caller's range check raises
