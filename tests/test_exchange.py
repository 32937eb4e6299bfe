"""nnkloss.bank.exchange: the refresh split over two gloo processes (tests/two_processes.py).

Every rank must end a refresh with the same bank as every other rank and as one process with
the whole training set: rows embedded by several ranks are taken from the lowest, the sharded
list search gives the single-process lists, and errors are raised on every rank.
"""
import pytest
import torch
from torch.utils.data import DataLoader

import nnkloss
from nnkloss import CentreBank, Refresher
from nnkloss import distributed as nkd
from nnkloss.bank import exchange
from nnkloss.bank.search import faiss_available
from nnkloss.experiment.datasets import IndexedTensorDataset
from two_processes import (D, K, N, WORLD, assert_same as _same, finish, join, make_data,
                           make_model, run)


def empty_bank(dtype=torch.float32):
    return CentreBank(torch.zeros(N, D, dtype=dtype), torch.zeros(N, dtype=torch.long))


def refresh(loader, dtype=torch.float32, backend="torch", ensure_positive=True):
    bank = empty_bank(dtype)
    stats = Refresher(bank, make_model(), loader, K, search_backend=backend,
                      ensure_positive=ensure_positive, progress=False).refresh()
    return {"centres": bank.centres.clone(), "labels": bank.centre_labels.clone(),
            "neighbours": bank.neighbours.clone(), "num_patched": stats.num_patched,
            "positive_share": stats.positive_share,
            "mean_sq_distance": stats.mean_sq_distance}


def refresh_cases(ds, single: bool):
    """(name, kwargs, loader) of every refresh scenario; one loader over all rows if single."""
    cases = []
    for name, shuffle, batch, dtype, backend in [
            ("fp32", False, 5, torch.float32, "torch"),
            ("shuffled", True, 4, torch.float32, "torch"),
            ("bf16", False, 5, torch.bfloat16, "torch"),
            ("faiss", False, 5, torch.float32, "faiss")]:
        if backend == "faiss" and not faiss_available():
            continue
        if single:
            loader = DataLoader(ds, batch_size=8)
        else:
            sampler = nkd.distributed_sampler(ds, shuffle=shuffle, seed=5)
            loader = DataLoader(ds, batch_size=batch, sampler=sampler)
        cases.append((name, dict(dtype=dtype, backend=backend), loader))
    return cases


# ---------------------------------------------------------------------------- the children
def worker(rank, port, out_dir):
    torch.set_num_threads(1)
    x, y = make_data()
    ds = IndexedTensorDataset(x, y)
    results = {"refresh_single": {}, "refresh_dist": {}}
    # References first, before any process group exists: plain single-process code paths.
    assert not nkd.is_distributed()
    for name, kw, loader in refresh_cases(ds, single=True):
        results["refresh_single"][name] = refresh(loader, **kw)

    join(rank, port)
    for name, kw, loader in refresh_cases(ds, single=False):
        results["refresh_dist"][name] = refresh(loader, **kw)

    # Rows written by both ranks with different values: the lowest rank's win everywhere;
    # tiny rounds (3 rows per all_gather) exercise the chunked exchange.
    rows = torch.arange(N)
    written = (rows % WORLD == rank) | (rows < 3)
    centres = torch.full((N, D), float(rank + 1)).masked_fill(~written[:, None], float("nan"))
    labels = y.clone().masked_fill(~written, -5)
    exchange.gather_bank_rows(centres, labels, written, chunk_bytes=3 * D * 4)
    results["gathered"] = {"centres": centres, "labels": labels}
    lists = exchange.neighbour_lists(x, y, K, search_backend="torch", chunk_bytes=5 * K * 8)
    results["lists_small_rounds"] = lists.neighbours

    # Ranks whose embeddings differ in size or dtype: a clear error on every rank.
    for key, emb in (("size_error", torch.zeros(3, D + rank)),
                     ("dtype_error", torch.zeros(3, D, dtype=(torch.float64 if rank
                                                              else torch.float32)))):
        try:
            exchange.gather_batch_rows(torch.arange(3), emb)
            results[key] = None
        except ValueError as exc:
            results[key] = str(exc)
    all_idx, all_emb = exchange.gather_batch_rows(torch.arange(2) + 10 * rank,
                                                  torch.full((2, D), float(rank)))
    results["batch_rows"] = (all_idx, all_emb)

    # Rows that no rank embeds: a clear error on every rank, the bank untouched.
    sub = torch.utils.data.Subset(ds, list(range(N - 3)))
    loader = DataLoader(sub, batch_size=5, sampler=nkd.distributed_sampler(sub, shuffle=False))
    bank = empty_bank()
    bank.centres.fill_(7.0)
    try:
        Refresher(bank, make_model(), loader, K, search_backend="torch", progress=False).refresh()
        results["missing_error"] = None
    except ValueError as exc:
        results["missing_error"] = str(exc)
    results["missing_untouched"] = bool((bank.centres == 7.0).all())
    try:
        Refresher(empty_bank(), make_model(), loader, K, progress=False).refresh_async()
        results["async_error"] = None
    except RuntimeError as exc:
        results["async_error"] = str(exc)
    finish(results, rank, out_dir)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run(worker, str(tmp_path_factory.mktemp("exchange")))


