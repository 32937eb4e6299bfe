"""The Triton forward with several K tiles (K > BLOCK_K), against the fp64 reference.

With the default launch config a list of K <= 64 is one tile, so the online log-sum-exp
rescaling between tiles is exercised only when K is larger or the block is forced small. Here
the functional op runs with small forced blocks (``default_config`` patched, because the op
takes no config) and every output and gradient (emb, centres, weights, sigma) is compared with
tests/reference.py, not with the torch path.
"""
import pytest
import torch

import nnkloss
from nnkloss.ops.backends import kernels
from reference import reference_loss, reference_loss_rows
from cases import make_case  # random case, fp64, weights in [0.25, 1.25)

pytestmark = pytest.mark.interpreter


@pytest.fixture
def force_blocks(monkeypatch):
    nk = kernels().neighbour_kernel
    seen = []

    def force(block_k, block_d):
        def cfg(K, D, max_block_d=nk.MAX_SINGLE_PASS_BLOCK_D, elem_size=4, grad_x=True,
                B=None, sms=None, compute_size=4, aligned=True):
            seen.append((K, D))
            return nk.FwdConfig(block_k, block_d, num_warps=2)
        monkeypatch.setattr(nk, "default_config", cfg)
        return seen
    return force


def far_first_case(B, N, D, K, C=3, seed=0, spread=1.0, pad=0.1):
    """Each row's list sorted from the farthest centre to the nearest, so that the running
    maxima grow from tile to tile and every tile must rescale both sums."""
    emb, labels, centres, centre_labels, nb, w = make_case(B, N, D, K, C, seed=seed,
                                                           spread=spread)
    d = ((emb[:, None, :] - centres[nb]) ** 2).sum(-1)
    nb = nb.gather(1, d.argsort(1, descending=True))
    g = torch.Generator().manual_seed(seed + 1000)
    nb = nb.masked_fill(torch.rand(B, K, generator=g) < pad, -1)
    return emb, labels, centres, centre_labels, nb, w


def grads_of(fn, emb, centres, w, sigma, dtype):
    emb = emb.detach().to(dtype).requires_grad_(True)
    centres = centres.detach().to(dtype).requires_grad_(True)
    w = w.detach().to(dtype).requires_grad_(True)
    s = torch.tensor(sigma, dtype=dtype, requires_grad=True)
    rows = fn(emb, centres, w, s)
    loss = (rows * torch.linspace(0.5, 1.5, len(rows), dtype=rows.dtype)).sum()
    names = ("emb", "centres", "weights", "sigma")
    got = torch.autograd.grad(loss, [emb, centres, w, s])
    assert len(got) == len(names)
    return rows.detach(), dict(zip(names, got, strict=True))


