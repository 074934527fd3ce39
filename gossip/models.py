"""Models for the experiments, behind one registry.

:func:`build_model` turns a name into a fresh ``nn.Module``; :func:`available_models`
lists the names:

- ``cnn1d`` (default): a small 1-D CNN for MNIST-1D (inputs ``(C, L)``);
- ``mlp``: a multilayer perceptron on the flattened input;
- ``logreg``: multinomial logistic regression (one linear layer on the flattened input);
- ``resnet20``: the CIFAR-10 ResNet of He et al. (2016), for inputs ``(3, H, W)``;
- ``gpt``: a decoder-only transformer language model (:class:`GPT`), for token ids
  ``(context,)``, returning next-token logits ``(B, context, vocab)``;
- ``lstm``: a stacked-LSTM language model with a tied decoder (:class:`LSTMLM`), the
  shape of the PowerSGD paper's WikiText-2 model, scaled down.

Each model declares its task (:func:`model_task`): the first four classify
(``num_classes`` outputs per example), the last two model language (``num_classes``
is the vocabulary). The training loop refuses a model whose task is not the data set's.

Initialisation draws from PyTorch's global generator, so all nodes start from the
same point when the runtime seeds it before building (``torch.manual_seed(s)`` then
``build_model(...)``), or, leaving the global generator untouched, when
``build_model(..., seed=s)`` is given (the same weights as the first form).

The gossip runtime averages *parameters*. Normalisation layers with running
statistics (BatchNorm) keep them in *buffers*, which are not averaged: see
:class:`ResNet20`.
"""

from __future__ import annotations

from gossip._registry import Registry

import math
from typing import Any, Callable, Sequence

import torch
from torch import Tensor, nn

__all__ = [
    "CNN1d",
    "GPT",
    "LSTMLM",
    "LogReg",
    "MLP",
    "ResNet20",
    "available_models",
    "register_model",
    "build_model",
    "count_parameters",
    "model_options",
    "model_task",
]


def _check_shape(input_shape: Sequence[int], *, ndim: int | None, model: str, what: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(s) for s in input_shape)
    except TypeError:
        raise TypeError(f"input_shape must be a sequence of ints, got {input_shape!r}") from None
    if not shape or any(s < 1 for s in shape):
        raise ValueError(f"input_shape must be non-empty with positive sizes, got {shape}")
    if ndim is not None and len(shape) != ndim:
        raise ValueError(f"model {model!r} expects input_shape {what}, got {shape}")
    return shape


def _check_classes(num_classes: Any) -> int:
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
        raise ValueError(f"num_classes must be an integer >= 2, got {num_classes!r}")
    return num_classes


def count_parameters(model: nn.Module) -> int:
    """Number of scalar parameters (what the gossip runtime averages); buffers excluded."""
    return sum(p.numel() for p in model.parameters())


# --------------------------------------------------------------------------- cnn1d


class CNN1d(nn.Module):
    """A small 1-D CNN: three conv + ReLU layers, then two linear layers.

    ``(B, C, L) -> (B, num_classes)``. The three convolutions (kernel 5, stride 1, 2,
    2, ``channels`` wide) turn a length-40 signal into 10 positions of ``channels``
    features; the head keeps the positions (MNIST-1D digits differ by
    where their bumps are, which global pooling would blur). No normalisation layer:
    every state of the model is a parameter, which suits gossip averaging.
    """

    def __init__(self, in_channels: int, length: int, num_classes: int, channels: int = 64, hidden: int = 128):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv1d(in_channels, channels, kernel_size=5, padding=2),
            nn.ReLU(),
            nn.Conv1d(channels, channels, kernel_size=5, stride=2, padding=2),
            nn.ReLU(),
            nn.Conv1d(channels, channels, kernel_size=5, stride=2, padding=2),
            nn.ReLU(),
        )
        out_len = length
        for _ in range(2):  # each strided conv: ceil(L / 2)
            out_len = (out_len - 1) // 2 + 1
        self.head = nn.Sequential(
            nn.Flatten(),
            nn.Linear(channels * out_len, hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x))


