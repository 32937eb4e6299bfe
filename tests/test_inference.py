"""nnkloss/inference.py: the eval-mode copy with BatchNorms folded computes what the model
computes in eval mode, folds only what it may, and never touches the model."""
import copy

import pytest
import torch
from torch import nn

from nnkloss.inference import foldable_pairs, inference_model


def _with_statistics(model: nn.Module, seed: int = 0) -> nn.Module:
    """Random affine parameters and running statistics in every BatchNorm (fresh ones are the
    identity map, which a wrong fold could pass)."""
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            c = m.num_features
            if m.affine:
                m.weight.data = torch.rand(c, generator=g, dtype=m.weight.dtype) + 0.5
                m.bias.data = torch.randn(c, generator=g, dtype=m.bias.dtype)
            if m.track_running_stats:
                m.running_mean.copy_(torch.randn(c, generator=g))
                m.running_var.copy_(torch.rand(c, generator=g) * 3 + 0.1)
    return model


def _net(width=4, dim=5, bias=False):
    """Conv-BN-ReLU-pool blocks and a Linear-BN head, as the papers' small networks."""
    return nn.Sequential(
        nn.Conv2d(1, width, 3, padding=1, bias=bias), nn.BatchNorm2d(width), nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Sequential(nn.Conv2d(width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width),
                      nn.ReLU()),
        nn.Flatten(), nn.Linear(2 * width * 9, dim), nn.BatchNorm1d(dim))


def _count_bn(model):
    return sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
@pytest.mark.parametrize("bias", [False, True])
def test_the_folded_copy_computes_the_models_eval_outputs(dtype, tol, bias):
    torch.manual_seed(0)
    model = _with_statistics(_net(bias=bias)).to(dtype)
    x = torch.randn(7, 1, 6, 6, dtype=dtype)
    model.eval()
    want = model(x)
    net = inference_model(model)
    assert net is not model and not net.training
    assert _count_bn(net) == 0 and _count_bn(model) == 3  # all three folded, none lost
    got = net(x)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_batch_norm_without_affine_parameters():
    """A conv's BatchNorm without affine parameters folds (scale 1, shift 0); a linear
    layer's does not (torch's linear fold needs them) and runs as it is."""
    torch.manual_seed(4)
    model = _with_statistics(nn.Sequential(
        nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3, affine=False), nn.Flatten(),
        nn.Linear(3 * 4 * 4, 5, bias=False), nn.BatchNorm1d(5, affine=False))).eval()
    assert foldable_pairs(model) == [("", 0)]
    x = torch.randn(4, 2, 6, 6)
    net = inference_model(model)
    assert isinstance(net[1], nn.Identity) and isinstance(net[4], nn.BatchNorm1d)
    torch.testing.assert_close(net(x), model(x), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("channels", [4, 3])
def test_a_linear_batch_norm_over_channels_of_3d_inputs_is_not_folded_into_the_linear(channels):
    """On (B, C, L) inputs a Linear maps L and its BatchNorm1d normalises the C channels: with
    C equal to the Linear's outputs the fold ran and gave other embeddings (off by 0.4 of 1.3),
    with C different torch's fold raised an AssertionError (every refresh failed). 2-D inputs
    of the same pair still fold."""
    torch.manual_seed(5)
    model = _with_statistics(nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(channels),
                                           nn.Flatten())).eval()
    net = inference_model(model)
    x = torch.randn(10, channels, 6)
    torch.testing.assert_close(net(x), model(x), rtol=2e-5, atol=2e-5)
    if channels == 4:  # the same pair on (B, 6) inputs: folded
        assert foldable_pairs(model) == [("", 0)] and _count_bn(net) == 0
        x2 = torch.randn(10, 6)
        torch.testing.assert_close(net(x2), model(x2), rtol=2e-5, atol=2e-5)
        with pytest.raises(ValueError, match="expected 2D or 3D input"):
            net(torch.randn(2, 3, 4, 6))
    else:
        assert foldable_pairs(model) == []


def test_the_model_is_left_as_it_was():
    torch.manual_seed(1)
    model = _with_statistics(_net())
    model.train()
    before = copy.deepcopy(model.state_dict())
    net = inference_model(model)
    assert model.training and all(m.training for m in model.modules())
    assert all(p.requires_grad for p in model.parameters())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert not any(p.requires_grad for p in net.parameters())
    # The copy shares no storage with the model: training the model does not move it.
    x = torch.randn(3, 1, 6, 6)
    out = net(x)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    torch.testing.assert_close(net(x), out)


