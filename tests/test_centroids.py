"""Centroid banks (NCM / NCMC), k-means, and growing a bank with CentreBank.add."""
import numpy as np
import pytest
import torch

from nnkloss import CentreBank, NeighbourKernelClassifier, neighbour_kernel_loss
from nnkloss.bank.centroids import class_centroids, kmeans


def blobs(per_class=(30, 20, 25), d=4, seed=0, spread=10.0):
    g = torch.Generator().manual_seed(seed)
    labels = torch.cat([torch.full((n,), c) for c, n in enumerate(per_class)]).long()
    means = torch.randn(len(per_class), d, generator=g) * spread
    return means[labels] + torch.randn(labels.shape[0], d, generator=g), labels


def test_class_means_exact():
    emb, labels = blobs()
    labels = torch.where(labels == 2, torch.tensor(7), labels)  # label gap: 0, 1, 7
    perm = torch.randperm(labels.shape[0], generator=torch.Generator().manual_seed(1))
    emb, labels = emb[perm], labels[perm]
    bank = CentreBank.from_class_means(emb, labels)
    assert bank.centre_labels.tolist() == [0, 1, 7]
    assert bank.centres.dtype == torch.float32 and not bank.has_neighbours
    for row, c in enumerate([0, 1, 7]):
        expect = emb[labels == c].double().mean(0).float()
        assert torch.equal(bank.centres[row], expect)
    assert bank.num_classes == 8


def test_class_means_dtypes_and_numpy():
    emb, labels = blobs()
    b64 = CentreBank.from_class_means(emb.double(), labels)  # fp64 in: fp32 bank
    assert b64.centres.dtype == torch.float32
    bnp = CentreBank.from_class_means(emb.numpy(), labels.numpy())
    torch.testing.assert_close(bnp.centres, b64.centres)
    bh = CentreBank.from_class_means(emb.half(), labels)
    assert bh.centres.dtype == torch.float16


def test_per_class_centroid_counts():
    emb, labels = blobs(per_class=(30, 2, 1, 5))
    emb[labels == 3] = emb[labels == 3][:2].repeat(3, 1)[:5]  # class 3: 5 rows, 2 distinct
    centres, centre_labels = class_centroids(emb, labels, per_class=3, seed=0)
    assert centre_labels.tolist() == [0, 0, 0, 1, 1, 2, 3, 3]
    assert centres.shape == (8, 4)
    # Classes no larger than per_class keep their distinct examples as centroids.
    assert torch.equal(centres[5], emb[labels == 2][0])
    got = {tuple(r) for r in centres[6:].tolist()}
    assert got == {tuple(r) for r in emb[labels == 3].tolist()}
    bank = CentreBank.from_class_means(emb, labels, per_class=3)
    assert torch.equal(bank.centre_labels, centre_labels)


def test_per_class_centroids_find_sub_clusters():
    # Each class is two far-apart blobs: two centroids per class land on the blob means.
    g = torch.Generator().manual_seed(2)
    sub = torch.tensor([[0.0, 0.0], [50.0, 0.0], [0.0, 50.0], [50.0, 50.0]])
    which = torch.arange(4).repeat_interleave(40)
    emb = sub[which] + torch.randn(160, 2, generator=g)
    labels = which // 2
    centres, centre_labels = class_centroids(emb, labels, per_class=2, seed=0)
    assert centre_labels.tolist() == [0, 0, 1, 1]
    for c in range(2):
        got = sorted(centres[centre_labels == c].tolist())
        expect = sorted(emb[which == s].mean(0).tolist() for s in (2 * c, 2 * c + 1))
        torch.testing.assert_close(torch.tensor(got), torch.tensor(expect))


