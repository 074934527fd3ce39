"""Tests of gossip.data: the data-set registry, mnist1d cache, CIFAR-10 reader, partition, loaders."""

from __future__ import annotations

import os
import pickle
import re
import warnings

import numpy as np
import pytest
import torch

from gossip import data
from gossip.data import DataError, RandomCropFlip, ShardLoader, build_dataset, datasets, partition

# --------------------------------------------------------------------------- registry


def test_available_datasets_with_default_first():
    assert tuple(data.available_datasets()) == ("mnist1d", "cifar10", "synthetic", "text", "wikitext2")


def test_unknown_dataset_lists_known_ones():
    with pytest.raises(ValueError, match=r"unknown dataset 'imagenet'; known: mnist1d, cifar10, synthetic, text, wikitext2"):
        build_dataset("imagenet")


def test_unknown_option_is_named():
    with pytest.raises(ValueError, match=r"dataset 'mnist1d' does not take option\(s\) depth; accepted: none"):
        build_dataset("mnist1d", depth=3)
    with pytest.raises(ValueError, match=r"does not take option\(s\) bits; accepted: num_features"):
        build_dataset("synthetic", bits=3)


@pytest.mark.parametrize("seed, exc, msg", [(-1, ValueError, "seed must be >= 0, got -1"),
                                            (1.5, TypeError, "seed must be an integer, got float"),
                                            (True, TypeError, "seed must be an integer, got bool")])
def test_bad_seed_is_rejected(seed, exc, msg):
    with pytest.raises(exc, match=msg):
        build_dataset("synthetic", seed=seed)


def test_default_cache_dir_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("GOSSIP_CACHE", str(tmp_path / "c"))
    assert data.default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("GOSSIP_CACHE")
    assert data.default_cache_dir().parts[-2:] == (".cache", "gossip")


def test_dataset_validates_its_fields():
    x, y = torch.zeros(4, 3), torch.zeros(4, dtype=torch.int64)
    ok = dict(name="t", x_train=x, y_train=y, x_test=x, y_test=y, num_classes=2, input_shape=(3,))
    data.Dataset(**ok)
    with pytest.raises(ValueError, match="x_train must be a float32 tensor"):
        data.Dataset(**{**ok, "x_train": x.double()})
    shape_rule = r"x_train must be shaped \(len\(y_train\), \*input_shape\) = \(4, 5\), got \(4, 3\)"
    with pytest.raises(ValueError, match=shape_rule):
        data.Dataset(**{**ok, "input_shape": (5,)})
    with pytest.raises(ValueError, match=r"y_train must lie in \[0, 2\), got values in \[0, 7\]"):
        data.Dataset(**{**ok, "y_train": torch.tensor([0, 1, 7, 0])})


# --------------------------------------------------------------------------- mnist1d
# The data set itself is generated once per session by the mnist1d_cache fixture
# (tests/conftest.py), which test_models.py shares.

_SPLITS = ("x_train", "y_train", "x_test", "y_test")


def test_mnist1d_shapes_and_types(mnist1d_cache):
    _, ds, _ = mnist1d_cache
    assert ds.name == "mnist1d" and ds.num_classes == 10 and ds.input_shape == (1, 40)
    assert ds.x_train.shape == (4000, 1, 40) and ds.x_test.shape == (1000, 1, 40)
    assert ds.x_train.dtype == torch.float32 and ds.y_train.dtype == torch.int64
    assert set(ds.y_train.tolist()) == set(range(10)) and set(ds.y_test.tolist()) == set(range(10))
    assert torch.isfinite(ds.x_train).all()
    assert ds.augment is None


def test_mnist1d_generation_leaves_global_rngs_alone(mnist1d_cache):
    # make_dataset calls np.random.seed(42) and random.seed(42) itself.
    assert mnist1d_cache[2]


def test_mnist1d_cache_is_written_atomically_and_reused(mnist1d_cache, monkeypatch):
    cache, ds, _ = mnist1d_cache
    names = os.listdir(cache)
    assert len(names) == 1 and names[0].startswith("mnist1d-") and names[0].endswith(".npz")

    def no_generation():
        raise AssertionError("the cache should have been used")

    monkeypatch.setattr(datasets, "_generate_mnist1d", no_generation)
    again = build_dataset("mnist1d", cache_dir=cache)
    for split in _SPLITS:
        assert torch.equal(getattr(again, split), getattr(ds, split))


