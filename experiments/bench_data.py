"""The benchmark's data sets, as ``gossip.train --data`` factories (``bench_data:NAME``).

A name is ``<base>_n<N>_<role>``:

- ``base``: ``mnist1d`` (MNIST-1D generated locally from the ``mnist1d`` package's
  templates with ``N / 0.8`` samples, the package's own 80/20 train/test split; N = 4000
  is exactly the embedded default data set) or ``synthetic`` (Gaussian blobs, for tests).
- ``N``: the number of training samples. The benchmark gives every node the same amount
  of data whatever the node count (``N = samples_per_node * nodes``), so that a 16-node
  run does not train on a sixteenth of what a 4-node run does per node.
- ``role``: ``val`` for the tuning trials (the training set less a held-out carve of
  10 %, drawn with a fixed seed; the run's "test" evaluation is that carve) or ``test``
  for the final runs (the whole training set, evaluated on the test split). Tuning never
  sees the test split: it is not even handed to the run.

Every call records what it served in :data:`SERVED` (the role and a digest of the
evaluation split), which the driver stores beside each trial and its test checks.
"""

from __future__ import annotations

import hashlib
import random
import re
from typing import Any

import numpy as np
import torch

from gossip import data as gdata

__all__ = ["VALIDATION_FRACTION", "SERVED", "digest", "build", "dataset_name"]

#: share of the training set held out for tuning, and the seed of that carve (fixed, so
#: every method is tuned on the same validation samples)
VALIDATION_FRACTION = 0.1
_CARVE_SEED = 20261126
_NAME = re.compile(r"^(?P<base>[a-z0-9]+)_n(?P<n>\d+)_(?P<role>val|test)$")
#: what each call served: {"name", "role", "num_train", "num_eval", "eval_digest"}
SERVED: list[dict[str, Any]] = []


def dataset_name(base: str, num_train: int, role: str) -> str:
    """The factory spec for ``gossip.train --data``."""
    return f"bench_data:{base}_n{num_train}_{role}"


def digest(x: torch.Tensor, y: torch.Tensor) -> str:
    """A content digest of one split (its inputs and labels)."""
    h = hashlib.sha256()
    h.update(np.ascontiguousarray(x.numpy()).tobytes())
    h.update(np.ascontiguousarray(y.numpy()).tobytes())
    return h.hexdigest()[:16]


def _mnist1d(num_train: int) -> gdata.Dataset:
    if num_train == 4000:  # the embedded default, through its cache
        return gdata.build_dataset("mnist1d", seed=0)
    cache = gdata.default_cache_dir() / f"bench-mnist1d-n{num_train}.npz"
    if cache.is_file():
        with np.load(cache, allow_pickle=False) as z:
            a = {k: z[k] for k in ("x", "y", "x_test", "y_test")}
    else:
        from mnist1d.data import get_dataset_args, make_dataset

        args = get_dataset_args()
        args.num_samples = int(round(num_train / args.train_split))
        # make_dataset reseeds NumPy's and Python's global generators: restore them
        np_state, py_state = np.random.get_state(), random.getstate()
        try:
            raw = make_dataset(args)
        finally:
            np.random.set_state(np_state)
            random.setstate(py_state)
        a = {"x": np.asarray(raw["x"], np.float32), "y": np.asarray(raw["y"], np.int64),
             "x_test": np.asarray(raw["x_test"], np.float32), "y_test": np.asarray(raw["y_test"], np.int64)}
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(".tmp.npz")
        np.savez(tmp, **a)
        tmp.replace(cache)
    return gdata.Dataset(name=f"mnist1d-n{num_train}", x_train=torch.from_numpy(a["x"]).unsqueeze(1),
                         y_train=torch.from_numpy(a["y"]), x_test=torch.from_numpy(a["x_test"]).unsqueeze(1),
                         y_test=torch.from_numpy(a["y_test"]), num_classes=10, input_shape=(1, a["x"].shape[1]))


def _synthetic(num_train: int) -> gdata.Dataset:
    g = torch.Generator().manual_seed(7)
    centres = 2.0 * torch.randn(4, 8, generator=g)

    def draw(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.randint(0, 4, (n,), generator=g)
        return centres[y] + torch.randn(n, 8, generator=g), y

    (x, y), (xt, yt) = draw(num_train), draw(max(64, num_train // 4))
    return gdata.Dataset(name=f"synthetic-n{num_train}", x_train=x, y_train=y, x_test=xt, y_test=yt,
                         num_classes=4, input_shape=(8,))


_BASES = {"mnist1d": _mnist1d, "synthetic": _synthetic}


def carve(num_train: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices (kept, validation) of the tuning carve of a training set of ``num_train``."""
    perm = torch.randperm(num_train, generator=torch.Generator().manual_seed(_CARVE_SEED))
    nval = max(1, int(round(VALIDATION_FRACTION * num_train)))
    return perm[nval:].sort().values, perm[:nval].sort().values


def build(base: str, num_train: int, role: str) -> gdata.Dataset:
    """The data set ``<base>_n<num_train>_<role>`` (see the module's docstring)."""
    if base not in _BASES:
        raise ValueError(f"bench_data: unknown base data set {base!r}; known: {', '.join(_BASES)}")
    if role not in ("val", "test"):
        raise ValueError(f"bench_data: role must be 'val' or 'test', got {role!r}")
    full = _BASES[base](num_train)
    if full.num_train != num_train:
        raise ValueError(f"bench_data: {base} gave {full.num_train} training samples, asked for {num_train}")
    if role == "test":
        ds = full
    else:
        keep, val = carve(num_train)
        ds = gdata.Dataset(name=f"{full.name}-val", x_train=full.x_train[keep], y_train=full.y_train[keep],
                           x_test=full.x_train[val], y_test=full.y_train[val], num_classes=full.num_classes,
                           input_shape=full.input_shape)
    SERVED.append({"name": f"{base}_n{num_train}_{role}", "role": role, "num_train": ds.num_train,
                   "num_eval": ds.num_test, "eval_digest": digest(ds.x_test, ds.y_test)})
    return ds


def __getattr__(name: str):  # bench_data:mnist1d_n16000_val -> a factory fn(seed)
    m = _NAME.match(name)
    if m is None:
        raise AttributeError(f"module 'bench_data' has no attribute {name!r} (names are <base>_n<N>_<val|test>)")

    def factory(seed: int) -> gdata.Dataset:  # the data do not depend on the run's seed
        return build(m["base"], int(m["n"]), m["role"])

    factory.__name__ = name
    return factory