def test_kmeans_deterministic_and_validated():
    emb, _ = blobs()
    c1, a1 = kmeans(emb, 3, seed=5)
    c2, a2 = kmeans(emb, 3, seed=5)
    assert torch.equal(c1, c2) and torch.equal(a1, a2)
    assert a1.shape == (75,) and a1.dtype == torch.int64 and set(a1.tolist()) == {0, 1, 2}
    with pytest.raises(ValueError, match="n_clusters"):
        kmeans(torch.zeros(5, 2), 2)  # one distinct row
    with pytest.raises(ValueError, match="n_clusters"):
        kmeans(emb, 0)


def test_class_centroids_validation():
    emb, labels = blobs()
    with pytest.raises(ValueError, match="per_class"):
        class_centroids(emb, labels, per_class=0)
    with pytest.raises(ValueError, match="labels"):
        class_centroids(emb, labels[:3])
    with pytest.raises(ValueError, match="labels"):
        class_centroids(emb, labels - 1)
    with pytest.raises(TypeError, match="emb"):
        class_centroids([[0.0]], torch.tensor([0]))
    with pytest.raises(ValueError, match="NaN"):
        class_centroids(torch.full((3, 2), float("nan")), torch.tensor([0, 0, 1]))


def test_added_class_is_predicted_at_its_centre():
    emb, labels = blobs()
    bank = CentreBank.from_class_means(emb, labels)
    clf = NeighbourKernelClassifier(bank, k=3, sigma=1.0)
    new_centre = torch.full((1, 4), 40.0)
    out = bank.add(new_centre, torch.tensor([3]))
    assert out is bank and bank.num_centres == 4 and bank.num_classes == 4
    assert clf.predict(new_centre).item() == 3
    torch.testing.assert_close(bank.weights.detach(), torch.ones(4))
    # Existing classes are unchanged by the addition.
    means = torch.stack([emb[labels == c].mean(0) for c in range(3)])
    assert clf.predict(means).tolist() == [0, 1, 2]


def test_add_pads_lists_and_appends_weights():
    centres = torch.randn(4, 3)
    bank = CentreBank(centres, torch.tensor([0, 0, 1, 1]),
                      neighbours=torch.tensor([[1, 2], [0, 3], [3, 0], [2, 1]]),
                      weights=torch.tensor([1.0, 2.0, 3.0, 4.0]))
    bank.add(torch.randn(2, 3, dtype=torch.float64), torch.tensor([2, 2]),
             weights=torch.tensor([0.5, 0.25]))
    assert bank.neighbours.tolist()[4:] == [[-1, -1], [-1, -1]]
    assert bank.neighbours.tolist()[:4] == [[1, 2], [0, 3], [3, 0], [2, 1]]
    torch.testing.assert_close(bank.weights.detach(), torch.tensor([1.0, 2.0, 3.0, 4.0, 0.5, 0.25]))
    assert bank.centres.dtype == torch.float32 and torch.equal(bank.centres[:4], centres)
    # Default weights for added centres are one; lists stay empty for a bank without lists.
    plain = CentreBank(centres, torch.tensor([0, 0, 1, 1]))
    plain.add(torch.randn(1, 3), torch.tensor([5]))
    assert not plain.has_neighbours and plain.weights_for_loss() is None


def test_add_validation_leaves_bank_unchanged():
    bank = CentreBank(torch.randn(3, 2), torch.tensor([0, 1, 2]))
    before = bank.centres.clone()
    with pytest.raises(ValueError, match="dimension"):
        bank.add(torch.randn(1, 5), torch.tensor([0]))
    with pytest.raises(ValueError, match="labels"):
        bank.add(torch.randn(2, 2), torch.tensor([0]))
    with pytest.raises(ValueError, match="labels"):
        bank.add(torch.randn(1, 2), torch.tensor([-3]))
    with pytest.raises(ValueError, match="weights"):
        bank.add(torch.randn(1, 2), torch.tensor([0]), weights=torch.tensor([-1.0]))
    with pytest.raises(ValueError, match="weights"):
        bank.add(torch.randn(1, 2), torch.tensor([0]), weights=torch.tensor([1.0, 1.0]))
    with pytest.raises(ValueError, match="NaN"):
        bank.add(torch.full((1, 2), float("nan")), torch.tensor([0]))
    assert torch.equal(bank.centres, before) and bank.num_centres == 3