def _build_cnn1d(input_shape: Sequence[int], num_classes: int, *, channels: int = 64, hidden: int = 128) -> nn.Module:
    c, length = _check_shape(input_shape, ndim=2, model="cnn1d", what="(channels, length)")
    for name, value in (("channels", channels), ("hidden", hidden)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return CNN1d(c, length, num_classes, channels=channels, hidden=hidden)


# --------------------------------------------------------------------------- mlp, logreg


class MLP(nn.Module):
    """Flatten, then ``Linear -> ReLU`` per hidden width, then a linear classifier."""

    def __init__(self, in_features: int, num_classes: int, hidden: Sequence[int] = (256, 256)):
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        width = in_features
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class LogReg(nn.Module):
    """Multinomial logistic regression: one linear layer on the flattened input (logits out)."""

    def __init__(self, in_features: int, num_classes: int):
        super().__init__()
        self.linear = nn.Linear(in_features, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x.flatten(1))


def _build_mlp(input_shape: Sequence[int], num_classes: int, *, hidden: Sequence[int] = (256, 256)) -> nn.Module:
    shape = _check_shape(input_shape, ndim=None, model="mlp", what="")
    widths = tuple(hidden)
    if any(isinstance(h, bool) or not isinstance(h, int) or h < 1 for h in widths):
        raise ValueError(f"hidden must be a sequence of positive integers, got {hidden!r}")
    return MLP(math.prod(shape), num_classes, widths)


def _build_logreg(input_shape: Sequence[int], num_classes: int) -> nn.Module:
    shape = _check_shape(input_shape, ndim=None, model="logreg", what="")
    return LogReg(math.prod(shape), num_classes)


# --------------------------------------------------------------------------- resnet20


def _norm_layer(norm: str, channels: int, groups: int) -> nn.Module:
    if norm == "batch":
        return nn.BatchNorm2d(channels)
    return nn.GroupNorm(min(groups, channels), channels)


class _BasicBlock(nn.Module):
    """Two 3x3 convolutions with a parameter-free shortcut (He et al.'s option A).

    When the block halves the resolution and doubles the width, the shortcut takes
    every other pixel and pads the new channels with zeros, which keeps the network at
    its published 0.27M parameters.
    """

    def __init__(self, c_in: int, c_out: int, stride: int, norm: str, groups: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.norm1 = _norm_layer(norm, c_out, groups)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, stride=1, padding=1, bias=False)
        self.norm2 = _norm_layer(norm, c_out, groups)
        self.stride = stride
        self.extra_channels = c_out - c_in

    def _shortcut(self, x: Tensor) -> Tensor:
        if self.stride != 1:
            x = x[:, :, ::self.stride, ::self.stride]
        if self.extra_channels:
            half = self.extra_channels // 2
            x = nn.functional.pad(x, (0, 0, 0, 0, half, self.extra_channels - half))
        return x

    def forward(self, x: Tensor) -> Tensor:
        out = torch.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return torch.relu(out + self._shortcut(x))


class ResNet20(nn.Module):
    """ResNet-20 for CIFAR-10 (He et al. 2016, Sec. 4.2): 3 stages x 3 basic blocks.

    A 3x3 convolution to 16 channels, then stages of 16, 32 and 64 channels (the last
    two start with stride 2), global average pooling and a linear classifier: about
    0.27M parameters for 10 classes. Convolutions use Kaiming-normal initialisation.

    ``norm="batch"`` (default) uses BatchNorm. Its running mean and variance are
    *buffers*, not parameters: the gossip runtime mixes parameters only, so every
    node keeps its own running statistics, estimated on its own data (with a
    ``sorted`` partition they differ a lot between nodes). Evaluate the averaged model
    with care: recompute the statistics on data, or use the statistics of one node.
    ``norm="group"`` uses GroupNorm (``groups`` groups per layer, default 2), which
    has no buffers, so the whole model state is averaged.
    """

    def __init__(self, in_channels: int = 3, num_classes: int = 10, *, norm: str = "batch", groups: int = 2):
        super().__init__()
        self.stem = nn.Conv2d(in_channels, 16, 3, padding=1, bias=False)
        self.stem_norm = _norm_layer(norm, 16, groups)
        blocks: list[nn.Module] = []
        c_in = 16
        for stage, width in enumerate((16, 32, 64)):
            for i in range(3):
                stride = 2 if stage > 0 and i == 0 else 1
                blocks.append(_BasicBlock(c_in, width, stride, norm, groups))
                c_in = width
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(64, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: Tensor) -> Tensor:
        out = torch.relu(self.stem_norm(self.stem(x)))
        out = self.blocks(out)
        return self.fc(out.mean(dim=(2, 3)))


def _build_resnet20(input_shape: Sequence[int], num_classes: int, *, norm: str = "batch", groups: int = 2) -> nn.Module:
    c, _, _ = _check_shape(input_shape, ndim=3, model="resnet20", what="(channels, height, width)")
    if norm not in ("batch", "group"):
        raise ValueError(f"norm must be 'batch' or 'group', got {norm!r}")
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1 or 16 % groups:
        raise ValueError(f"groups must be a positive integer dividing 16, got {groups!r}")
    return ResNet20(c, num_classes, norm=norm, groups=groups)


# --------------------------------------------------------------------------- language models


def _check_positive(**values: Any) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


class _Block(nn.Module):
    """One pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        # (B, T, C) -> (B, heads, T, C / heads)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A decoder-only transformer (Radford et al. 2019, "Language Models are Unsupervised
    Multitask Learners"): token and learned position embeddings, ``layers`` pre-LayerNorm
    blocks of causal multi-head self-attention (``scaled_dot_product_attention``) and a
    4x-wide GELU MLP, a final LayerNorm, and a decoder tied to the token embedding.

    ``(B, T)`` integer token ids (any integer dtype, T <= ``context``) ->
    ``(B, T, vocab)`` logits; position ``t``'s logits predict token ``t + 1``. Weights
    are drawn N(0, 0.02) (the residual projections scaled by 1/sqrt(2 layers)), biases
    zero. No dropout: it would draw from the global generator during training, and the
    simulation (one process, nodes in turn) and torchrun (one process per node) would
    then draw differently.
    """

    def __init__(self, vocab: int, context: int, *, layers: int = 4, width: int = 128, heads: int = 4):
        super().__init__()
        _check_positive(vocab=vocab, context=context, layers=layers, width=width, heads=heads)
        if width % heads:
            raise ValueError(f"width must be a multiple of heads, got width {width} and heads {heads}")
        self.context = context
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(_Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        for name, p in self.named_parameters():
            if name.endswith(".bias"):
                nn.init.zeros_(p)
            elif p.dim() >= 2:  # LayerNorm weights keep their ones
                residual = name.endswith(("proj.weight", "mlp.2.weight"))
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * layers) if residual else 0.02)

    def forward(self, idx: Tensor) -> Tensor:
        t = idx.shape[1]
        if t > self.context:
            raise ValueError(f"GPT got sequences of {t} tokens; its context is {self.context}")
        x = self.tok(idx.long()) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.tok.weight.t()  # the decoder is the embedding, tied


