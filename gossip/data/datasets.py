"""The registry of data sets and the :class:`Dataset` they build, with the task each declares.

:func:`build_dataset` turns a name into a :class:`Dataset` (float32 inputs, int64
labels, a train and a test split); :func:`available_datasets` lists the names.

- ``mnist1d`` (default): generated locally by the ``mnist1d`` package's
  ``make_dataset`` with its default arguments (never its download path), 4000
  train / 1000 test signals shaped ``(1, 40)``. Generation takes a few seconds, so
  the result is cached as a ``.npz`` file in ``cache_dir`` (default: ``$GOSSIP_CACHE``
  or ``~/.cache/gossip``), written atomically; a damaged cache file is regenerated
  with a warning. ``make_dataset`` seeds NumPy's and Python's *global* generators
  itself (with its fixed seed 42), so the data is the same on every call and every
  machine; we save and restore both global states around it so that building the
  data set leaves the caller's random streams untouched.
- ``cifar10``: read from a local directory holding the standard python batches
  (``data_batch_1`` .. ``data_batch_5``, ``test_batch``, optionally
  ``batches.meta``), normalised per channel, shaped ``(3, 32, 32)``. Anything
  missing or malformed raises :class:`~gossip.errors.DataError` naming the path and
  what is expected. :class:`RandomCropFlip` is the usual augmentation (random crop
  with 4 pixels of padding and horizontal flip), applied per batch with an explicit
  generator; the data set carries it as ``Dataset.augment``.
- ``synthetic``: a multinomial logistic-regression problem (labels drawn from a
  softmax of a random linear model of Gaussian features), for quick checks.
- ``text`` and ``wikitext2``: UTF-8 text as bytes for next-byte language modelling
  (:mod:`gossip.data.text`).
"""

from __future__ import annotations

from gossip._registry import Registry

import importlib.metadata
import math
import os
import pickle
import random
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from gossip._atomic import write_atomically
from gossip.data import text as textdata
from gossip.data._common import _STREAM_SYNTHETIC, _check_int, _check_seed, _generator
from gossip.errors import DataError

__all__ = [
    "CLASSIFICATION",
    "LANGUAGE_MODEL",
    "TASKS",
    "TOKEN_DTYPE",
    "CIFAR10_MEAN",
    "CIFAR10_STD",
    "Dataset",
    "RandomCropFlip",
    "available_datasets",
    "register_dataset",
    "default_model",
    "FALLBACK_MODEL",
    "build_dataset",
    "dataset_options",
    "default_cache_dir",
    "token_ids",
]

#: Per-channel mean and standard deviation of the CIFAR-10 training images (pixel
#: values in [0, 1]); inputs are normalised as ``(x - mean) / std``.
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)

#: the tasks a data set declares: one label per example, or next-token language modelling
CLASSIFICATION = "classification"
LANGUAGE_MODEL = "lm"
TASKS = (CLASSIFICATION, LANGUAGE_MODEL)

#: the dtype token ids reach a model in, in training, in evaluation and in the check of
#: a user's model: int64, the index dtype every PyTorch layer takes (``nn.Embedding``
#: refuses uint8). Data sets keep theirs (byte-level text: uint8, one byte a token).
TOKEN_DTYPE = torch.int64


def token_ids(x: Tensor) -> Tensor:
    """``x`` as a model receives it: integer ids (uint8, int32, ...) as :data:`TOKEN_DTYPE`;
    float inputs (and int64 ones) unchanged."""
    if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype in (TOKEN_DTYPE, torch.bool):
        return x
    return x.to(TOKEN_DTYPE)


# Bumped when the layout of the mnist1d cache file changes.
_MNIST1D_CACHE_FORMAT = 1


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


# --------------------------------------------------------------------------- data set