def test_loss_on_class_mean_bank_is_ncm_log_loss():
    # Eq. 3 with bank = class means, lists = all centres, 1/(2 sigma^2) = 1/2: the NCM
    # log-loss of Mensink et al., -log softmax_c(-||x - mu_c||^2 / 2)[y].
    emb, labels = blobs(spread=1.0)
    bank = CentreBank.from_class_means(emb, labels, per_class=1)
    x = emb[:10].clone().requires_grad_(True)
    nb = torch.arange(bank.num_centres).expand(10, -1)
    loss = neighbour_kernel_loss(x, labels[:10], bank.centres, bank.centre_labels, nb, sigma=1.0,
                                 reduction="none", backend="torch")
    d = torch.cdist(x.detach().double(), bank.centres.double()) ** 2
    ref = -torch.log_softmax(-d / 2, 1).gather(1, labels[:10, None])[:, 0]
    torch.testing.assert_close(loss.double(), ref, atol=1e-5, rtol=1e-5)
    loss.sum().backward()
    assert torch.isfinite(x.grad).all()


def test_loss_and_classifier_on_ncmc_bank_with_added_class():
    emb, labels = blobs()
    bank = CentreBank.from_class_means(np.asarray(emb), np.asarray(labels), per_class=2)
    bank.add(torch.full((1, 4), 40.0), torch.tensor([3]))
    n = bank.num_centres
    nb = torch.arange(n).expand(5, -1)
    loss = neighbour_kernel_loss(emb[:5], labels[:5], bank.centres, bank.centre_labels, nb,
                                 sigma=2.0, backend="torch")
    assert torch.isfinite(loss)
    pred = NeighbourKernelClassifier(bank, k=n, sigma=2.0).predict(emb)
    assert (pred == labels).double().mean() > 0.95


def test_add_to_an_empty_bank_takes_the_new_dimension():
    """An empty bank has no dimension to keep (add skips the check, as update_ does): its
    first centres set it. The (0, D) centres were concatenated with the new ones, so centres of
    another D raised torch.cat's size error, naming nothing."""
    bank = CentreBank(torch.zeros(0, 4), torch.zeros(0, dtype=torch.long))
    # Seeded and spread out: with unseeded unit-scale centres the prediction at centre 0 went
    # to class 1 (weights 2 + 0.5 against 1) in about 1 draw of 100.
    g = torch.Generator().manual_seed(0)
    new = torch.randn(3, 5, dtype=torch.float64, generator=g) * 10
    bank.add(new, torch.tensor([0, 1, 1]), weights=torch.tensor([1.0, 2.0, 0.5]))
    assert bank.dim == 5 and bank.num_centres == 3 and bank.centres.dtype == torch.float32
    assert torch.equal(bank.centres, new.float()) and bank.centre_labels.tolist() == [0, 1, 1]
    torch.testing.assert_close(bank.weights.detach(), torch.tensor([1.0, 2.0, 0.5]))
    clf = NeighbourKernelClassifier(bank, k=3, sigma=1.0, search_backend="torch")
    assert clf.predict(new.float()[:1]).tolist() == [0]