def check_against_reference(case, sigma, dtype):
    emb, labels, centres, cl, nb, w = case

    def op(e, c, ww, s):
        return nnkloss.neighbour_kernel_loss(e, labels, c, cl, nb, ww, s, reduction="none",
                                             backend="triton")

    def ref(e, c, ww, s):
        return reference_loss(e, labels, c, cl, nb, ww, s, reduction="none")

    rows, g = grads_of(op, emb, centres, w, sigma, dtype)
    rows_ref, g_ref = grads_of(ref, emb, centres, w, sigma, torch.float64)
    _, valid = reference_loss_rows(emb, labels, centres, cl, nb, w, sigma)
    assert valid.any()  # some rows carry a loss and a gradient
    tol = (dict(rtol=1e-9, atol=1e-11) if dtype == torch.float64 else dict(rtol=2e-4, atol=2e-5))
    torch.testing.assert_close(rows.double(), rows_ref, **tol)
    assert set(g) == set(g_ref)
    for name in g_ref:
        scale = max(1.0, float(g_ref[name].abs().max()))
        torch.testing.assert_close(g[name].double(), g_ref[name], rtol=tol["rtol"],
                                   atol=tol["atol"] * scale, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("block_k, K", [(4, 37), (8, 100), (16, 65)])
def test_single_pass_several_k_tiles(force_blocks, block_k, K, dtype):
    seen = force_blocks(block_k, 32)  # D = 20 fits one column block: single-pass path
    case = far_first_case(5, 60, 20, K, seed=block_k)
    check_against_reference(case, sigma=1.7, dtype=dtype)
    assert seen and all(k == K for k, _ in seen)  # the forced config was used
    assert K > block_k


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_two_phase_several_k_tiles(force_blocks, dtype):
    force_blocks(8, 8)  # D = 20 > block_d: two-phase path, 5 K tiles
    case = far_first_case(4, 50, 20, 40, seed=3)
    check_against_reference(case, sigma=2.1, dtype=dtype)


def test_far_positives_several_k_tiles(force_blocks):
    """Positives far behind the negatives (separate running maxima) across tiles."""
    force_blocks(4, 32)
    emb, labels, centres, cl, nb, w = far_first_case(4, 40, 6, 23, seed=5, spread=3.0, pad=0.0)
    labels = torch.zeros_like(labels)
    cl = torch.ones_like(cl)
    cl[nb[:, 0]] = 0  # the farthest entry of each list is a positive, most others are not
    check_against_reference((emb, labels, centres, cl, nb, w), sigma=1.0, dtype=torch.float64)


def test_default_config_is_one_tile_for_short_lists():
    """Why these tests force the blocks: the default puts a short list in one tile (16 rows of
    20 fp32 columns, 64 bytes a thread of one warp)."""
    nk = kernels().neighbour_kernel
    assert nk.default_config(16, 20).block_k >= 16
    assert nk.default_config(100, 20).block_k < 100


def test_default_config_splits_columns_over_warps_never_the_list():
    """The rule (kernels/config.py): the fewest warps whose threads hold one gathered row in
    at most 16 elements each (8 for fp64), and the rows that give each thread 64 bytes of the
    bank (the forward-only build; the training build at one warp: below)."""
    nk = kernels().neighbour_kernel

    def cfg(*args, **kw):
        return nk.default_config(*args, grad_x=False, **kw)
    C = nk.FwdConfig
    assert cfg(100, 128) == C(4, 128, 1, 2, 1)                       # 16 fp32 a thread, 4 rows
    assert cfg(100, 512) == C(1, 512, 1, 2, 1)
    assert cfg(100, 128, elem_size=2) == C(8, 128, 1, 2, 1)
    assert cfg(100, 512, elem_size=2) == C(2, 512, 1, 2, 1)
    assert cfg(256, 300, elem_size=2) == C(2, 512, 1, 2, 1)          # D pads to 512
    assert cfg(100, 1000) == C(1, 1024, 2, 2, 1)                      # 1024 columns: 2 warps
    assert cfg(100, 2048, elem_size=2) == C(2, 2048, 4, 2, 1)         # 16 columns a thread
    assert cfg(100, 4096) == C(1, 4096, 8, 2, 1)
    assert cfg(100, 5000) == C(1, 4096, 8, 2, 1)                      # two-phase: 4096 chunks
    assert cfg(100, 64, elem_size=8) == C(4, 64, 1, 2, 1)             # fp64: 8 a thread
    assert cfg(100, 512, elem_size=8) == C(1, 512, 2, 2, 1)
    assert cfg(3, 8) == C(4, 8, 1, 2, 4)                              # tiny lists: 4 rows
    for K, D, e in [(100, 128, 4), (100, 512, 2), (7, 3000, 4), (100, 64, 8)]:
        for grad_x in (False, True):
            c = nk.default_config(K, D, elem_size=e, grad_x=grad_x)
            # warps split one row's columns (at least 8 a thread: no warp spans list rows),
            # each thread holds at most 16 of one row and 64 bytes of the tile
            assert c.block_d >= 8 * 32 * c.num_warps or c.num_warps == 1
            assert c.block_d <= 16 * 32 * c.num_warps
            assert c.block_k * c.block_d * min(e, 4) <= 64 * 32 * c.num_warps


def test_default_config_gives_one_warp_training_tiles_two_rows():
    """The training build (grad_x, the default) of an fp32 or 2-byte bank at one warp: two
    rows a tile (docs/PERFORMANCE.md, "The launch rule and its evidence"), at least
    8 elements a thread; more warps, an fp64 bank, or a list that one tile holds: the 64-byte
    rule."""
    nk = kernels().neighbour_kernel
    cfg, C = nk.default_config, nk.FwdConfig
    assert cfg(100, 128) == C(2, 128, 1, 2, 1)
    assert cfg(100, 512) == C(2, 512, 1, 2, 1)
    assert cfg(100, 128, elem_size=2) == C(2, 128, 1, 2, 1)
    assert cfg(100, 256, elem_size=2) == C(2, 256, 1, 2, 1)
    assert cfg(100, 512, elem_size=2) == C(2, 512, 1, 2, 1)
    assert cfg(1000, 64) == C(4, 64, 1, 2, 1)                         # 8 elements a thread
    for K, D, e in [(100, 2048, 2), (100, 1000, 4), (100, 64, 8), (100, 512, 8),
                    (1, 512, 4), (3, 8, 4), (16, 20, 4)]:  # ... and lists in one tile
        assert cfg(K, D, elem_size=e) == cfg(K, D, elem_size=e, grad_x=False), (K, D, e)


def test_default_config_lengthens_tiles_for_batches_too_small_to_fill_the_gpu():
    """Given the batch and the GPU's SMs, a batch under 8 warps per SM lengthens its tiles:
    under 2 warps per SM to 64 elements a thread (32 for fp64) with up to 4 warps a row while
    the list has rows for them; from 2 to 8 to 32 elements a thread at the rule's warps;
    without B and the SMs, the rule."""
    nk = kernels().neighbour_kernel
    cfg, C = nk.default_config, nk.FwdConfig
    assert cfg(1000, 64, B=128, sms=132) == C(128, 64, 4, 2, 1)     # the sweep's best
    assert cfg(1000, 64, B=128, sms=132, grad_x=False) == C(128, 64, 4, 2, 1)
    assert cfg(1000, 64, B=200, sms=132) == C(64, 64, 2, 2, 1)      # 400 warps: 3 a SM
    assert cfg(100, 128, B=128, sms=132) == C(64, 128, 4, 2, 1)
    assert cfg(100, 128, B=600, sms=132) == C(8, 128, 1, 2, 1)      # 32 a thread
    assert cfg(100, 128, B=1024, sms=132) == C(8, 128, 1, 2, 1)     # 1024 warps < 8 x 132
    assert cfg(100, 128, B=1056, sms=132) == cfg(100, 128) == C(2, 128, 1, 2, 1)  # enough
    assert cfg(1000, 64, B=128) == cfg(1000, 64) == C(4, 64, 1, 2, 1)
    assert cfg(100, 512, elem_size=2, B=128, sms=132) == C(16, 512, 4, 2, 1)
    assert cfg(100, 64, elem_size=8, B=8, sms=132) == C(64, 64, 4, 2, 1)  # fp64: 32 a thread
    assert cfg(3, 8, B=2, sms=132) == C(4, 8, 1, 2, 4)              # one tile holds the list
    assert cfg(8, 128, B=8, sms=132) == C(8, 128, 1, 2, 1)          # no rows for more warps
    assert cfg(100, 4096, B=8, sms=132) == C(4, 4096, 8, 2, 1)      # 8 warps: 64 a thread
    assert cfg(100, 4096, B=8, sms=132).num_warps == cfg(100, 4096).num_warps


def test_default_config_two_phase_training_tiles_spread_rows_over_16_warps():
    """Issue 58: the two-phase training tile of a 2-byte bank, 2 x 4096 at 8 warps (32
    elements a thread), spilled on sm_80 and sm_90, as did an fp32 bank's 1 x 4096 at 8 warps
    on sm_90; at 16 warps (8 columns, 16 elements a thread) neither does. Forward-only tiles
    keep the rule; no two-phase tile lengthens for a small batch (4 x 4096 at 8 warps spilled)."""
    nk = kernels().neighbour_kernel
    cfg, C = nk.default_config, nk.FwdConfig
    assert cfg(100, 5000) == cfg(100, 5000, elem_size=2) == C(2, 4096, 16, 2, 1)
    assert cfg(100, 5000, elem_size=8) == C(1, 4096, 16, 2, 1)
    assert cfg(100, 5000, grad_x=False) == C(1, 4096, 8, 2, 1)
    assert cfg(1, 5000) == C(1, 4096, 16, 2, 1)
    assert cfg(100, 5000, elem_size=2, grad_x=False) == C(1, 4096, 8, 2, 1)  # 16 a thread
    for e in (2, 4, 8):
        for grad_x in (True, False):
            assert cfg(100, 5000, elem_size=e, grad_x=grad_x, B=4, sms=132) == \
                cfg(100, 5000, elem_size=e, grad_x=grad_x)


def test_default_config_sizes_rows_under_4_byte_alignment_as_4_byte_elements():
    """A 2-byte bank at odd D is read one element a load: its 2 x 1024 tile at 2 warps (32
    elements a thread) took 134-137 registers on sm_100 (12 warps per SM); at 16, as a
    4-byte bank's, the floor holds."""
    nk = kernels().neighbour_kernel
    cfg = nk.default_config
    assert cfg(32, 513, elem_size=2, aligned=False) == cfg(32, 513, elem_size=4)
    assert cfg(32, 513, elem_size=2, aligned=False).block_k == 1
    assert cfg(32, 512, elem_size=2).block_k == 2
    assert cfg(32, 513, elem_size=4, aligned=False) == cfg(32, 513, elem_size=4)


def test_the_launcher_passes_the_batch_and_the_sm_count(monkeypatch):
    """neighbour_kernel_fwd asks default_config with B, the device's SMs (None off CUDA: the
    interpreter has no SMs) and the compute dtype's bytes (8 for fp64 embeddings)."""
    nk = kernels().neighbour_kernel
    seen = []
    real = nk.default_config

    def spy(*args):
        seen.append(args)
        return real(*args)
    monkeypatch.setattr(nk, "default_config", spy)
    emb, labels, centres, cl, nb, w = far_first_case(5, 30, 6, 7, seed=2, spread=1.0, pad=0.0)
    centres = centres.float()
    nk.neighbour_kernel_fwd(emb.float(), labels, centres, cl, nb, w, torch.tensor(1.0))
    # B, SMs, the compute dtype's bytes (fp32), rows aligned to 4 bytes (D 6 of fp32)
    assert seen and seen[-1][5:] == (5, None, 4, True)
    nk.neighbour_kernel_fwd(emb.double(), labels, centres, cl, nb, w, torch.tensor(1.0))
    assert seen[-1][3] == 4 and seen[-1][7] == 8  # an fp32 bank computed in fp64
    assert nk.sm_count(torch.device("cpu")) is None