@dataclass(frozen=True, eq=False, kw_only=True)
class Dataset:
    """A data set held in memory, with the task it declares.

    ``task="classification"``: ``x_train``/``x_test`` are float32 tensors shaped
    ``(N, *input_shape)``; ``y_train``/``y_test`` are int64 tensors shaped ``(N,)``
    with values in ``[0, num_classes)``.
    ``task="lm"`` (next-token language modelling): ``x`` and ``y`` are integer token
    ids shaped ``(N, context)`` (``input_shape == (context,)``), ``y`` the tokens that
    follow those of ``x`` (``num_classes`` is the vocabulary); uint8 views of one byte
    stream for byte-level text (see :mod:`gossip.data.text`).

    ``augment``, when set, is a per-batch training transform ``augment(x, generator) -> x`` (see :class:`RandomCropFlip`); applying it is the
    caller's choice (pass it to :class:`ShardLoader` as ``transform``).
    """

    name: str
    x_train: Tensor
    y_train: Tensor
    x_test: Tensor
    y_test: Tensor
    num_classes: int
    input_shape: tuple[int, ...]
    class_names: tuple[str, ...] | None = None
    augment: Callable[[Tensor, torch.Generator], Tensor] | None = None
    #: what is learnt: ``classification`` (one label per example) or ``lm`` (next-token
    #: language modelling, a label per position); the loop and evaluation read it here
    task: str = "classification"
    #: ``lm`` only: bytes of text per token, for bits per byte (1 for byte-level text)
    bytes_per_token: float = 1.0
    #: where the examples came from and their hash (text corpora), recorded in config.json
    corpus: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "input_shape", tuple(int(s) for s in self.input_shape))
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}, got {self.task!r}")
        _check_int("num_classes", self.num_classes, minimum=2)
        if self.task == LANGUAGE_MODEL:
            self._check_tokens()
        else:
            self._check_classification()
        if self.class_names is not None and len(self.class_names) != self.num_classes:
            raise ValueError(
                f"class_names must have num_classes = {self.num_classes} entries, got {len(self.class_names)}"
            )
        if not (isinstance(self.bytes_per_token, (int, float)) and self.bytes_per_token > 0):
            raise ValueError(f"bytes_per_token must be a positive number, got {self.bytes_per_token!r}")

    def _check_classification(self) -> None:
        for split in ("train", "test"):
            x, y = getattr(self, f"x_{split}"), getattr(self, f"y_{split}")
            if not isinstance(x, Tensor) or x.dtype != torch.float32:
                raise ValueError(f"x_{split} must be a float32 tensor, got {getattr(x, 'dtype', type(x))}")
            if not isinstance(y, Tensor) or y.dtype != torch.int64 or y.dim() != 1:
                raise ValueError(f"y_{split} must be a 1-D int64 tensor, got {getattr(y, 'dtype', type(y))}")
            if tuple(x.shape[1:]) != self.input_shape or x.shape[0] != y.shape[0]:
                raise ValueError(
                    f"x_{split} must be shaped (len(y_{split}), *input_shape) = "
                    f"({y.shape[0]}, {', '.join(map(str, self.input_shape))}), got {tuple(x.shape)}"
                )
            if y.numel() and (int(y.min()) < 0 or int(y.max()) >= self.num_classes):
                raise ValueError(
                    f"y_{split} must lie in [0, {self.num_classes}), got values in "
                    f"[{int(y.min())}, {int(y.max())}]"
                )

    def _check_tokens(self) -> None:
        for split in ("train", "test"):
            x, y = getattr(self, f"x_{split}"), getattr(self, f"y_{split}")
            for name, t in ((f"x_{split}", x), (f"y_{split}", y)):
                if not isinstance(t, Tensor) or t.dtype not in (torch.uint8, torch.int32, torch.int64) or t.dim() != 2:
                    raise ValueError(f"{name} of a language-model data set must be a 2-D uint8/int32/int64 tensor "
                                     f"of token ids (N, context), got {getattr(t, 'dtype', type(t))} "
                                     f"{tuple(getattr(t, 'shape', ()))}")
            if tuple(x.shape) != tuple(y.shape) or tuple(x.shape[1:]) != self.input_shape:
                raise ValueError(f"x_{split} and y_{split} must both be shaped (N, *input_shape) = "
                                 f"(N, {', '.join(map(str, self.input_shape))}), got {tuple(x.shape)} and "
                                 f"{tuple(y.shape)}")
            if x.shape[0] == 0:
                raise ValueError(f"x_{split} holds no window")

    @property
    def num_train(self) -> int:
        return int(self.y_train.shape[0])

    @property
    def num_test(self) -> int:
        return int(self.y_test.shape[0])

    def __repr__(self) -> str:
        task = f", task={self.task!r}" if self.task != CLASSIFICATION else ""
        return (
            f"Dataset(name={self.name!r}, train={self.num_train}, test={self.num_test}, "
            f"input_shape={self.input_shape}, num_classes={self.num_classes}{task})"
        )


