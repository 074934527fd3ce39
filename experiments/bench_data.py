"""The benchmark's data sets, as ``gossip.train --data`` factories (``bench_data:NAME``).

A name is ``<base>_n<N>_<role>`` (classification) or ``<base>_n<N>_c<C>_<role>``
(language modelling, ``C`` the context in bytes):

- ``base``: ``mnist1d`` (MNIST-1D generated locally from the ``mnist1d`` package's
  templates with ``N / 0.8`` samples, the package's own 80/20 train/test split; N = 4000
  is exactly the embedded default data set), ``synthetic`` (Gaussian blobs, for tests),
  ``text`` (the default text corpus of ``gossip.train --data text``, the Python
  standard library's sources as bytes, see :mod:`gossip.data.text`) or ``synthtext``
  (a small generated text, for tests).
- ``N``: the number of training samples (windows of ``C + 1`` bytes for text). The
  benchmark gives every node the same amount of data whatever the node count
  (``N = samples_per_node * nodes``), so that a 16-node run does not train on a
  sixteenth of what a 4-node run does per node.
- ``role``: ``val`` for the tuning trials (the run's "test" evaluation is a held-out
  validation carve of the training data) or ``test`` for the final runs (the whole
  training data, evaluated on the test split). Tuning never sees the test split: it is
  not even handed to the run.

The carve. Classification: 10 % of the training samples, drawn with a fixed seed.
Text: the held-out test split is the corpus's tail (:func:`gossip.data.text.split_tail`,
at most :data:`TEXT_EVAL_BYTES`); the validation carve is the block of the same size
just before it, the tail of the training text, so that it is text no tuning run
trained on rather than windows interleaved with the training ones. The ``N`` training
windows are spread evenly over the training text (less the carve for ``val``), so
that every node count samples the same corpus.

Every call records what it served in :data:`SERVED` (the role and a digest of the
evaluation split), which the driver stores beside each trial and its test checks.

Importing this module loads neither torch nor the training code (each function loads
what it needs), so that the benchmark checks a spec's data sizes in a fraction of a
second (:func:`train_size`).
"""

from __future__ import annotations

import functools
import hashlib
import os
import random
import re
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from gossip import data as gdata

__all__ = ["VALIDATION_FRACTION", "TEXT_EVAL_BYTES", "TEXT_BASES", "BASES", "SERVED", "digest", "build",
           "dataset_name", "carve_size", "train_size"]

#: share of the training set held out for tuning, and the seed of that carve (fixed, so
#: every method is tuned on the same validation samples)
VALIDATION_FRACTION = 0.1
_CARVE_SEED = 20261126
#: bytes of the text test split and of the validation carve before it: every evaluation
#: runs the averaged model and each node's own over all of it, so it is kept small
TEXT_EVAL_BYTES = 16384
_NAME = re.compile(r"^(?P<base>[a-z0-9]+)_n(?P<n>\d+)(?:_c(?P<context>\d+))?_(?P<role>val|test)$")
#: what each call served: {"name", "role", "num_train", "num_eval", "eval_digest"}
SERVED: list[dict[str, Any]] = []

# gossip.train imports a --data factory by its module name, ``bench_data`` (as the
# benchmark's trials and the witnesses' recorded configurations name it): imported as
# experiments.bench_data, this module answers to that name too, in this process
sys.modules.setdefault("bench_data", sys.modules[__name__])


def dataset_name(base: str, num_train: int, role: str, context: int | None = None) -> str:
    """The factory spec for ``gossip.train --data`` (``context``: text bases only)."""
    if (base in TEXT_BASES) != (context is not None):
        raise ValueError(f"bench_data: a context is given for the text bases {', '.join(TEXT_BASES)} only "
                         f"(base {base!r}, context {context!r})")
    return f"bench_data:{base}_n{num_train}{'' if context is None else f'_c{context}'}_{role}"


def digest(x: torch.Tensor, y: torch.Tensor) -> str:
    """A content digest of one split (its inputs and labels)."""
    import numpy as np

    h = hashlib.sha256()
    h.update(np.ascontiguousarray(x.numpy()).tobytes())
    h.update(np.ascontiguousarray(y.numpy()).tobytes())
    return h.hexdigest()[:16]


def _mnist1d(num_train: int) -> gdata.Dataset:
    import numpy as np
    import torch

    from gossip import data as gdata

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
        # a temporary file of this call's own: two processes building the same set at once
        # (verify's witness workers) each write theirs, and either rename wins
        fd, name = tempfile.mkstemp(prefix=f"{cache.stem}.", suffix=".tmp.npz", dir=cache.parent)
        tmp = Path(name)
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(f, **a)
            tmp.replace(cache)
        finally:
            tmp.unlink(missing_ok=True)
    return gdata.Dataset(name=f"mnist1d-n{num_train}", x_train=torch.from_numpy(a["x"]).unsqueeze(1),
                         y_train=torch.from_numpy(a["y"]), x_test=torch.from_numpy(a["x_test"]).unsqueeze(1),
                         y_test=torch.from_numpy(a["y_test"]), num_classes=10, input_shape=(1, a["x"].shape[1]))