def _fresh_cache_from(src_cache, tmp_path):
    (name,) = os.listdir(src_cache)
    dst = tmp_path / "cache"
    dst.mkdir()
    (dst / name).write_bytes((src_cache / name).read_bytes())
    return dst / name


def test_damaged_cache_is_regenerated_identically(mnist1d_cache, tmp_path):
    """The real generator runs a second time here: this also checks it is deterministic."""
    cache, ds, _ = mnist1d_cache
    path = _fresh_cache_from(cache, tmp_path)
    blob = path.read_bytes()
    path.write_bytes(blob[: len(blob) // 2])  # truncated by a crash or a full disk
    np_before = np.random.get_state()
    with pytest.warns(UserWarning, match=r"mnist1d cache '.*' is damaged .*; regenerating it"):
        again = build_dataset("mnist1d", cache_dir=path.parent)
    assert np.array_equal(np.random.get_state()[1], np_before[1])
    for split in _SPLITS:
        assert torch.equal(getattr(again, split), getattr(ds, split)), split
    # The regenerated file is whole again and no temporary file is left behind.
    assert os.listdir(path.parent) == [path.name]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_dataset("mnist1d", cache_dir=path.parent)


def _arrays_of(ds):
    return {"x_train": ds.x_train.squeeze(1).numpy(), "y_train": ds.y_train.numpy(),
            "x_test": ds.x_test.squeeze(1).numpy(), "y_test": ds.y_test.numpy()}


@pytest.mark.parametrize("damage", ["garbage", "wrong_arrays", "bad_labels", "flipped_byte"])
def test_other_cache_damage_is_detected(mnist1d_cache, tmp_path, monkeypatch, damage):
    cache, ds, _ = mnist1d_cache
    path = _fresh_cache_from(cache, tmp_path)
    if damage == "garbage":
        path.write_bytes(b"not a zip file at all")
    elif damage == "wrong_arrays":
        with open(path, "wb") as f:
            np.savez(f, x_train=np.zeros(3))
    elif damage == "bad_labels":
        arrays = _arrays_of(ds)
        arrays["y_test"] = arrays["y_test"] + 10
        with open(path, "wb") as f:
            np.savez(f, **arrays)
    else:  # one byte flipped inside the stored arrays: the zip CRC catches it
        blob = bytearray(path.read_bytes())
        blob[len(blob) // 2] ^= 0xFF
        path.write_bytes(bytes(blob))
    calls = []
    monkeypatch.setattr(datasets, "_generate_mnist1d", lambda: calls.append(1) or _arrays_of(ds))
    with pytest.warns(UserWarning, match="is damaged"):
        again = build_dataset("mnist1d", cache_dir=path.parent)
    assert calls == [1]
    assert torch.equal(again.x_test, ds.x_test)


def test_unwritable_cache_warns_and_still_returns_data(mnist1d_cache, tmp_path, monkeypatch):
    _, ds, _ = mnist1d_cache
    monkeypatch.setattr(datasets, "_generate_mnist1d", lambda: _arrays_of(ds))
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.warns(UserWarning, match="could not write the mnist1d cache"):
        again = build_dataset("mnist1d", cache_dir=blocker / "sub")
    assert torch.equal(again.y_train, ds.y_train)


def test_mnist1d_warns_about_pointless_data_dir(mnist1d_cache, tmp_path):
    cache, _, _ = mnist1d_cache
    with pytest.warns(UserWarning, match="data_dir is ignored by dataset 'mnist1d'"):
        build_dataset("mnist1d", cache_dir=cache, data_dir=tmp_path)


# --------------------------------------------------------------------------- cifar10


def _batch(n, seed, label_offset=0):
    rng = np.random.default_rng(seed)
    return {
        b"batch_label": b"training batch",
        b"labels": [int(v) for v in (np.arange(n) + label_offset) % 10],
        b"data": rng.integers(0, 256, size=(n, 3072), dtype=np.uint8),
        b"filenames": [f"img_{seed}_{i}.png".encode() for i in range(n)],
    }


def _dump(path, obj, protocol=2):
    with open(path, "wb") as f:
        pickle.dump(obj, f, protocol=protocol)


@pytest.fixture
def cifar_dir(tmp_path):
    """Tiny CIFAR-10 python batches in the official layout: 5 x 4 train images, 6 test images."""
    root = tmp_path / "cifar"
    root.mkdir()
    for i in range(1, 6):
        _dump(root / f"data_batch_{i}", _batch(4, i, label_offset=i))
    test = _batch(6, 0)
    test[b"batch_label"] = b"testing batch"
    test[b"data"][0] = 0
    test[b"data"][0, 1 * 1024 + 2 * 32 + 3] = 255  # green channel, row 2, column 3
    _dump(root / "test_batch", test, protocol=4)
    names = [n.encode() for n in ("airplane", "automobile", "bird", "cat", "deer",
                                  "dog", "frog", "horse", "ship", "truck")]
    _dump(root / "batches.meta", {b"label_names": names, b"num_cases_per_batch": 4, b"num_vis": 3072})
    return root


def test_cifar10_reads_the_python_batches(cifar_dir):
    ds = build_dataset("cifar10", data_dir=cifar_dir)
    assert ds.x_train.shape == (20, 3, 32, 32) and ds.x_test.shape == (6, 3, 32, 32)
    assert ds.y_train.tolist() == [int(v) % 10 for i in range(1, 6) for v in np.arange(4) + i]
    assert ds.class_names[0] == "airplane" and ds.class_names[9] == "truck"
    mean, std = torch.tensor(data.CIFAR10_MEAN), torch.tensor(data.CIFAR10_STD)
    # Channel-major layout and per-channel normalisation.
    expected = (torch.zeros(3, 32, 32) - mean.view(3, 1, 1)) / std.view(3, 1, 1)
    expected[1, 2, 3] = (1.0 - mean[1]) / std[1]
    torch.testing.assert_close(ds.x_test[0], expected)
    raw = _batch(4, 1, 1)[b"data"][0].reshape(3, 32, 32) / 255.0
    torch.testing.assert_close(ds.x_train[0], (torch.tensor(raw, dtype=torch.float32) - mean.view(3, 1, 1))
                               / std.view(3, 1, 1))
    assert isinstance(ds.augment, RandomCropFlip) and ds.augment.padding == 4


def test_cifar10_accepts_the_archive_folder_and_no_meta(cifar_dir):
    (cifar_dir / "batches.meta").unlink()
    nested = cifar_dir.parent / "outer"
    nested.mkdir()
    cifar_dir.rename(nested / "cifar-10-batches-py")
    ds = build_dataset("cifar10", data_dir=nested)
    assert ds.num_train == 20 and ds.class_names is None


def test_cifar10_needs_a_data_dir():
    with pytest.raises(DataError, match=r"dataset 'cifar10' needs data_dir \(--data-dir\): a directory holding"):
        build_dataset("cifar10")


def test_cifar10_missing_directory(tmp_path):
    with pytest.raises(DataError, match=r"cifar10 data_dir '.*nowhere' does not exist; expected a directory"):
        build_dataset("cifar10", data_dir=tmp_path / "nowhere")


def test_cifar10_data_dir_is_a_file(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(DataError, match=r"data_dir '.*f' is not a directory"):
        build_dataset("cifar10", data_dir=tmp_path / "f")


def test_cifar10_missing_files_are_named(cifar_dir):
    (cifar_dir / "test_batch").unlink()
    (cifar_dir / "data_batch_3").unlink()
    with pytest.raises(DataError, match=r"data_dir '.*cifar' lacks data_batch_3, test_batch; expected"):
        build_dataset("cifar10", data_dir=cifar_dir)


def _bad_batches():
    good = _batch(4, 9)
    return {
        "not_pickle": (b"\x00\x01garbage", "cannot unpickle it"),
        "a_list": ([1, 2, 3], "it holds a list, not a dict"),
        "no_labels": ({b"data": good[b"data"]}, r"no b'labels' entry"),
        "float_data": ({**good, b"data": good[b"data"].astype(np.float32)}, r"b'data' is float32 \(4, 3072\)"),
        "short_rows": ({**good, b"data": good[b"data"][:, :100]}, r"b'data' is uint8 \(4, 100\)"),
        "label_count": ({**good, b"labels": [1, 2]}, r"b'labels' is int64 \(2,\), b'data' has 4 rows"),
        "label_range": ({**good, b"labels": [0, 1, 2, 11]}, r"values outside 0..9"),
        "code": (None, r"refusing to load posix.system|refusing to load os.system|refusing to load nt.system"),
    }


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("echo should-not-run",))


@pytest.mark.parametrize("case", list(_bad_batches()))
def test_cifar10_malformed_batch_is_a_data_error(cifar_dir, case):
    obj, msg = _bad_batches()[case]
    target = cifar_dir / "data_batch_2"
    if case == "not_pickle":
        target.write_bytes(obj)
    elif case == "code":
        _dump(target, {b"data": _RunsCode(), b"labels": []})
    else:
        _dump(target, obj)
    with pytest.raises(DataError, match=r"cifar10 file '.*data_batch_2' is not a CIFAR-10 python batch \(") as info:
        build_dataset("cifar10", data_dir=cifar_dir)
    assert "\n" not in str(info.value)
    assert "expected a pickled dict with b'data' uint8 (N, 3072)" in str(info.value)
    assert re.search(msg, str(info.value)), str(info.value)


def test_cifar10_malformed_meta_is_a_data_error(cifar_dir):
    _dump(cifar_dir / "batches.meta", {b"other": 1})
    with pytest.raises(DataError, match=r"'.*batches.meta' is not a CIFAR-10 batches.meta .*label_names"):
        build_dataset("cifar10", data_dir=cifar_dir)


# --------------------------------------------------------------------------- augmentation


def test_random_crop_flip_is_a_padded_crop_then_maybe_a_flip():
    x = torch.randn(16, 3, 8, 8)
    aug = RandomCropFlip(padding=2, fill=(-1.0, -2.0, -3.0))
    out = aug(x, torch.Generator().manual_seed(0))
    assert out.shape == x.shape
    padded = torch.stack([torch.full((12, 12), v) for v in (-1.0, -2.0, -3.0)]).expand(16, 3, 12, 12).clone()
    padded[:, :, 2:10, 2:10] = x
    flips = 0
    for b in range(16):
        candidates = [padded[b, :, i:i + 8, j:j + 8] for i in range(5) for j in range(5)]
        plain = any(torch.equal(out[b], c) for c in candidates)
        flipped = any(torch.equal(out[b], c.flip(-1)) for c in candidates)
        assert plain or flipped, b
        flips += flipped and not plain
    assert 0 < flips < 16
    again = aug(x, torch.Generator().manual_seed(0))
    assert torch.equal(out, again)


def test_random_crop_flip_edge_cases():
    x = torch.randn(4, 3, 5, 5)
    assert torch.equal(RandomCropFlip(0, flip_p=0.0)(x, torch.Generator()), x)
    assert torch.equal(RandomCropFlip(0, flip_p=1.0)(x, torch.Generator()), x.flip(-1))
    with pytest.raises(ValueError, match=r"flip_p must lie in \[0, 1\], got 2"):
        RandomCropFlip(flip_p=2)
    with pytest.raises(ValueError, match=r"expects a batch shaped \(B, C, H, W\), got \(3, 5, 5\)"):
        RandomCropFlip()(x[0], torch.Generator())
    with pytest.raises(ValueError, match="fill has 2 values for 3 channels"):
        RandomCropFlip(fill=(0.0, 1.0))(x, torch.Generator())


# --------------------------------------------------------------------------- synthetic


def test_synthetic_is_seeded_and_configurable():
    a = build_dataset("synthetic", seed=3)
    b = build_dataset("synthetic", seed=3)
    c = build_dataset("synthetic", seed=4)
    assert a.x_train.shape == (4096, 32) and a.x_test.shape == (1024, 32) and a.num_classes == 10
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_test, b.y_test)
    assert not torch.equal(a.x_train, c.x_train)
    assert len(set(a.y_train.tolist())) == 10
    two = build_dataset("synthetic", num_classes=2, num_features=8, num_train=100, num_test=10)
    assert two.x_train.shape == (100, 8) and set(two.y_train.tolist()) == {0, 1}
    with pytest.raises(ValueError, match="num_classes must be >= 2, got 1"):
        build_dataset("synthetic", num_classes=1)


# --------------------------------------------------------------------------- partition


def test_iid_partition_is_disjoint_equal_and_seeded():
    y = torch.arange(103) % 7
    shards = partition(y, 4, "iid", seed=5)
    assert [len(s) for s in shards] == [25] * 4
    flat = torch.cat(shards)
    assert flat.dtype == torch.int64 and len(set(flat.tolist())) == 100 and flat.max() < 103
    assert all(torch.equal(a, b) for a, b in zip(shards, partition(y, 4, "iid", seed=5)))
    assert not torch.equal(torch.cat(partition(y, 4, "iid", seed=6)), flat)


def test_sorted_partition_gives_contiguous_label_slices():
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 10, (1001,), generator=g)
    shards = partition(y, 10, "sorted", seed=123)
    assert [len(s) for s in shards] == [100] * 10
    flat = torch.cat(shards)
    labels = y[flat]
    assert (labels[1:] >= labels[:-1]).all()  # label-sorted across nodes
    same = labels[1:] == labels[:-1]
    assert (flat[1:][same] > flat[:-1][same]).all()  # ties keep index order
    assert torch.equal(flat, torch.sort(y, stable=True).indices[:1000])  # the remainder is dropped at the end
    assert torch.equal(flat, torch.cat(partition(y, 10, "sorted", seed=0)))  # seed does not matter


def test_partition_rejects_bad_input():
    y = torch.arange(10)
    with pytest.raises(ValueError, match="unknown partition scheme 'random'; known: iid, sorted"):
        partition(y, 2, "random")
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        partition(y, 0)
    with pytest.raises(ValueError, match="cannot split 10 samples into world_size = 11"):
        partition(y, 11)
    with pytest.raises(ValueError, match=r"y must be 1-D .*, got shape \(2, 5\)"):
        partition(y.view(2, 5), 2)


# --------------------------------------------------------------------------- loaders


def _toy(n=50):
    x = torch.arange(n, dtype=torch.float32).view(n, 1) * 10
    return x, torch.arange(n) % 3


def _draw(loader, k):
    return [loader.next_batch() for _ in range(k)]


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(p[0], q[0]) and torch.equal(p[1], q[1]) for p, q in zip(a, b))


