"""Tests of gossip.models: registry, shapes, parameter counts, determinism, a short training run."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gossip import data, models
from gossip.models import build_model, count_parameters

MNIST1D = dict(input_shape=(1, 40), num_classes=10)
CIFAR = dict(input_shape=(3, 32, 32), num_classes=10)


def test_available_models_with_default_first():
    assert tuple(models.available_models()) == ("cnn1d", "mlp", "logreg", "resnet20", "gpt", "lstm")


def test_unknown_model_lists_known_ones():
    with pytest.raises(ValueError, match=r"unknown model 'vgg'; known: cnn1d, mlp, logreg, resnet20"):
        build_model("vgg", **MNIST1D)


@pytest.mark.parametrize(
    "name, kwargs, msg",
    [
        ("cnn1d", dict(input_shape=(3, 32, 32), num_classes=10),
         r"model 'cnn1d' expects input_shape \(channels, length\), got \(3, 32, 32\)"),
        ("resnet20", dict(input_shape=(1, 40), num_classes=10),
         r"model 'resnet20' expects input_shape \(channels, height, width\), got \(1, 40\)"),
        ("mlp", dict(input_shape=(0, 4), num_classes=10), r"input_shape must be non-empty with positive sizes"),
        ("logreg", dict(input_shape=(4,), num_classes=1), r"num_classes must be an integer >= 2, got 1"),
        ("resnet20", dict(**CIFAR, norm="layer"), r"norm must be 'batch' or 'group', got 'layer'"),
        ("resnet20", dict(**CIFAR, groups=3), r"groups must be a positive integer dividing 16, got 3"),
        ("cnn1d", dict(**MNIST1D, channels=0), r"channels must be a positive integer, got 0"),
        ("mlp", dict(**MNIST1D, hidden=(64, -1)), r"hidden must be a sequence of positive integers"),
        ("logreg", dict(**MNIST1D, hidden=3), r"model 'logreg' does not take option\(s\) hidden; accepted: none"),
        ("cnn1d", dict(**MNIST1D, seed=-1), r"seed must be an integer in \[0, 2\*\*63\), got -1"),
    ],
)
def test_bad_arguments_are_named(name, kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        build_model(name, **kwargs)


@pytest.mark.parametrize(
    "name, kwargs, batch_shape, params",
    [
        # conv 1*64*5+64, 2 x (64*64*5+64), linear 64*10*128+128, 128*10+10
        ("cnn1d", MNIST1D, (5, 1, 40), 384 + 2 * 20544 + 82048 + 1290),
        ("mlp", MNIST1D, (5, 1, 40), (40 * 256 + 256) + (256 * 256 + 256) + (256 * 10 + 10)),
        ("logreg", MNIST1D, (5, 1, 40), 40 * 10 + 10),
        ("logreg", dict(input_shape=(32,), num_classes=2), (5, 32), 32 * 2 + 2),
        ("mlp", dict(input_shape=(32,), num_classes=2, hidden=(8,)), (5, 32), 32 * 8 + 8 + 8 * 2 + 2),
        ("resnet20", CIFAR, (2, 3, 32, 32), 269_722),
        ("resnet20", dict(**CIFAR, norm="group"), (2, 3, 32, 32), 269_722),
    ],
)
def test_forward_shape_and_parameter_count(name, kwargs, batch_shape, params):
    model = build_model(name, seed=0, **kwargs)
    out = model(torch.randn(batch_shape))
    assert out.shape == (batch_shape[0], kwargs["num_classes"])
    assert count_parameters(model) == params


def test_cnn1d_accepts_other_lengths_and_channels():
    model = build_model("cnn1d", input_shape=(2, 37), num_classes=4, seed=0)
    assert model(torch.randn(3, 2, 37)).shape == (3, 4)


def test_resnet20_batchnorm_statistics_are_buffers_not_parameters():
    bn = build_model("resnet20", seed=0, **CIFAR)
    buffers = {name for name, _ in bn.named_buffers()}
    assert "stem_norm.running_mean" in buffers and "blocks.0.norm1.running_var" in buffers
    assert not any("running" in name for name, _ in bn.named_parameters())
    gn = build_model("resnet20", norm="group", seed=0, **CIFAR)
    assert list(gn.named_buffers()) == []
    assert sum(isinstance(m, nn.GroupNorm) for m in gn.modules()) == 19


@pytest.mark.parametrize("name, kwargs", [("cnn1d", MNIST1D), ("mlp", MNIST1D), ("logreg", MNIST1D),
                                          ("resnet20", CIFAR)])
def test_construction_is_deterministic(name, kwargs):
    def state(model):
        return model.state_dict()

    torch.manual_seed(7)
    a = state(build_model(name, **kwargs))
    torch.manual_seed(7)
    b = state(build_model(name, **kwargs))
    rng_before = torch.get_rng_state()
    c = state(build_model(name, seed=7, **kwargs))
    assert torch.equal(torch.get_rng_state(), rng_before)  # seed= leaves the global generator alone
    d = state(build_model(name, seed=8, **kwargs))
    for key in a:
        assert torch.equal(a[key], b[key]) and torch.equal(a[key], c[key]), key
    assert any(not torch.equal(a[k], d[k]) for k in a if a[k].is_floating_point())


@pytest.fixture
def one_thread():
    """Training tests run single-threaded: on a shared 2-core machine, threads only contend."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_logreg_fits_the_synthetic_problem(one_thread):
    ds = data.build_dataset("synthetic", seed=0)
    model = build_model("logreg", input_shape=ds.input_shape, num_classes=ds.num_classes, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    loader = data.ShardLoader(ds.x_train, ds.y_train, torch.arange(ds.num_train), 128, seed=0, node=0)
    for _ in range(5 * loader.steps_per_epoch):
        x, y = loader.next_batch()
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    with torch.no_grad():
        acc = (model(ds.x_test).argmax(1) == ds.y_test).float().mean().item()
    # Ten classes with noisy labels: chance is 0.1, the true model scores about 0.52.
    assert acc > 0.4


@pytest.mark.slow
def test_cnn1d_learns_mnist1d(mnist1d_cache, one_thread):
    """Ten epochs of plain SGD (momentum 0.9, lr 0.05, batch 64), centrally: about 0.9."""
    _, ds, _ = mnist1d_cache
    model = build_model("cnn1d", input_shape=ds.input_shape, num_classes=10, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = data.ShardLoader(ds.x_train, ds.y_train, torch.arange(ds.num_train), 64, seed=0, node=0)
    for _ in range(10):
        for x, y in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    with torch.no_grad():
        acc = (model(ds.x_test).argmax(1) == ds.y_test).float().mean().item()
    print(f"cnn1d MNIST-1D test accuracy after 10 epochs: {acc:.3f}")
    assert acc >= 0.85
