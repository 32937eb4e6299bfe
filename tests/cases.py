"""Shared cases of the tests: random inputs of the op, the op and the fp64 reference side by side,
and the comparison at per-dtype tolerances (used by the CPU, interpreter and CUDA tests); valid
arguments of the functional op; small banks (small_bank, random_bank, own_row_bank) and their
weights, shared by the tests of several modules; the kernel classifier's relative distances in
fp64 and their check, shared by the CPU library's and the Triton kernel's tests; the backward's
per-entry terms' cases and checks (list_case, centre_weight_sigma_grads), likewise; the spy on
BatchNorm calls (spy_batch_norms) of the tests of the folded eval-mode passes; a fresh
interpreter for code that may crash it (in_fresh_process, the CPU library's tests)."""
import torch

import nnkloss
from reference import reference_loss, reference_loss_rows

BACKENDS = ["torch", "triton"]


def make_case(B, N, D, K, C=3, seed=0, pad=0.0, weights=True, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(B, D, generator=g, dtype=torch.float64) * spread
    centres = torch.randn(N, D, generator=g, dtype=torch.float64) * spread
    labels = torch.randint(0, C, (B,), generator=g)
    centre_labels = torch.randint(0, C, (N,), generator=g)
    nb = torch.randint(0, N, (B, K), generator=g)
    if pad:
        nb = nb.masked_fill(torch.rand(B, K, generator=g) < pad, -1)
    w = (torch.rand(N, generator=g, dtype=torch.float64) + 0.25) if weights else None
    return emb, labels, centres, centre_labels, nb, w


def tolerances(emb_dtype, bank_dtype):
    if emb_dtype == torch.float64 and bank_dtype == torch.float64:
        return dict(rtol=1e-8, atol=1e-10)
    return dict(rtol=2e-4, atol=2e-5)


def logit_scale(emb, centres, nb, w, sigma, chunk_elems=1 << 22):
    """(B,) fp64: the largest |l_j| = |ln w_j - d_j / (2 sigma^2)| over each row's valid
    entries (0 for a row of padding only). A row's loss is a difference of two log-sum-exps of
    such logits, so its absolute error in a compute dtype of epsilon eps is of order
    eps * scale (the logits themselves are rounded to that): the per-row check allows it."""
    emb, centres = emb.detach().double().cpu(), centres.detach().double().cpu()
    nb = nb.cpu()
    K, D = nb.shape[1], emb.shape[1]
    lw = (torch.zeros(len(centres), dtype=torch.float64) if w is None
          else w.detach().double().cpu().log())
    out = torch.zeros(len(emb), dtype=torch.float64)
    step = max(1, chunk_elems // max(1, K * D))
    for b in range(0, len(emb), step):
        j = nb[b:b + step]
        valid = j >= 0
        jj = j.clamp_min(0)
        d = ((emb[b:b + step, None, :] - centres[jj]) ** 2).sum(-1)
        ell = (lw[jj] - d / (2 * sigma ** 2)).abs().masked_fill(~valid, 0)
        out[b:b + step] = ell.amax(-1) if K else 0
    return out


def check_rows_close(per_row, rows_ref, tol, emb, centres, nb, w, sigma):
    """per_row against the fp64 reference: within the dtype's tolerance, plus, below fp64,
    3 epsilons of the compute dtype (fp32) times the row's logit scale (:func:`logit_scale`):
    at D 512, |l| ~ 300 and one fp32 ulp of it is 3e-5, over the flat 2e-5 (seen on an H200,
    ea8736c, 15 of 1056 rows)."""
    got = per_row.detach().double().cpu()
    ref = rows_ref.double().cpu()
    allowed = tol["atol"] + tol["rtol"] * ref.abs()
    if per_row.dtype != torch.float64:
        allowed = allowed + 3 * torch.finfo(torch.float32).eps * logit_scale(
            emb, centres, nb, w, sigma)
    assert torch.equal(got.isnan(), ref.isnan()), "per_row: NaN rows differ"
    err = (got - ref).abs().nan_to_num(0.0)
    bad = err > allowed
    assert not bad.any(), (
        f"per_row: {int(bad.sum())} of {len(got)} rows off; worst row {int((err - allowed).argmax())}"
        f" (error {float(err.max()):.3g}, allowed there {float(allowed[(err - allowed).argmax()]):.3g})")


def run_op(backend, emb, labels, centres, cl, nb, w, sigma, reduction="mean", grads=True):
    emb = emb.detach().clone().requires_grad_(True)
    centres = centres.detach().clone().requires_grad_(grads)
    w = None if w is None else w.detach().clone().requires_grad_(grads)
    s = torch.tensor(sigma, dtype=torch.float64 if emb.dtype == torch.float64 else torch.float32,
                     device=emb.device, requires_grad=grads)
    out = nnkloss.neighbour_kernel_loss_with_stats(emb, labels, centres, cl, nb, w, s,
                                                   reduction=reduction, backend=backend)
    loss = out.loss if reduction != "none" else (out.loss * torch.linspace(0.5, 1.5, len(out.loss),
                                                                           dtype=out.loss.dtype)).sum()
    named = {"emb": emb}
    if grads:
        named.update(centres=centres, sigma=s)
        if w is not None:
            named["weights"] = w
    gr = torch.autograd.grad(loss, list(named.values()), allow_unused=True)
    return out, dict(zip(named, gr, strict=True))


def run_ref(emb, labels, centres, cl, nb, w, sigma, reduction="mean"):
    """The fp64 reference and its gradients, computed on CPU, returned on emb's device."""
    device = emb.device
    labels, cl, nb = labels.cpu(), cl.cpu(), nb.cpu()
    emb, centres = emb.cpu(), centres.cpu()
    w = None if w is None else w.cpu()
    rows, valid, grads = _run_ref_cpu(emb, labels, centres, cl, nb, w, sigma, reduction)
    return rows.to(device), valid.to(device), {n: g.to(device) for n, g in grads.items()}


def _run_ref_cpu(emb, labels, centres, cl, nb, w, sigma, reduction):
    emb = emb.detach().double().requires_grad_(True)
    centres = centres.detach().double().requires_grad_(True)
    w = None if w is None else w.detach().double().requires_grad_(True)
    s = torch.tensor(sigma, dtype=torch.float64, requires_grad=True)
    loss = reference_loss(emb, labels, centres, cl, nb, w, s, reduction=reduction)
    rows, valid = reference_loss_rows(emb.detach(), labels, centres.detach(), cl, nb,
                                      None if w is None else w.detach(), s.detach())
    if reduction == "none":
        loss = (loss * torch.linspace(0.5, 1.5, len(loss), dtype=loss.dtype)).sum()
    inputs = [emb, centres, s] + ([w] if w is not None else [])
    gr = torch.autograd.grad(loss, inputs, allow_unused=True)
    names = ["emb", "centres", "sigma", "weights"]
    return rows, valid, {n: (torch.zeros_like(i) if g is None else g)
                         for n, g, i in zip(names[:len(inputs)], gr, inputs, strict=True)}


def compare(case, backend, emb_dtype=torch.float32, bank_dtype=torch.float32, sigma=1.3,
            reduction="mean"):
    emb, labels, centres, cl, nb, w = case
    emb_c = emb.to(emb_dtype)
    cen_c = centres.to(bank_dtype)
    # The reference sees exactly the values the op sees (bank rounded to its dtype).
    rows_ref, valid_ref, g_ref = run_ref(emb_c, labels, cen_c, cl, nb, w, sigma, reduction)
    out, g = run_op(backend, emb_c, labels, cen_c, cl, nb, w, sigma, reduction)
    tol = tolerances(emb_dtype, bank_dtype)
    assert torch.equal(out.counted, valid_ref)
    check_rows_close(out.per_row, rows_ref, tol, emb_c, cen_c, nb, w, sigma)
    assert torch.isfinite(out.per_row).all()
    for name, ref in g_ref.items():
        got = g[name].double()
        assert torch.isfinite(got).all(), name
        low = {"centres": bank_dtype, "emb": emb_dtype}.get(name)
        if low in (torch.bfloat16, torch.float16):
            # The gradient is returned in the input's dtype: compare at that dtype's precision.
            torch.testing.assert_close(got, ref.to(low).double(), rtol=1.6e-2, atol=1e-3)
        else:
            scale = max(1.0, float(ref.abs().max()))
            torch.testing.assert_close(got, ref, rtol=tol["rtol"], atol=tol["atol"] * scale,
                                       msg=lambda m: f"{name}: {m}")
    return out


SHAPES = [
    # (B, N, D, K)
    (1, 1, 1, 1),        # smallest everything
    (4, 9, 1, 1),        # D = 1, K = 1
    (6, 40, 70, 5),      # D = 70 (not a power of two), K not a power of two
    (5, 25, 3, 13),      # K = 13
    (3, 7, 8, 33),       # K > N: many duplicates, K crosses several tiles
]


def spy_backend_forward(monkeypatch, record=lambda name, args: name):
    """A list that gets ``record(backend name, forward's arguments)`` for each call of a
    backend's forward as the op runs."""
    from nnkloss.ops import backends
    seen = []
    for name in ("torch", "cpu", "triton"):
        impl = backends.by_name(name)

        def forward(*args, _real=impl.forward, _name=name):
            seen.append(record(_name, args))
            return _real(*args)
        monkeypatch.setattr(impl, "forward", forward, raising=False)
    return seen


def spy_need_grad_x(monkeypatch, backend):
    """The need_grad_x of each call of the backend's forward (a list that fills as the op
    runs)."""
    return spy_backend_forward(monkeypatch, lambda name, args: args[8])


def spy_batch_norms(monkeypatch):
    """A list that gets an entry per call of any BatchNorm's forward (``_BatchNorm.forward``,
    which BatchNorm1d/2d/3d inherit) until ``monkeypatch.undo()``: empty after an eval-mode
    pass that ran with its BatchNorms folded (nnkloss/inference.py)."""
    seen = []
    bn_forward = torch.nn.modules.batchnorm._BatchNorm.forward
    monkeypatch.setattr(torch.nn.modules.batchnorm._BatchNorm, "forward",
                        lambda self, inp: seen.append(1) or bn_forward(self, inp))
    return seen


def small_bank(N=12, D=3, K=4, seed=0, **kw):
    """A CentreBank of N random centres (labels 0, 1, 2 in turn) with its K-nearest lists from
    the torch search; ``kw`` goes to CentreBank (weights, learn_weights)."""
    g = torch.Generator().manual_seed(seed)
    bank = nnkloss.CentreBank(torch.randn(N, D, generator=g), torch.arange(N) % 3, **kw)
    bank.rebuild_neighbours(K, search_backend="torch")
    return bank


def random_bank(N=30, D=6, K=5, C=3, seed=0, **kw):
    """A CentreBank of N random centres and C random labels with random lists of K rows (own
    row and duplicates possible); ``kw`` goes to CentreBank (weights, learn_weights)."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(N, D, generator=g)
    labels = torch.randint(0, C, (N,), generator=g)
    nb = torch.randint(0, N, (N, K), generator=g)
    return nnkloss.CentreBank(centres, labels, neighbours=nb, **kw)


def nonuniform(n, seed=1):
    """n fixed, non-uniform positive bank weights in [0.1, 3.1)."""
    return torch.rand(n, generator=torch.Generator().manual_seed(seed)) * 3 + 0.1


def good_op_args():
    """Valid keyword arguments of the functional op (4 rows, 6 centres, a padded list)."""
    return dict(emb=torch.randn(4, 3), labels=torch.tensor([0, 1, 0, 1]),
                centres=torch.randn(6, 3), centre_labels=torch.tensor([0, 1, 0, 1, 0, 1]),
                neighbours=torch.tensor([[0, 1], [2, 3], [4, 5], [1, -1]]),
                weights=torch.ones(6), sigma=1.0)


def own_row_bank(N=30, D=6, K=5, C=3, seed=0, **kw):
    """random_bank whose every list holds its own row first (which the losses must exclude)."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(N, D, generator=g)
    labels = torch.randint(0, C, (N,), generator=g)
    nb = torch.randint(0, N, (N, K), generator=g)
    nb[:, 0] = torch.arange(N)  # every list holds its own row: must be excluded
    return nnkloss.CentreBank(centres, labels, neighbours=nb, **kw)


def rel_sqdist_fp64(x, centres, idx, ref):
    """||x - c_i||^2 - ||x - c_r||^2 in fp64, from the values an implementation receives."""
    x, c = x.double(), centres.double()
    d = ((c[idx.long()] - x[:, None, :]) ** 2).sum(-1)
    return d - ((c[ref.long()] - x) ** 2).sum(-1)[:, None]


def check_rel_sqdist(impl, bank_dtype, cdt, D):
    """``impl(x, centres, idx, ref, cdt)`` (the classifier's relative distances) against fp64 on
    40 centres, 9 queries, lists of 11 with a row of duplicates; the reference entry exactly 0."""
    g = torch.Generator().manual_seed(D)
    centres = torch.randn(40, D, generator=g).to(bank_dtype)
    x = (torch.randn(9, D, generator=g) * 2).to(cdt)
    idx = torch.randint(0, 40, (9, 11), generator=g)
    idx[1, :] = idx[1, 0]  # duplicates
    ref = idx[:, 3]
    got = impl(x, centres, idx, ref, cdt)
    assert got.dtype == cdt and got.shape == (9, 11)
    want = rel_sqdist_fp64(x, centres, idx, ref)
    scale = want.abs().max().item() + 1.0
    tol = (1e-5 if cdt == torch.float32 else 1e-12) * scale
    torch.testing.assert_close(got.double(), want, rtol=0, atol=tol)
    assert (got[torch.arange(9), 3] == 0).all()  # the reference against itself: exactly 0


def list_case(B=9, K=7, D=13, N=20, emb_dtype=torch.float32, bank_dtype=torch.float32,
              idx_dtype=torch.int64, cl_dtype=torch.int64, weights=True, seed=0, classes=3):
    """Lists with rows of padding (0), duplicates (1), no positive (2) and a zero weight
    (row 3's first entry): the backward's per-entry terms' edge cases, shared by the CPU
    library's and the Triton kernels' tests."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(N, D, generator=g).to(bank_dtype)
    centre_labels = torch.randint(0, classes, (N,), generator=g).to(cl_dtype)
    nb = torch.randint(0, N, (B, K), generator=g)
    nb[0, 1:] = -1                          # mostly padding
    nb[1, :] = nb[1, 0]                     # duplicates
    labels = torch.randint(0, classes, (B,), generator=g)
    labels[2] = classes + 5                 # no positive
    emb = (centres[nb[:, 0].clamp_min(0)].float()
           + 0.5 * torch.randn(B, D, generator=g)).to(emb_dtype)
    w = None
    if weights:
        w = torch.rand(N, generator=g) + 0.1
        w[nb[3, 0]] = 0.0                   # a zero weight
    return emb, labels, centres, centre_labels, nb.to(idx_dtype), w, torch.tensor(1.7)


def centre_weight_sigma_grads(backend, emb, labels, centres, cl, nb, w, sigma, dtype,
                              reduction="mean", row_grad=None, create_graph=False):
    """The loss and the gradients of emb, centres, weights and sigma on ``backend``."""
    x = emb.to(dtype).clone().requires_grad_(True)
    c = centres.to(dtype).clone().requires_grad_(True)
    ww = w.clone().requires_grad_(True)
    ss = torch.tensor(float(sigma), dtype=dtype, requires_grad=True)
    with nnkloss.value_checks(False):
        out = nnkloss.neighbour_kernel_loss(x, labels, c, cl, nb, ww, ss, reduction=reduction,
                                            backend=backend)
    target = out if row_grad is None else (out * row_grad.to(out.dtype)).sum()
    grads = torch.autograd.grad(target, [x, c, ww, ss], create_graph=create_graph)
    return [out] + list(grads)


def check_entry_terms_of_nan_rows(backend):
    """A row that gathers an inf centre is NaN (checks off): it passes NaN to sigma, to its
    entries' weights and to the centres it gathers, as the torch form does; the same row with
    an incoming gradient of 0 passes nothing, NaN or not."""
    emb, labels, centres, cl, nb, w, s = list_case(B=6, K=5, D=7, N=30, seed=3)
    centres = centres.clone()
    centres[nb[4, 2]] = float("inf")
    for row_grad in (torch.ones(6), torch.tensor([1.0, 1, 1, 1, 0, 1])):
        got = centre_weight_sigma_grads(backend, emb, labels, centres, cl, nb, w, s,
                                        torch.float32, reduction="none", row_grad=row_grad)
        want = centre_weight_sigma_grads("torch", emb, labels, centres, cl, nb, w, s,
                                         torch.float32, reduction="none", row_grad=row_grad)
        for a, b in zip(got[2:], want[2:], strict=True):
            assert torch.equal(torch.isnan(a), torch.isnan(b))
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, equal_nan=True)
        if row_grad[4] == 0:
            assert torch.isfinite(got[3]).all() and torch.isfinite(got[4])
        else:
            assert torch.isnan(got[4]) and torch.isnan(got[3][nb[4]]).all()


def in_fresh_process(code, env_extra, timeout=240):
    """Run ``code`` in a new interpreter from the repository root (a SIGBUS or a foreign
    constructor there shows as a failed test, not a dead pytest)."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root, **env_extra)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=root)