class LSTMLM(nn.Module):
    """A stacked-LSTM language model with tied input and output embeddings, the shape of
    the model of Vogels et al., "PowerSGD" (arXiv:1905.13727), Sec. 5 / Table 3 (3 layers
    of 650 units on WikiText-2), scaled down: an embedding of ``width``, ``layers``
    LSTM layers of ``width`` units, a decoder whose weight is the embedding's.

    ``(B, T)`` integer token ids -> ``(B, T, vocab)`` logits. Each window starts from a
    zero state (no state carried between batches, so batches stay independent draws
    and a resume needs nothing but the parameters). No dropout (see :class:`GPT`).
    """

    def __init__(self, vocab: int, *, layers: int = 3, width: int = 192):
        super().__init__()
        _check_positive(vocab=vocab, layers=layers, width=width)
        self.embed = nn.Embedding(vocab, width)
        self.lstm = nn.LSTM(width, width, num_layers=layers, batch_first=True)
        self.decoder_bias = nn.Parameter(torch.zeros(vocab))
        nn.init.uniform_(self.embed.weight, -0.1, 0.1)

    def forward(self, idx: Tensor) -> Tensor:
        out, _ = self.lstm(self.embed(idx.long()))
        return out @ self.embed.weight.t() + self.decoder_bias


def _lm_shape(input_shape: Sequence[int], model: str) -> int:
    (context,) = _check_shape(input_shape, ndim=1, model=model, what="(context,) of token ids")
    return context