def test_loader_epoch_covers_the_shard_once():
    x, y = _toy()
    idx = torch.arange(5, 38)  # 33 samples
    full = ShardLoader(x, y, idx, 8, seed=0, node=0, drop_last=False)
    assert full.steps_per_epoch == len(full) == 5
    batches = list(full)
    assert [len(b[1]) for b in batches] == [8, 8, 8, 8, 1]
    seen = torch.cat([b[0][:, 0] for b in batches]) / 10
    assert sorted(seen.long().tolist()) == list(range(5, 38))
    assert all(torch.equal(b[1], y[(b[0][:, 0] / 10).long()]) for b in batches)

    dropping = ShardLoader(x, y, idx, 8, seed=0, node=0)
    assert dropping.steps_per_epoch == 4
    epoch0 = torch.cat([b[0] for b in dropping])
    epoch1 = torch.cat([b[0] for b in dropping])  # iterating again starts the next epoch
    assert len(epoch0) == 32 and len(set(epoch0.view(-1).tolist())) == 32
    assert dropping.epoch == 1 and not torch.equal(epoch0, epoch1)


def test_loader_moves_batches_to_its_device():
    x, y = _toy()
    loader = ShardLoader(x.double(), y, torch.arange(50), 5, seed=0, node=0, device="cpu")
    bx, by = loader.next_batch()
    assert bx.device == torch.device("cpu") and by.device == torch.device("cpu") and bx.shape == (5, 1)