def _synthetic(num_train: int) -> gdata.Dataset:
    import torch

    from gossip import data as gdata

    g = torch.Generator().manual_seed(7)
    centres = 2.0 * torch.randn(4, 8, generator=g)

    def draw(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.randint(0, 4, (n,), generator=g)
        return centres[y] + torch.randn(n, 8, generator=g), y

    (x, y), (xt, yt) = draw(num_train), draw(max(64, num_train // 4))
    return gdata.Dataset(name=f"synthetic-n{num_train}", x_train=x, y_train=y, x_test=xt, y_test=yt,
                         num_classes=4, input_shape=(8,))


_BASES = {"mnist1d": _mnist1d, "synthetic": _synthetic}


@functools.lru_cache(maxsize=2)
def _corpus(base: str) -> tuple[bytes, dict[str, Any]]:
    """The whole text of a text base and what it is (read once per process: the default
    corpus is some 30 MB in about 1,800 files)."""
    from gossip.data import text as textdata

    if base == "text":
        return textdata.stdlib_corpus()
    # synthtext: sentences drawn from a small vocabulary by a fixed generator, enough
    # structure for a tiny model to learn within a few steps
    g = random.Random(11)
    words = ["the", "node", "sends", "bytes", "to", "its", "peer", "and", "a", "model", "learns", "fast", "slow"]
    text = "\n".join(" ".join(g.choice(words) for _ in range(g.randint(4, 9))) + "." for _ in range(6000))
    return text.encode("ascii"), {"corpus": "synthtext"}


def _spread(x: torch.Tensor, y: torch.Tensor, k: int, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``k`` of the windows ``(x, y)``, evenly spaced (copied out of the corpus's views)."""
    import torch

    if k > x.shape[0]:
        raise ValueError(f"bench_data: {where} holds {x.shape[0]} windows; {k} were asked for "
                         f"(lower samples_per_node or the context)")
    idx = torch.linspace(0, x.shape[0] - 1, k).round().long()
    return x[idx].clone(), y[idx].clone()


def _text(base: str, num_train: int, context: int, role: str) -> gdata.Dataset:
    from gossip import data as gdata
    from gossip.data import text as textdata

    text, info = _corpus(base)
    head, tail = textdata.split_tail(text, test_fraction=1.0, max_test_bytes=TEXT_EVAL_BYTES, context=context,
                                     where=f"the {base} corpus")
    if role == "val":  # the tail of the training text, as long as the test split, is held out
        head, tail = head[:-len(tail)], head[-len(tail):]
    x, y = _spread(*textdata.windows(head, context), num_train, f"the {base} training text")
    xt, yt = textdata.windows(tail, context)
    ident = textdata.corpus_identity(f"{info['corpus']}-bench", x.numpy().tobytes(), tail, **info)
    return gdata.Dataset(name=f"{base}-n{num_train}-c{context}", x_train=x, y_train=y, x_test=xt.clone(),
                         y_test=yt.clone(), num_classes=textdata.VOCAB_SIZE, input_shape=(context,),
                         task=gdata.LANGUAGE_MODEL, bytes_per_token=1.0, corpus=ident)


#: the bases whose task is next-token language modelling (their names carry a context)
TEXT_BASES = ("text", "synthtext")
#: every base, classification first
BASES = (*_BASES, *TEXT_BASES)


def carve_size(num_train: int) -> int:
    """Samples of the validation carve of a classification training set of ``num_train``."""
    return max(1, int(round(VALIDATION_FRACTION * num_train)))


def train_size(base: str, num_train: int, role: str) -> int:
    """Training samples (text: windows) of the data set ``<base>_n<num_train>_<role>``:
    a classifier's tuning set is less the validation carve; a text one keeps its
    ``num_train`` windows (its carve is a block of text)."""
    return num_train - carve_size(num_train) if role == "val" and base not in TEXT_BASES else num_train


def carve(num_train: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices (kept, validation) of the tuning carve of a training set of ``num_train``."""
    import torch

    perm = torch.randperm(num_train, generator=torch.Generator().manual_seed(_CARVE_SEED))
    nval = carve_size(num_train)
    return perm[nval:].sort().values, perm[:nval].sort().values


def build(base: str, num_train: int, role: str, context: int | None = None) -> gdata.Dataset:
    """The data set ``<base>_n<num_train>[_c<context>]_<role>`` (see the module's docstring)."""
    if base not in BASES:
        raise ValueError(f"bench_data: unknown base data set {base!r}; known: {', '.join(BASES)}")
    if role not in ("val", "test"):
        raise ValueError(f"bench_data: role must be 'val' or 'test', got {role!r}")
    if (base in TEXT_BASES) != (context is not None):
        raise ValueError(f"bench_data: a context is given for the text bases {', '.join(TEXT_BASES)} only "
                         f"(base {base!r}, context {context!r})")
    if context is not None:
        ds = _text(base, num_train, context, role)
        SERVED.append({"name": f"{base}_n{num_train}_c{context}_{role}", "role": role, "num_train": ds.num_train,
                       "num_eval": ds.num_test, "eval_digest": digest(ds.x_test, ds.y_test)})
        return ds
    full = _BASES[base](num_train)
    if full.num_train != num_train:
        raise ValueError(f"bench_data: {base} gave {full.num_train} training samples, asked for {num_train}")
    if role == "test":
        ds = full
    else:
        from gossip import data as gdata

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
        raise AttributeError(f"module 'bench_data' has no attribute {name!r} "
                             f"(names are <base>_n<N>[_c<context>]_<val|test>)")

    def factory(seed: int) -> gdata.Dataset:  # the data do not depend on the run's seed
        return build(m["base"], int(m["n"]), m["role"], None if m["context"] is None else int(m["context"]))

    factory.__name__ = name
    return factory