def _build_gpt(input_shape: Sequence[int], num_classes: int, *, layers: int = 4, width: int = 128, heads: int = 4,
               context: int | None = None) -> nn.Module:
    window = _lm_shape(input_shape, "gpt")
    if context is None:
        context = window
    _check_positive(context=context)
    if context < window:
        raise ValueError(f"context {context} is shorter than the data's windows of {window} tokens")
    return GPT(num_classes, context, layers=layers, width=width, heads=heads)


def _build_lstm(input_shape: Sequence[int], num_classes: int, *, layers: int = 3, width: int = 192) -> nn.Module:
    _lm_shape(input_shape, "lstm")
    return LSTMLM(num_classes, layers=layers, width=width)


# --------------------------------------------------------------------------- registry

_MODELS: Registry[Callable[..., nn.Module]] = Registry("model")
#: the models registered for next-token language modelling (``task="lm"``)
_LM_MODELS: set[str] = set()


def model_task(name: str) -> str:
    """``"lm"`` for the language models, ``"classification"`` for the others."""
    _MODELS.get(name)  # unknown names: one line listing the known ones
    return "lm" if name in _LM_MODELS else "classification"


def model_options(name: str) -> tuple[str, ...]:
    """The options :func:`build_model` accepts for ``name``."""
    return tuple(_MODELS.parameters(name))


def register_model(name: str, builder: Callable[..., nn.Module], summary: str, *, task: str = "classification") -> None:
    """Make ``builder(input_shape, num_classes, **options)`` buildable as ``name``; its
    keyword-only parameters are the options :func:`build_model` accepts. ``task``:
    ``"classification"`` (logits ``(B, classes)``) or ``"lm"`` (``(B, T, vocab)``)."""
    if task not in ("classification", "lm"):
        raise ValueError(f"task must be 'classification' or 'lm', got {task!r}")
    _MODELS.register(name, builder, summary)
    if task == "lm":
        _LM_MODELS.add(name)


register_model("cnn1d", _build_cnn1d, "1-D CNN: three conv + ReLU layers, two linear layers (inputs (channels, length))")
register_model("mlp", _build_mlp, "multilayer perceptron on the flattened input, ReLU between hidden widths")
register_model("logreg", _build_logreg, "multinomial logistic regression: one linear layer on the flattened input")
register_model("resnet20", _build_resnet20, "ResNet-20 for 32x32 images (He et al. 2016): 3 stages x 3 basic blocks")
register_model("gpt", _build_gpt, "decoder-only transformer: pre-LayerNorm, causal attention, learned positions, "
               "tied embeddings", task="lm")
register_model("lstm", _build_lstm, "stacked-LSTM language model with a tied decoder (PowerSGD's LSTM, scaled down)",
               task="lm")


def available_models() -> dict[str, str]:
    """Names accepted by :func:`build_model`, the default (``cnn1d``) first, with their
    one-line descriptions."""
    return _MODELS.available()


def build_model(
    name: str = "cnn1d",
    *,
    input_shape: Sequence[int],
    num_classes: int,
    seed: int | None = None,
    **options: Any,
) -> nn.Module:
    """A freshly initialised model ``name`` for inputs ``(B, *input_shape)``, returning logits.

    Without ``seed`` the initialisation draws from the global generator (seed it
    first for identical replicas); with ``seed`` it draws from a forked global
    generator seeded with it, which leaves the caller's generator as it was.
    ``options`` are model specific: ``cnn1d``: ``channels`` (64), ``hidden`` (128);
    ``mlp``: ``hidden`` ((256, 256)); ``resnet20``: ``norm`` ("batch" or "group"),
    ``groups`` (2); ``gpt``: ``layers`` (4), ``width`` (128), ``heads`` (4), ``context``
    (the data's window, ``input_shape[0]``); ``lstm``: ``layers`` (3), ``width`` (192).
    For ``gpt`` and ``lstm``, ``input_shape`` is ``(context,)`` and ``num_classes`` the
    vocabulary.
    """
    builder = _MODELS.builder(name, options)
    num_classes = _check_classes(num_classes)
    if seed is None:
        return builder(input_shape, num_classes, **options)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ValueError(f"seed must be an integer in [0, 2**63), got {seed!r}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return builder(input_shape, num_classes, **options)