def test_channels_last_weights_stay_channels_last():
    torch.manual_seed(2)
    model = _with_statistics(_net()).to(memory_format=torch.channels_last).eval()
    net = inference_model(model)
    conv = net[0]
    assert isinstance(conv, nn.Conv2d)
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    x = torch.randn(4, 1, 6, 6).contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(net(x), model(x), rtol=2e-5, atol=2e-5)


class _MyConv(nn.Conv2d):
    def forward(self, x):
        return super().forward(x) * 2


class _Reordered(nn.Sequential):
    def forward(self, x):  # the BatchNorm does not take the conv's output here
        return self[0](self[1](x))


class _Attributes(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(2, 2, 1), nn.BatchNorm2d(2)

    def forward(self, x):
        return self.conv(x) + self.bn(x)


def _stats_switched_off():
    """Buffers present, but eval mode then normalises with the batch's own statistics."""
    bn = nn.BatchNorm2d(2)
    seq = nn.Sequential(nn.Conv2d(2, 2, 1), bn)
    _with_statistics(seq)
    bn.track_running_stats = False
    return seq


def _hooked_bn():
    bn = nn.BatchNorm2d(2)
    bn.register_forward_hook(lambda m, i, o: o * 3)
    return nn.Sequential(nn.Conv2d(2, 2, 1), bn)


@pytest.mark.parametrize("make", [
    lambda: nn.Sequential(nn.Conv2d(2, 2, 1), nn.BatchNorm2d(2, track_running_stats=False)),
    lambda: nn.Sequential(_MyConv(2, 2, 1), nn.BatchNorm2d(2)),
    lambda: _Reordered(nn.Conv2d(2, 2, 1), nn.BatchNorm2d(2)),
    lambda: nn.Sequential(nn.BatchNorm2d(2), nn.Conv2d(2, 2, 1)),
    lambda: nn.Sequential(nn.Conv2d(2, 2, 1), nn.ReLU(), nn.BatchNorm2d(2)),
    lambda: nn.Sequential(nn.Conv1d(2, 2, 1), nn.BatchNorm2d(2)),
    _Attributes,
    _stats_switched_off,
    _hooked_bn,
    lambda: nn.DataParallel(nn.Sequential(nn.Conv2d(2, 2, 1), nn.BatchNorm2d(2))),
], ids=["batch_statistics", "conv_subclass", "sequential_subclass", "bn_first",
        "not_adjacent", "mismatched_dims", "attributes", "stats_switched_off", "hooked", "data_parallel"])
def test_what_may_not_be_folded_runs_as_it_is(make):
    torch.manual_seed(3)
    model = _with_statistics(make()).eval()
    assert foldable_pairs(model) == []
    assert inference_model(model) is model


class _OtherParameter(nn.Parameter):
    """Stands for FSDP's flat / sharded parameters: not a plain nn.Parameter."""


def test_a_model_with_parameters_of_another_class_runs_as_it_is():
    model = _with_statistics(nn.Sequential(nn.Conv2d(2, 2, 1), nn.BatchNorm2d(2))).eval()
    assert foldable_pairs(model) == [("", 0)]
    model[0].weight = _OtherParameter(model[0].weight.detach().clone())
    assert foldable_pairs(model) == []
    assert inference_model(model) is model


def test_a_model_that_cannot_be_copied_runs_as_it_is():
    import threading

    model = _with_statistics(nn.Sequential(nn.Conv2d(2, 2, 1), nn.BatchNorm2d(2))).eval()
    model.lock = threading.Lock()  # deepcopy cannot copy it
    assert foldable_pairs(model) == [("", 0)]
    assert inference_model(model) is model


def test_a_compiled_module_runs_as_it_is():
    model = torch.compile(nn.Sequential(nn.Conv2d(2, 2, 1), nn.BatchNorm2d(2)))
    assert inference_model(model) is model


def test_foldable_pairs_names_each_pair():
    model = _net()
    assert foldable_pairs(model) == [("", 0), ("", 6), ("4", 0)]


def test_a_non_module_is_refused_by_name():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        inference_model(lambda x: x)