def test_add_with_weights_keeps_the_old_log_weights_bit_for_bit():
    """add(weights=) passed exp(log_weights) of the old rows back through update_, which took
    their log again: learned log-weights moved by an ulp (about 1 in 8), and one trained below
    fp32's exp range (weight 0 in fp32, e.g. -110) came back -inf and the add was refused as
    "learnable weights must start strictly positive". Only the new rows' weights are logged."""
    g = torch.Generator().manual_seed(0)
    lw = torch.randn(1000, generator=g) * 3
    lw[7] = -110.0
    bank = CentreBank(torch.randn(1000, 3, generator=g), torch.zeros(1000, dtype=torch.long),
                      weights=torch.ones(1000), learn_weights=True,
                      neighbours=torch.zeros(1000, 2, dtype=torch.long).add_(1))
    bank.log_weights.data.copy_(lw)
    param = bank.log_weights
    bank.add(torch.randn(2, 3, generator=g), torch.tensor([1, 1]),
             weights=torch.tensor([0.5, 2.0], dtype=torch.float64))
    assert bank.log_weights is param and param.requires_grad and param.shape == (1002,)
    assert torch.equal(param.detach()[:1000], lw)
    torch.testing.assert_close(bank.weights.detach()[1000:], torch.tensor([0.5, 2.0]))
    assert bank.weights_for_loss() is not None
    assert bank.neighbours.tolist()[1000:] == [[-1, -1], [-1, -1]]
    # Validation of the new weights still names them, and leaves the bank as it was.
    with pytest.raises(ValueError, match="^learnable weights must start strictly positive"):
        bank.add(torch.randn(1, 3), torch.tensor([1]), weights=torch.tensor([0.0]))
    with pytest.raises(ValueError, match="^weights must be finite and non-negative$"):
        bank.add(torch.randn(1, 3), torch.tensor([1]), weights=torch.tensor([float("nan")]))
    assert bank.num_centres == 1002 and torch.equal(param.detach()[:1000], lw)
    # A fixed-weight bank: new rows take the given weights, uniform banks stop being uniform
    # only when rows with weights are added.
    plain = CentreBank(torch.randn(3, 3), torch.tensor([0, 1, 2]))
    plain.add(torch.zeros(0, 3), torch.zeros(0, dtype=torch.long), weights=torch.zeros(0))
    assert plain.weights_for_loss() is None
    plain.add(torch.randn(1, 3), torch.tensor([3]), weights=torch.tensor([0.0]))
    assert plain.weights.detach().tolist() == [1.0, 1.0, 1.0, 0.0]


def test_centres_beyond_their_dtype_and_unsquarable_points_raise_naming_emb():
    """fp64 embeddings beyond fp32's range gave inf class means (fp64 gives fp32 centres)
    without an error; k-means of rows whose squared distances overflow (1e20 in fp32, 1e300
    in fp64) or underflow to 0 (distinct rows 1e-30 apart in fp32) failed in
    torch.multinomial ("invalid multinomial distribution"), naming nothing."""
    big = torch.tensor([[1e300, 0.0], [1e300, 1.0]], dtype=torch.float64)
    for per_class in (1, 2):  # the mean, and the distinct rows of a small class
        with pytest.raises(ValueError, match=r"^emb holds torch.float64 values whose centres "
                                             r"overflow torch.float32"):
            class_centroids(big, torch.tensor([0, 0]), per_class=per_class)
    cases = [(torch.tensor([[1e300, 0], [-1e300, 0], [1e300, 1]], dtype=torch.float64),
              "too large to square in torch.float64"),
             (torch.tensor([[1e20, 0], [-1e20, 0], [1e20, 1]]), "too large to square"),
             (torch.tensor([[0.0], [1e-30], [2e-30]]), "underflow to 0 when squared")]
    for x, what in cases:
        with pytest.raises(ValueError, match=r"^emb \(the rows of class 4\) .*" + what):
            class_centroids(x, torch.tensor([4, 4, 4]), per_class=2)
        with pytest.raises(ValueError, match=r"^x .*" + what):
            kmeans(x, 2)
    # Large but squarable values, and a small class of huge fp32 rows (no k-means), still work.
    c, _ = class_centroids(torch.tensor([[1e15, 0], [-1e15, 0], [1e15, 1]]),
                           torch.tensor([0, 0, 0]), per_class=2)
    assert torch.isfinite(c).all() and c.shape == (2, 2)
    c, _ = class_centroids(torch.tensor([[3e38, 0], [-3e38, 0]]), torch.tensor([0, 0]),
                           per_class=2)
    assert torch.equal(c, torch.tensor([[-3e38, 0], [3e38, 0]]))


