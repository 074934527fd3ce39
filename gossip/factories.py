"""The user's own model and data on the CLI: ``--model pkg.mod:fn``, ``--data pkg.mod:fn``.

A spec ``module.path:callable`` names a function to import (the module must be on
``PYTHONPATH``, or in the current directory). Built-in names keep working; a name is
a factory spec exactly when it contains ``:``.

Data factory
    ``fn(seed: int) -> gossip.data.Dataset`` or ``((x_train, y_train), (x_test, y_test))``
    with float inputs ``x`` shaped ``(N, *input_shape)`` and integer class labels
    ``y`` shaped ``(N,)`` in ``[0, num_classes)`` (``num_classes`` is one more than
    the largest label), or ``(train_set, test_set)``: two map-style
    ``torch.utils.data.Dataset`` whose items are ``(x, label)`` pairs (a
    ``TensorDataset``, a torchvision data set with a ``ToTensor`` transform), read
    once into memory. The run partitions the training set over the nodes as for the
    built-in data sets (``--partition``); the test set evaluates the averaged model.
Model factory
    ``fn(input_shape: tuple[int, ...], num_classes: int) -> torch.nn.Module`` returning
    logits ``(B, num_classes)`` for inputs ``(B, *input_shape)``; on a language-model
    data set (``--data text``), logits ``(B, T, num_classes)`` for integer token ids
    ``(B, T)`` with ``input_shape == (T,)`` and ``num_classes`` the vocabulary. Every node calls it
    with the global generator seeded alike, so the nodes start from one x_1.

Whatever goes wrong (the module is missing, the name is not in it, the call fails or
returns something else) is a :class:`FactoryError` of one line that says what was
expected.
"""

from __future__ import annotations

import importlib
import re
from typing import Any, Callable

__all__ = ["FactoryError", "is_factory", "load", "dataset_from", "model_from", "check_model_output"]

_SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
DATA_SIGNATURE = ("fn(seed) -> gossip.data.Dataset, ((x_train, y_train), (x_test, y_test)) "
                  "or (train_set, test_set) of torch Datasets of (x, label)")
MODEL_SIGNATURE = "fn(input_shape, num_classes) -> torch.nn.Module"


class FactoryError(ValueError):
    """A user factory that cannot be imported or returns the wrong thing."""


def is_factory(name: Any) -> bool:
    """Whether ``name`` names a user's callable (``module:function``) rather than a built-in."""
    return isinstance(name, str) and ":" in name