# ---------------------------------------------------------------------------- tests
def test_refreshed_bank_identical_on_every_rank(results):
    r0, r1 = results[0]["refresh_dist"], results[1]["refresh_dist"]
    assert r0.keys() == r1.keys() and "fp32" in r0
    for name in r0:
        _same(r0[name], r1[name])


def test_distributed_refresh_equals_single_process(results):
    single, multi = results[0]["refresh_single"], results[0]["refresh_dist"]
    assert single.keys() == multi.keys()
    for name in single:
        s, m = single[name], multi[name]
        # Rows embedded in other batch compositions may differ in the last bits.
        tol = dict(rtol=1e-2, atol=1e-2) if s["centres"].dtype == torch.bfloat16 else {}
        torch.testing.assert_close(m["centres"], s["centres"], **tol)
        assert m["centres"].dtype == s["centres"].dtype
        assert torch.equal(m["labels"], s["labels"]), name
        assert torch.equal(m["neighbours"], s["neighbours"]), name
        assert m["num_patched"] == s["num_patched"] > 0, name
        assert m["positive_share"] == s["positive_share"], name
    assert torch.equal(single["fp32"]["labels"], make_data()[1])


def test_rows_written_twice_take_the_lowest_rank(results):
    owner = torch.where(torch.arange(N) < 3, 0, torch.arange(N) % WORLD)
    expected = (owner + 1).float()[:, None].expand(N, D)
    x, y = make_data()
    for r in results:
        assert torch.equal(r["gathered"]["centres"], expected)
        assert torch.equal(r["gathered"]["labels"], y)
        single = nnkloss.bank.search.neighbour_lists(x, y, K, search_backend="torch").neighbours
        assert torch.equal(r["lists_small_rounds"], single)


def test_rows_nobody_embedded_raise_on_every_rank(results):
    for r in results:
        assert r["missing_error"] is not None and "no rank's loader yielded 3" in r["missing_error"]
        assert "[34, 35, 36]" in r["missing_error"]
        assert r["missing_untouched"]


def test_embeddings_of_another_size_or_dtype_on_one_rank_raise_on_every_rank(results):
    """gather_batch_rows exchanges each rank's (rows, D, dtype) first: ranks that disagree
    raise, naming each rank's, instead of exchanging row buffers of different sizes."""
    for r in results:
        assert r["size_error"] is not None and "emb differs across ranks" in r["size_error"]
        assert f"0: (3, {D}, torch.float32), 1: (3, {D + 1}, torch.float32)" in r["size_error"]
        assert r["dtype_error"] is not None and "1: (3, 8, torch.float64)".replace(
            "8", str(D)) in r["dtype_error"]
        idx, emb = r["batch_rows"]
        assert idx.tolist() == [0, 1, 10, 11]
        assert torch.equal(emb, torch.tensor([0., 0., 1., 1.])[:, None].expand(4, D))


def test_async_refresh_refused(results):
    for r in results:
        assert r["async_error"] is not None and "async_mode=False" in r["async_error"]


def test_single_process_is_the_single_process_search():
    """Without a process group the list search is the plain one and async refresh is allowed."""
    assert not nkd.is_distributed()
    x, y = make_data()
    for ensure_positive in (False, True):
        got = exchange.neighbour_lists(x, y, K, search_backend="torch", ensure_positive=ensure_positive)
        want = nnkloss.bank.search.neighbour_lists(x, y, K, search_backend="torch",
                                                   ensure_positive=ensure_positive)
        assert torch.equal(got.neighbours, want.neighbours) and got.num_patched == want.num_patched
    exchange.check_async_refresh()


def test_exchange_arguments_are_checked_before_any_collective():
    """Mistakes in the arguments are the same on every rank, so they are raised before the
    first collective (no process group is needed to see them). Before: gather_batch_rows took
    its row count from idx, so an emb with fewer rows was padded with zeros that every rank
    wrote into the bank, one with more rows lost rows, float idx were truncated; gather_bank_rows
    read a (N, 1) written as rows (i, 0, j, 0, ...) and a longer written or shorter labels
    raised an IndexError naming nothing."""
    assert not nkd.is_distributed()
    idx, emb = torch.tensor([3, 1, 2]), torch.ones(3, 2)
    for bad_idx, bad_emb, exc, match in [
            (idx, emb[:2], ValueError, r"^emb has 2 rows but idx has 3"),
            (idx[:2], emb, ValueError, r"^emb has 3 rows but idx has 2"),
            (idx.float(), emb, TypeError, r"^idx must have an integer dtype"),
            (idx[:, None], emb, ValueError, r"^idx must be 1-D"),
            (idx, emb.flatten(), ValueError, r"^emb must be 2-D")]:
        with pytest.raises(exc, match=match):
            exchange.gather_batch_rows(bad_idx, bad_emb)
    centres, labels = torch.zeros(6, 2), torch.zeros(6, dtype=torch.long)
    written = torch.ones(6, dtype=torch.bool)
    for bad_labels, bad_written, exc, match in [
            (labels, written[:, None], ValueError, r"^written must have shape \(6,\)"),
            (labels, torch.ones(7, dtype=torch.bool), ValueError, r"^written must have shape"),
            (labels, torch.arange(6), TypeError, r"^written must be a bool tensor"),
            (labels[:5], written, ValueError, r"^centre_labels has length 5 but centres has 6")]:
        with pytest.raises(exc, match=match):
            exchange.gather_bank_rows(centres, bad_labels, bad_written)