def test_seed_must_be_an_int_torch_takes():
    """A float seed was truncated (1.5 and 1.7 gave the same centroids) and one past 64 bits
    failed in torch's manual_seed ("Overflow when unpacking long long"), naming nothing."""
    emb, labels = blobs()
    for seed in (1.5, True, 2 ** 64 - 1, -2 ** 63 - 1, "0"):
        with pytest.raises(ValueError, match=r"^seed must be an int"):
            class_centroids(emb, labels, per_class=2, seed=seed)
        with pytest.raises(ValueError, match=r"^seed must be an int"):
            kmeans(emb, 2, seed=seed)
    a = class_centroids(emb, labels, per_class=2, seed=np.int64(3))
    b = class_centroids(emb, labels, per_class=2, seed=3)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert class_centroids(emb, labels, per_class=2, seed=-5)[0].shape == (6, 4)


def test_a_class_centroids_depend_on_its_own_rows_and_the_seed_only():
    """Each class's k-means is seeded from (seed, its label). It was seed + the class's position
    among the classes of the call: class 2 alone got other centroids than class 2 among all
    (position 0 against 2), and seed s's class 1 took seed s + 1's class 0 stream."""
    emb, labels = blobs(per_class=(40, 40, 40), spread=1.0)   # overlapping: seeds matter
    per = 4
    cents, cl = class_centroids(emb, labels, per_class=per, seed=7)
    alone, alone_cl = class_centroids(emb[labels == 2], labels[labels == 2], per_class=per,
                                      seed=7)
    assert torch.equal(alone_cl, cl[cl == 2]) and torch.equal(alone, cents[cl == 2])
    # another seed, another start for every class (k-means++ picks other first points)
    other, _ = class_centroids(emb, labels, per_class=per, seed=8)
    assert not torch.equal(other, cents)
    again, _ = class_centroids(emb, labels, per_class=per, seed=7)
    assert torch.equal(again, cents)


def test_adding_centres_beyond_the_banks_dtype_names_the_overflow():
    """fp32 centres of 1e5 added to an fp16 bank (largest 65504) were refused as "centres
    contain NaN or inf", which they did not: the cast to the bank's dtype made them inf."""
    bank = CentreBank(torch.zeros(3, 2, dtype=torch.float16), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match=r"centres hold values beyond the bank's dtype "
                                         r"torch.float16 \(largest 65504\)"):
        bank.add(torch.full((1, 2), 1e5), torch.tensor([3]))
    with pytest.raises(ValueError, match=r"^centres contain NaN or inf$"):
        bank.add(torch.full((1, 2), float("nan")), torch.tensor([3]))
    with pytest.raises(ValueError, match=r"beyond the bank's dtype torch.float16"):
        bank.update_(centres=torch.full((3, 2), -7e4))             # update_ as add
    assert bank.num_centres == 3 and bool((bank.centres == 0).all())


def test_numpy_inputs_of_any_byte_order_or_read_only():
    """class_centroids and the classifier take numpy arrays as the metrics do (one
    conversion, centroids.as_tensor): a big-endian or read-only array gave torch.from_numpy's
    error, which names no argument, or its warning."""
    import warnings
    emb, labels = blobs()
    big = np.asarray(emb).astype(">f4")
    frozen = np.asarray(labels).copy()
    frozen.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        centres, centre_labels = class_centroids(big, frozen)
        want, _ = class_centroids(emb, labels)
        assert torch.equal(centres, want)
        bank = CentreBank(centres, centre_labels)
        pred = NeighbourKernelClassifier(bank, k=3, sigma=1.0).predict(big)
    assert torch.equal(pred, NeighbourKernelClassifier(bank, k=3, sigma=1.0).predict(emb))
    with pytest.raises(TypeError, match="emb must be a torch.Tensor or numpy array"):
        NeighbourKernelClassifier(bank, k=3, sigma=1.0).predict([[0.0] * 4])