def default_cache_dir() -> Path:
    """``$GOSSIP_CACHE`` if set, else ``~/.cache/gossip``."""
    env = os.environ.get("GOSSIP_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "gossip"


# --------------------------------------------------------------------------- mnist1d


def _mnist1d_version() -> str:
    try:
        return importlib.metadata.version("mnist1d")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _generate_mnist1d() -> dict[str, np.ndarray]:
    # Imported here: the package pulls in matplotlib and requests (about a second),
    # which a cache hit does not need.
    from mnist1d.data import get_dataset_args, make_dataset

    # make_dataset reseeds the global NumPy and Python generators (fixed seed 42):
    # deterministic, but it must not leak into the caller's random streams.
    np_state, py_state = np.random.get_state(), random.getstate()
    try:
        raw = make_dataset(get_dataset_args())
    finally:
        np.random.set_state(np_state)
        random.setstate(py_state)
    return {
        "x_train": np.asarray(raw["x"], dtype=np.float32),
        "y_train": np.asarray(raw["y"], dtype=np.int64),
        "x_test": np.asarray(raw["x_test"], dtype=np.float32),
        "y_test": np.asarray(raw["y_test"], dtype=np.int64),
    }


def _check_mnist1d_arrays(arrays: Mapping[str, np.ndarray]) -> None:
    for split in ("train", "test"):
        x, y = arrays[f"x_{split}"], arrays[f"y_{split}"]
        if x.dtype != np.float32 or x.ndim != 2 or x.shape[0] == 0:
            raise ValueError(f"x_{split} is {x.dtype} {x.shape}, expected float32 (N, L)")
        if y.dtype != np.int64 or y.shape != (x.shape[0],):
            raise ValueError(f"y_{split} is {y.dtype} {y.shape}, expected int64 ({x.shape[0]},)")
        if y.min() < 0 or y.max() > 9:
            raise ValueError(f"y_{split} has labels outside 0..9")
        if not np.isfinite(x).all():
            raise ValueError(f"x_{split} has non-finite values")
    if arrays["x_train"].shape[1] != arrays["x_test"].shape[1]:
        raise ValueError("train and test signals differ in length")


def _load_mnist1d_cache(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as npz:
        arrays = {k: npz[k] for k in ("x_train", "y_train", "x_test", "y_test")}
    _check_mnist1d_arrays(arrays)
    return arrays


def _mnist1d_arrays(cache_dir: Path) -> dict[str, np.ndarray]:
    path = cache_dir / f"mnist1d-{_mnist1d_version()}-c{_MNIST1D_CACHE_FORMAT}.npz"
    if path.exists():
        try:
            return _load_mnist1d_cache(path)
        except Exception as exc:  # any damage: truncated zip, bad CRC, wrong arrays
            warnings.warn(f"mnist1d cache '{path}' is damaged ({_one_line(exc)}); regenerating it", stacklevel=4)
    arrays = _generate_mnist1d()
    _check_mnist1d_arrays(arrays)
    # Several processes may generate at once (one per rank): each writes its own
    # temporary file and the last rename wins; the contents are identical.
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        write_atomically(path, lambda f: np.savez(f, **arrays))
    except OSError as exc:
        warnings.warn(f"could not write the mnist1d cache '{path}' ({_one_line(exc)}); continuing without it",
                      stacklevel=4)
    return arrays


def _build_mnist1d(*, data_dir: Path | None, cache_dir: Path, seed: int) -> Dataset:
    if data_dir is not None:
        warnings.warn("data_dir is ignored by dataset 'mnist1d' (it is generated locally)", stacklevel=3)
    a = _mnist1d_arrays(cache_dir)
    # (N, L) -> (N, 1, L): one input channel for a 1-D CNN.
    return Dataset(
        name="mnist1d",
        x_train=torch.from_numpy(a["x_train"]).unsqueeze(1),
        y_train=torch.from_numpy(a["y_train"]),
        x_test=torch.from_numpy(a["x_test"]).unsqueeze(1),
        y_test=torch.from_numpy(a["y_test"]),
        num_classes=10,
        input_shape=(1, a["x_train"].shape[1]),
    )


# --------------------------------------------------------------------------- cifar10

_CIFAR_TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
_CIFAR_TEST_FILE = "test_batch"
_CIFAR_META_FILE = "batches.meta"
_CIFAR_EXPECTED_DIR = "a directory holding the CIFAR-10 python batches data_batch_1..data_batch_5 and test_batch"
_CIFAR_EXPECTED_BATCH = "a pickled dict with b'data' uint8 (N, 3072) and b'labels' (N ints in 0..9)"


def _numpy_pickle_globals() -> dict[tuple[str, str], Any]:
    import codecs

    try:
        from numpy._core import multiarray
    except ImportError:  # NumPy 1.x
        from numpy.core import multiarray
    objects = {"_reconstruct": multiarray._reconstruct, "scalar": multiarray.scalar}
    allowed: dict[tuple[str, str], Any] = {("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): np.dtype}
    for module in ("numpy.core.multiarray", "numpy._core.multiarray"):
        for name, obj in objects.items():
            allowed[(module, name)] = obj
    # Protocol-2 pickles written by Python 3 spell bytes as _codecs.encode(str, 'latin1').
    allowed[("_codecs", "encode")] = codecs.encode
    return allowed


class _BatchUnpickler(pickle.Unpickler):
    """Unpickles plain containers and NumPy arrays only: a data file cannot run code."""

    _allowed: dict[tuple[str, str], Any] | None = None

    def find_class(self, module: str, name: str) -> Any:
        if _BatchUnpickler._allowed is None:
            _BatchUnpickler._allowed = _numpy_pickle_globals()
        try:
            return _BatchUnpickler._allowed[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}") from None


def _unpickle(path: Path) -> Any:
    with open(path, "rb") as f:
        # The official batches were pickled by Python 2: their str objects are bytes.
        return _BatchUnpickler(f, encoding="bytes").load()


def _read_cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    def bad(reason: str) -> DataError:
        return DataError(f"cifar10 file '{path}' is not a CIFAR-10 python batch ({reason}); "
                         f"expected {_CIFAR_EXPECTED_BATCH}")

    try:
        obj = _unpickle(path)
    except Exception as exc:
        raise bad(f"cannot unpickle it: {_one_line(exc)}") from None
    if not isinstance(obj, dict):
        raise bad(f"it holds a {type(obj).__name__}, not a dict")
    for key in (b"data", b"labels"):
        if key not in obj:
            raise bad(f"no {key!r} entry")
    data, labels = obj[b"data"], obj[b"labels"]
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        desc = f"{data.dtype} {data.shape}" if isinstance(data, np.ndarray) else type(data).__name__
        raise bad(f"b'data' is {desc}")
    try:
        labels = np.asarray(labels)
    except Exception as exc:
        raise bad(f"b'labels' is not a list of ints: {_one_line(exc)}") from None
    if labels.ndim != 1 or labels.dtype.kind not in "iu" or labels.shape[0] != data.shape[0]:
        raise bad(f"b'labels' is {labels.dtype} {labels.shape}, b'data' has {data.shape[0]} rows")
    if labels.size and (labels.min() < 0 or labels.max() > 9):
        raise bad(f"b'labels' has values outside 0..9 (min {labels.min()}, max {labels.max()})")
    return data, labels.astype(np.int64)


def _read_cifar_meta(path: Path) -> tuple[str, ...]:
    try:
        obj = _unpickle(path)
        names = tuple(n.decode() if isinstance(n, bytes) else str(n) for n in obj[b"label_names"])
    except Exception as exc:
        raise DataError(f"cifar10 file '{path}' is not a CIFAR-10 batches.meta ({_one_line(exc)}); "
                        f"expected a pickled dict with b'label_names' (10 names)") from None
    if len(names) != 10:
        raise DataError(f"cifar10 file '{path}' has {len(names)} label names; expected 10")
    return names


def _cifar_to_tensor(data: np.ndarray) -> Tensor:
    # Rows are 1024 red, 1024 green, 1024 blue values, each image row-major.
    x = torch.from_numpy(data).view(-1, 3, 32, 32).to(torch.float32).div_(255.0)
    mean = torch.tensor(CIFAR10_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(CIFAR10_STD).view(1, 3, 1, 1)
    return x.sub_(mean).div_(std)


def _build_cifar10(*, data_dir: Path | None, cache_dir: Path, seed: int) -> Dataset:
    if data_dir is None:
        raise DataError(f"dataset 'cifar10' needs data_dir (--data-dir): {_CIFAR_EXPECTED_DIR}")
    if not data_dir.exists():
        raise DataError(f"cifar10 data_dir '{data_dir}' does not exist; expected {_CIFAR_EXPECTED_DIR}")
    if not data_dir.is_dir():
        raise DataError(f"cifar10 data_dir '{data_dir}' is not a directory; expected {_CIFAR_EXPECTED_DIR}")
    needed = (*_CIFAR_TRAIN_FILES, _CIFAR_TEST_FILE)
    # Accept the parent of the archive's own folder too.
    nested = data_dir / "cifar-10-batches-py"
    if not all((data_dir / f).is_file() for f in needed) and nested.is_dir():
        data_dir = nested
    missing = [f for f in needed if not (data_dir / f).is_file()]
    if missing:
        raise DataError(f"cifar10 data_dir '{data_dir}' lacks {', '.join(missing)}; expected {_CIFAR_EXPECTED_DIR}")
    train = [_read_cifar_batch(data_dir / f) for f in _CIFAR_TRAIN_FILES]
    x_test, y_test = _read_cifar_batch(data_dir / _CIFAR_TEST_FILE)
    meta = data_dir / _CIFAR_META_FILE
    class_names = _read_cifar_meta(meta) if meta.is_file() else None
    fill = tuple(-m / s for m, s in zip(CIFAR10_MEAN, CIFAR10_STD))  # a black pixel, normalised
    return Dataset(
        name="cifar10",
        x_train=_cifar_to_tensor(np.concatenate([d for d, _ in train])),
        y_train=torch.from_numpy(np.concatenate([y for _, y in train])),
        x_test=_cifar_to_tensor(x_test),
        y_test=torch.from_numpy(y_test),
        num_classes=10,
        input_shape=(3, 32, 32),
        class_names=class_names,
        augment=RandomCropFlip(padding=4, fill=fill),
    )


class RandomCropFlip:
    """Random crop after zero padding, then a random horizontal flip, per image.

    ``RandomCropFlip(padding=4)(x, generator)`` takes a batch ``(B, C, H, W)`` and
    returns a new batch of the same shape: each image is padded by ``padding`` pixels
    on every side with ``fill`` (one value per channel; for normalised CIFAR-10 inputs
    the data set passes the normalised value of a black pixel, which is what padding
    the raw image with zeros gives), cropped back to ``H x W`` at an offset drawn
    uniformly, and mirrored left-right with probability ``flip_p``. All draws come
    from ``generator`` (on the CPU; ``x`` may live on any device).
    """

    def __init__(self, padding: int = 4, fill: float | Sequence[float] = 0.0, flip_p: float = 0.5) -> None:
        self.padding = _check_int("padding", padding, minimum=0)
        if not 0.0 <= float(flip_p) <= 1.0:
            raise ValueError(f"flip_p must lie in [0, 1], got {flip_p}")
        self.flip_p = float(flip_p)
        self.fill = tuple(float(v) for v in fill) if isinstance(fill, Sequence) else float(fill)

    def __repr__(self) -> str:
        return f"RandomCropFlip(padding={self.padding}, fill={self.fill}, flip_p={self.flip_p})"

    def __call__(self, x: Tensor, generator: torch.Generator) -> Tensor:
        if x.dim() != 4:
            raise ValueError(f"RandomCropFlip expects a batch shaped (B, C, H, W), got {tuple(x.shape)}")
        b, c, h, w = x.shape
        p = self.padding
        fill = torch.as_tensor(self.fill, dtype=x.dtype, device=x.device)
        if fill.dim() == 1 and fill.numel() != c:
            raise ValueError(f"RandomCropFlip fill has {fill.numel()} values for {c} channels")
        padded = fill.view(1, -1, 1, 1).expand(b, c, h + 2 * p, w + 2 * p).clone()
        padded[:, :, p:p + h, p:p + w] = x
        top = torch.randint(0, 2 * p + 1, (b,), generator=generator)
        left = torch.randint(0, 2 * p + 1, (b,), generator=generator)
        flip = torch.rand(b, generator=generator) < self.flip_p
        cols = torch.arange(w)
        cols = torch.where(flip[:, None], cols.flip(0)[None, :], cols[None, :]) + left[:, None]
        rows = top[:, None] + torch.arange(h)[None, :]
        dev = x.device
        # Advanced indices around a slice put the index dimensions first: (B, H, W, C).
        out = padded[torch.arange(b, device=dev)[:, None, None], :, rows.to(dev)[:, :, None], cols.to(dev)[:, None, :]]
        return out.permute(0, 3, 1, 2).contiguous()


# --------------------------------------------------------------------------- synthetic


def _build_synthetic(
    *,
    data_dir: Path | None,
    cache_dir: Path,
    seed: int,
    num_features: int = 32,
    num_classes: int = 10,
    num_train: int = 4096,
    num_test: int = 1024,
) -> Dataset:
    """Gaussian features x ~ N(0, I_d); labels ~ softmax(x W + b) with W ~ N(0, 4/d).

    The true model is a logistic regression, so ``logreg`` can fit it; the logits have
    a standard deviation of about 2, so the labels are noisy but learnable: the true
    model itself scores about 0.52 test accuracy with 10 classes, 0.83 with 2.
    """
    if data_dir is not None:
        warnings.warn("data_dir is ignored by dataset 'synthetic' (it is generated)", stacklevel=3)
    d = _check_int("num_features", num_features, minimum=1)
    k = _check_int("num_classes", num_classes, minimum=2)
    n_train = _check_int("num_train", num_train, minimum=1)
    n_test = _check_int("num_test", num_test, minimum=1)
    g = _generator(seed, _STREAM_SYNTHETIC)
    weight = torch.randn(d, k, generator=g) * (2.0 / math.sqrt(d))
    bias = torch.randn(k, generator=g) * 0.5
    x = torch.randn(n_train + n_test, d, generator=g)
    probs = torch.softmax(x @ weight + bias, dim=1)
    y = torch.multinomial(probs, 1, generator=g).squeeze(1)
    return Dataset(
        name="synthetic",
        x_train=x[:n_train].contiguous(),
        y_train=y[:n_train].contiguous(),
        x_test=x[n_train:].contiguous(),
        y_test=y[n_train:].contiguous(),
        num_classes=k,
        input_shape=(d,),
    )


# --------------------------------------------------------------------------- text


def _text_options(context: Any, test_fraction: Any, max_test_bytes: Any) -> tuple[int, float, int]:
    """The text options checked; ``max_test_bytes=None``: not given (its default then)."""
    context = _check_int("context", context, minimum=1)
    if isinstance(test_fraction, bool) or not isinstance(test_fraction, (int, float)) or not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must be a number in (0, 1), got {test_fraction!r}")
    if max_test_bytes is None:  # the default cap holds one held-out window only up to a context
        default = textdata.DEFAULT_MAX_TEST_BYTES
        if context + 1 > default:
            raise ValueError(f"context {context} is too long for the held-out text: one window takes context + 1 = "
                             f"{context + 1} bytes and the held-out text is capped at {default} bytes by default; "
                             f"give a context of at most {default - 1}, or max_test_bytes >= {context + 1}")
        return context, float(test_fraction), default
    return context, float(test_fraction), _max_test_bytes(max_test_bytes, context)


def _max_test_bytes(value: Any, context: int) -> int:
    value = _check_int("max_test_bytes", value, minimum=1)
    if value < context + 1:
        raise ValueError(f"max_test_bytes must be >= {context + 1} (context + 1: one held-out window of "
                         f"context {context}), got {value}")
    return value


def _lm_dataset(name: str, train: bytes, test: bytes, context: int, identity: Mapping[str, Any]) -> Dataset:
    x_train, y_train = textdata.windows(train, context)
    x_test, y_test = textdata.windows(test, context)
    return Dataset(name=name, x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test,
                   num_classes=textdata.VOCAB_SIZE, input_shape=(context,), task=LANGUAGE_MODEL,
                   bytes_per_token=1.0, corpus=dict(identity))


def _build_text(
    *,
    data_dir: Path | None,
    cache_dir: Path,
    seed: int,
    context: int = textdata.DEFAULT_CONTEXT,
    test_fraction: float = textdata.DEFAULT_TEST_FRACTION,
    max_test_bytes: int | None = None,
) -> Dataset:
    """UTF-8 text as bytes: the user's file or folder, else the default corpus (the
    standard library's sources); the held-out test set is the corpus's tail, at most
    ``max_test_bytes`` (:data:`gossip.data.text.DEFAULT_MAX_TEST_BYTES` when not given)."""
    context, test_fraction, max_test_bytes = _text_options(context, test_fraction, max_test_bytes)
    if data_dir is None:
        text, extra = textdata.stdlib_corpus()
        where, name = "the default text corpus", "python-stdlib"
    else:
        text = textdata.read_text(data_dir, min_bytes=2 * (context + 1))
        kind = "file" if data_dir.is_file() else "folder"
        where, name, extra = f"text {kind} '{data_dir}'", data_dir.name, {}
    train, test = textdata.split_tail(text, test_fraction=test_fraction, max_test_bytes=max_test_bytes,
                                      context=context, where=where)
    identity = textdata.corpus_identity(name, train, test, **extra)
    return _lm_dataset("text", train, test, context, identity)


def _build_wikitext2(
    *,
    data_dir: Path | None,
    cache_dir: Path,
    seed: int,
    context: int = textdata.DEFAULT_CONTEXT,
    max_test_bytes: int | None = None,
) -> Dataset:
    """WikiText-2 raw as bytes: trained on wiki.train.raw, tested on wiki.test.raw (its
    first ``max_test_bytes`` bytes when given)."""
    expected = f"a directory holding the WikiText-2 raw files {', '.join(textdata.WIKITEXT2_FILES)}"
    if data_dir is None:
        raise DataError(f"dataset 'wikitext2' needs data_dir (--data-dir): {expected}")
    if not data_dir.is_dir():
        raise DataError(f"wikitext2 data_dir '{data_dir}' is not a directory; expected {expected}")
    nested = data_dir / "wikitext-2-raw"  # the parent of the archive's own folder
    if not (data_dir / textdata.WIKITEXT2_FILES[0]).is_file() and nested.is_dir():
        data_dir = nested
    missing = [f for f in textdata.WIKITEXT2_FILES if not (data_dir / f).is_file()]
    if missing:
        raise DataError(f"wikitext2 data_dir '{data_dir}' lacks {', '.join(missing)}; expected {expected}")
    context = _check_int("context", context, minimum=1)
    train = textdata.read_text(data_dir / "wiki.train.raw", min_bytes=context + 1)
    test = textdata.read_text(data_dir / "wiki.test.raw", min_bytes=context + 1)
    textdata.read_text(data_dir / "wiki.valid.raw", min_bytes=1)  # complete and UTF-8, as released
    if max_test_bytes is not None:
        test = test[:_max_test_bytes(max_test_bytes, context)]
    identity = textdata.corpus_identity("wikitext2", train, test)
    return _lm_dataset("wikitext2", train, test, context, identity)


# --------------------------------------------------------------------------- registry

_DATASETS: Registry[Callable[..., Dataset]] = Registry("dataset")
#: the keyword parameters build_dataset passes every builder itself
_BUILDER_ARGS = ("data_dir", "cache_dir", "seed")


def dataset_options(name: str) -> tuple[str, ...]:
    """The options :func:`build_dataset` accepts for ``name``."""
    return tuple(p for p in _DATASETS.parameters(name) if p not in _BUILDER_ARGS)


#: the model a run trains on each data set when --model is not given
_DEFAULT_MODELS: dict[str, str] = {}
#: the default model of a data set registered without one, and of the user's own data
FALLBACK_MODEL = "mlp"


def register_dataset(name: str, builder: Callable[..., Dataset], summary: str,
                     default_model: str = FALLBACK_MODEL) -> None:
    """Make ``builder(*, data_dir, cache_dir, seed, **options)`` buildable as ``name``;
    its other keyword-only parameters are the options :func:`build_dataset` accepts.
    ``default_model``: the registered model a run trains on it when ``--model`` is not
    given."""
    _DATASETS.register(name, builder, summary)
    _DEFAULT_MODELS[name] = default_model


def default_model(name: str) -> str:
    """The model a run trains on data set ``name`` when ``--model`` is not given
    (:data:`FALLBACK_MODEL` for a name registered without one or not registered)."""
    return _DEFAULT_MODELS.get(name, FALLBACK_MODEL)


register_dataset("mnist1d", _build_mnist1d, "MNIST-1D (Greydanus 2020), generated locally: 40-value sequences, 10 classes",
                 default_model="cnn1d")
register_dataset("cifar10", _build_cifar10, "CIFAR-10 from a local copy (data_dir): 32x32 RGB images, 10 classes",
                 default_model="resnet20")
register_dataset("synthetic", _build_synthetic, "Gaussian features with logistic-regression labels (sizes and classes are options)",
                 default_model="logreg")
register_dataset("text", _build_text, "UTF-8 text as bytes for next-byte language modelling: your file or folder "
                 "(data_dir), else the standard library's sources", default_model="gpt")
register_dataset("wikitext2", _build_wikitext2, "WikiText-2 raw (wiki.train/valid/test.raw in data_dir) as bytes, "
                 "for language modelling", default_model="gpt")


def available_datasets() -> dict[str, str]:
    """Names accepted by :func:`build_dataset`, the default (``mnist1d``) first, with
    their one-line descriptions."""
    return _DATASETS.available()


def build_dataset(
    name: str = "mnist1d",
    *,
    data_dir: str | os.PathLike | None = None,
    cache_dir: str | os.PathLike | None = None,
    seed: int = 0,
    **options: Any,
) -> Dataset:
    """Build the data set ``name``.

    ``data_dir`` is where a local data set lives (``cifar10``); ``cache_dir`` is where
    generated data is cached (``mnist1d``; default :func:`default_cache_dir`);
    ``seed`` drives generated data (``synthetic``; ``mnist1d`` has its own fixed seed).
    ``options`` are data-set specific: ``synthetic`` accepts ``num_features`` (32),
    ``num_classes`` (10), ``num_train`` (4096) and ``num_test`` (1024); ``text``
    (``data_dir``: a UTF-8 file or folder, else the default corpus) accepts ``context``
    (128), ``test_fraction`` (0.1) and ``max_test_bytes`` (65536); ``wikitext2``
    accepts ``context`` and ``max_test_bytes`` (see :mod:`gossip.data.text`).
    """
    builder = _DATASETS.builder(name, options, fixed=_BUILDER_ARGS)
    seed = _check_seed(seed)
    data_path = Path(data_dir).expanduser() if data_dir is not None else None
    cache_path = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return builder(data_dir=data_path, cache_dir=cache_path, seed=seed, **options)