def load(spec: str, flag: str, signature: str) -> Callable[..., Any]:
    """Import ``module.path:callable`` (attributes may be dotted: ``mod:Class.make``)."""
    if not _SPEC.match(spec):
        raise FactoryError(f"{flag} {spec!r}: expected module.path:function, a {signature}")
    mod_name, _, attr = spec.partition(":")
    try:
        obj: Any = importlib.import_module(mod_name)
    except ImportError as e:
        raise FactoryError(f"{flag} {spec!r}: cannot import {mod_name!r} ({e}); is it on PYTHONPATH?") from None
    except Exception as e:  # the user's module raised while importing
        raise FactoryError(f"{flag} {spec!r}: importing {mod_name!r} raised {type(e).__name__}: {e}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise FactoryError(f"{flag} {spec!r}: {mod_name!r} has no {attr!r}; expected a {signature}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise FactoryError(f"{flag} {spec!r}: {attr!r} is a {type(obj).__name__}, not callable; expected a {signature}")
    return obj


def _call(fn: Callable[..., Any], spec: str, flag: str, signature: str, **kwargs: Any) -> Any:
    try:
        return fn(**kwargs)
    except Exception as e:
        first = str(e).splitlines()[0] if str(e) else ""
        raise FactoryError(f"{flag} {spec!r} raised {type(e).__name__}: {first} (expected a {signature})") from None


def dataset_from(spec: str, seed: int):
    """The user's data set as a :class:`gossip.data.Dataset`."""
    import torch

    from gossip import data

    got = _call(load(spec, "--data", DATA_SIGNATURE), spec, "--data", DATA_SIGNATURE, seed=seed)
    if isinstance(got, data.Dataset):
        return got
    if isinstance(got, (tuple, list)) and len(got) == 2 and all(
            isinstance(d, torch.utils.data.Dataset) for d in got):
        got = tuple(_materialise(d, spec, split) for d, split in zip(got, ("train", "test")))
    bad = FactoryError(f"--data {spec!r} returned {_describe(got)}; expected {DATA_SIGNATURE}, "
                       f"with float x shaped (N, ...) and integer labels y shaped (N,)")
    try:
        (xtr, ytr), (xte, yte) = got
    except (TypeError, ValueError):
        raise bad from None
    if not all(isinstance(t, torch.Tensor) for t in (xtr, ytr, xte, yte)):
        raise bad
    if not (xtr.is_floating_point() and xte.is_floating_point()) or ytr.is_floating_point() or yte.is_floating_point():
        raise bad
    if ytr.dim() != 1 or yte.dim() != 1 or len(ytr) != len(xtr) or len(yte) != len(xte) or len(ytr) == 0:
        raise bad
    if xtr.shape[1:] != xte.shape[1:]:
        raise FactoryError(f"--data {spec!r}: train inputs are shaped {tuple(xtr.shape[1:])}, "
                           f"test inputs {tuple(xte.shape[1:])}; expected the same shape")
    lo = int(min(ytr.min(), yte.min())) if len(yte) else int(ytr.min())
    if lo < 0:
        raise FactoryError(f"--data {spec!r}: labels must be class indices >= 0, got {lo}")
    classes = max(2, int(max(ytr.max(), yte.max() if len(yte) else ytr.max())) + 1)
    try:
        return data.Dataset(name=spec, x_train=xtr.float(), y_train=ytr.long(), x_test=xte.float(),
                            y_test=yte.long(), num_classes=classes, input_shape=tuple(xtr.shape[1:]))
    except (ValueError, TypeError) as e:
        raise FactoryError(f"--data {spec!r}: {e}") from None


def _materialise(ds: Any, spec: str, split: str):
    """A map-style torch Dataset of ``(x, label)`` items as the tensors ``(x, y)``."""
    import torch

    try:
        items = [ds[i] for i in range(len(ds))]
        xs = torch.stack([torch.as_tensor(item[0]) for item in items])
        ys = torch.as_tensor([int(item[1]) for item in items], dtype=torch.int64)
    except Exception as e:  # no len, items not (x, label), inputs of different shapes
        first = str(e).splitlines()[0] if str(e) else ""
        raise FactoryError(f"--data {spec!r}: the {split} set's items are not (x, label) pairs of one shape "
                           f"({type(e).__name__}: {first}); expected {DATA_SIGNATURE}") from None
    return xs, ys


def model_from(spec: str, input_shape: tuple[int, ...], num_classes: int):
    """The user's model for ``input_shape`` and ``num_classes``, checked on one input."""
    import torch
    from torch import nn

    model = _call(load(spec, "--model", MODEL_SIGNATURE), spec, "--model", MODEL_SIGNATURE,
                  input_shape=tuple(input_shape), num_classes=int(num_classes))
    if not isinstance(model, nn.Module):
        raise FactoryError(f"--model {spec!r} returned {_describe(model)}; expected a {MODEL_SIGNATURE}")
    if not any(p.requires_grad for p in model.parameters()):
        raise FactoryError(f"--model {spec!r}: the model has no trainable parameters")
    return model


def check_model_output(model, spec: str, input_shape, num_classes: int, device, *, task: str = "classification") -> None:
    """One forward pass on zeros: logits of shape (B, num_classes), or (B, T, vocab) for a
    language-model data set (``task="lm"``, token ids in), or one line saying so."""
    import torch

    from gossip.data import TOKEN_DTYPE

    lm = task == "lm"
    training = model.training
    model.eval()  # no batch-norm statistics change: the check leaves x_1 as it was
    with torch.no_grad():
        try:  # token ids in the dtype training and evaluation give the model (gossip.data.token_ids)
            zeros = torch.zeros(2, *input_shape, device=device, dtype=TOKEN_DTYPE if lm else torch.float32)
            out = model(zeros)
        except Exception as e:
            first = str(e).splitlines()[0] if str(e) else ""
            what = "token ids" if lm else "inputs"
            raise FactoryError(f"--model {spec!r} fails on {what} shaped (B, {', '.join(map(str, input_shape))}): "
                               f"{type(e).__name__}: {first}") from None
        finally:
            model.train(training)
    want = (2, *input_shape, num_classes) if lm else (2, num_classes)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != want:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise FactoryError(f"--model {spec!r} returned outputs {got} for 2 inputs; expected logits "
                           f"({', '.join(map(str, want))})")


def _describe(obj: Any) -> str:
    if isinstance(obj, tuple):
        return f"a tuple of {len(obj)}"
    return f"a {type(obj).__name__}"