def test_loaders_of_different_nodes_shuffle_differently():
    x, y = _toy()
    a = ShardLoader(x, y, torch.arange(50), 10, seed=0, node=0)
    b = ShardLoader(x, y, torch.arange(50), 10, seed=0, node=1)
    c = ShardLoader(x, y, torch.arange(50), 10, seed=0, node=0)
    first_a, first_b, first_c = _draw(a, 3), _draw(b, 3), _draw(c, 3)
    assert _same(first_a, first_c) and not _same(first_a, first_b)


@pytest.mark.parametrize("taken", [0, 3, 5, 6, 12])  # start, mid-epoch, epoch end, epoch start, later epoch
def test_loader_resumes_exactly(taken):
    x, y = _toy()
    aug = lambda b, g: b + torch.rand(b.shape, generator=g)  # noqa: E731
    original = ShardLoader(x, y, torch.arange(3, 48), 8, seed=11, node=2, transform=aug)
    assert original.steps_per_epoch == 5
    _draw(original, taken)
    state = original.state_dict()
    expected = _draw(original, 12)

    resumed = ShardLoader(x, y, torch.arange(3, 48), 8, seed=11, node=2, transform=aug)
    resumed.load_state_dict(state)
    # A new epoch starts when its first batch is drawn, not when the last one ends.
    assert (resumed.epoch, resumed.position) == ((0, 0) if taken == 0 else ((taken - 1) // 5, (taken - 1) % 5 + 1))
    assert _same(_draw(resumed, 12), expected)


def test_loader_state_is_plain_and_independent():
    x, y = _toy()
    loader = ShardLoader(x, y, torch.arange(50), 7, seed=1, node=0)
    _draw(loader, 9)
    state = loader.state_dict()
    assert state["epoch"] == 1 and state["position"] == 2
    assert state["shuffle_generator"].dtype == torch.uint8
    after = _draw(loader, 4)
    loader.load_state_dict(state)  # the saved state was not mutated by further draws
    assert _same(_draw(loader, 4), after)


def test_loader_state_mismatch_is_refused():
    x, y = _toy()
    state = ShardLoader(x, y, torch.arange(50), 8, seed=1, node=0).state_dict()
    other = ShardLoader(x, y, torch.arange(50), 4, seed=1, node=0)
    with pytest.raises(ValueError, match="ShardLoader state was saved with batch_size = 8, this loader has 4"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="ShardLoader state lacks epoch"):
        other.load_state_dict({k: v for k, v in state.items() if k != "epoch"})
    same = ShardLoader(x, y, torch.arange(50), 8, seed=1, node=0)
    with pytest.raises(ValueError, match=r"position 9; expected epoch >= 0 and 0 <= position <= 6"):
        same.load_state_dict({**state, "position": 9})


def test_loader_rejects_bad_arguments():
    x, y = _toy()
    with pytest.raises(ValueError, match="batch_size 16 exceeds the shard size 10 of node 3 with drop_last=True"):
        ShardLoader(x, y, torch.arange(10), 16, seed=0, node=3)
    ShardLoader(x, y, torch.arange(10), 16, seed=0, node=3, drop_last=False)
    with pytest.raises(ValueError, match=r"indices must lie in \[0, 50\), got \[0, 50\]"):
        ShardLoader(x, y, torch.arange(51), 4, seed=0, node=0)
    with pytest.raises(ValueError, match="indices must be a non-empty 1-D integer tensor"):
        ShardLoader(x, y, torch.tensor([0.0, 1.0]), 1, seed=0, node=0)
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        ShardLoader(x, y, torch.arange(10), 0, seed=0, node=0)
    with pytest.raises(ValueError, match="same length, got 50 and 49"):
        ShardLoader(x, y[:49], torch.arange(10), 2, seed=0, node=0)


def test_build_loaders_and_stack_next():
    x, y = _toy(40)
    loaders = data.build_loaders(x, y, 4, 3, scheme="sorted", seed=2)
    mirror = data.build_loaders(x, y, 4, 3, scheme="sorted", seed=2)
    xs, ys = data.stack_next(loaders)
    assert xs.shape == (4, 3, 1) and ys.shape == (4, 3)
    for k in range(4):
        bx, by = mirror[k].next_batch()
        assert torch.equal(xs[k], bx) and torch.equal(ys[k], by)
    only = data.build_loaders(x, y, 4, 3, scheme="sorted", seed=2, nodes=[2])
    fresh = data.build_loaders(x, y, 4, 3, scheme="sorted", seed=2)[2]
    assert _same(_draw(only[0], 6), _draw(fresh, 6))
    with pytest.raises(ValueError, match="node must be < world_size = 4, got 4"):
        data.build_loaders(x, y, 4, 3, nodes=[4])
    ragged = data.build_loaders(x, y, 2, 3, drop_last=False)  # 20 per node: 6 batches of 3, then 2
    for _ in range(5):
        data.stack_next(ragged)
    ragged[0].next_batch()
    with pytest.raises(ValueError, match="cannot stack batches of different shapes"):
        data.stack_next(ragged)
