"""The training loss and the evaluation of a run, for the task its data set declares.

- **classification** (one label per example): the loss is the cross-entropy of the
  logits ``(B, classes)``; an evaluation reports ``test_loss`` (nats per example) and
  ``test_acc`` of the averaged model, and ``node_acc_min/max/mean`` of the nodes' own.
- **lm** (next-token language modelling, a label per position): the loss is the
  cross-entropy of the logits ``(B, T, vocab)`` averaged over all ``B x T`` positions,
  i.e. nats per token; an evaluation reports ``test_loss`` (nats per token),
  ``test_bpb`` (bits per byte: ``test_loss / ln 2 / bytes_per_token``) and
  ``test_ppl`` (perplexity ``exp(test_loss)``, per token; per byte for byte-level
  text) of the averaged model, and ``node_bpb_min/max/mean`` of the nodes' own.
  Accuracy is not reported: next-byte accuracy is no measure anyone compares.

Every evaluation also reports ``consensus_distance``. :data:`METRICS` names the keys
per task, so that readers (analysis, race, TensorBoard) take them from here. With
``nodes=False`` (``gossip.train --no-node-eval``) the nodes' own models are not
evaluated and their ``node_*`` keys are left out; every other figure is the same, as
each model is evaluated on its own.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from gossip.data import CLASSIFICATION, LANGUAGE_MODEL, token_ids

__all__ = ["METRICS", "PRIMARY", "evaluate", "evaluate_vectorized", "global_mean", "loss_fn", "lm_loss",
           "classification_loss", "mean_over_nodes", "test_metrics"]

#: the keys of an eval record (besides step, epoch, time, train_loss), per task
METRICS = {
    CLASSIFICATION: ("test_loss", "test_acc", "node_acc_min", "node_acc_max", "node_acc_mean", "consensus_distance"),
    LANGUAGE_MODEL: ("test_loss", "test_bpb", "test_ppl", "node_bpb_min", "node_bpb_max", "node_bpb_mean",
                     "consensus_distance"),
}
#: the one figure a run is judged by, per task, and whether higher is better
PRIMARY = {CLASSIFICATION: ("test_acc", True), LANGUAGE_MODEL: ("test_bpb", False)}

#: examples per forward pass of an evaluation (windows for lm)
_EVAL_BATCH = {CLASSIFICATION: 1000, LANGUAGE_MODEL: 64}


def classification_loss(logits: Tensor, y: Tensor, reduction: str = "mean") -> Tensor:
    """Cross-entropy of the logits ``(B, classes)`` against the labels ``(B,)``."""
    return F.cross_entropy(logits, y, reduction=reduction)


def lm_loss(logits: Tensor, y: Tensor, reduction: str = "mean") -> Tensor:
    """Cross-entropy over every position: ``logits (B, T, V)``, targets ``(B, T)``."""
    if logits.dim() != 3 or tuple(logits.shape[:2]) != tuple(y.shape):
        raise ValueError(f"a language model must return logits (B, T, vocab) for targets (B, T) = "
                         f"{tuple(y.shape)}, got {tuple(logits.shape)}")
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1).long(), reduction=reduction)


def loss_fn(task: str) -> Callable[[Tensor, Tensor], Tensor]:
    """The training loss of ``task``: mean nats per example (classification) or per token (lm)."""
    return lm_loss if task == LANGUAGE_MODEL else classification_loss


@torch.no_grad()
def _scores(model, x: Tensor, y: Tensor, task: str, device) -> tuple[float, float]:
    """Mean loss per example/token and, for classification, accuracy (NaN for lm)."""
    was_training = model.training
    model.eval()
    loss_sum, correct, count = 0.0, 0, 0
    batch = _EVAL_BATCH[task]
    for s in range(0, len(y), batch):
        xb, yb = token_ids(x[s:s + batch].to(device)), y[s:s + batch].to(device)
        logits = model(xb)
        if task == LANGUAGE_MODEL:
            loss_sum += float(lm_loss(logits, yb, reduction="sum"))
            count += yb.numel()
        else:
            loss_sum += float(F.cross_entropy(logits, yb, reduction="sum"))
            correct += int((logits.argmax(1) == yb).sum())
            count += yb.shape[0]
    model.train(was_training)
    return loss_sum / count, (correct / count if task == CLASSIFICATION else math.nan)


def test_metrics(model, dataset, device="cpu") -> dict[str, float]:
    """``model``'s test metrics on ``dataset`` (its task's keys of :data:`METRICS`)."""
    loss, acc = _scores(model, dataset.x_test, dataset.y_test, dataset.task, device)
    if dataset.task == LANGUAGE_MODEL:
        return {"test_loss": loss, "test_bpb": loss / math.log(2) / dataset.bytes_per_token,
                "test_ppl": math.exp(min(loss, 700.0))}
    return {"test_loss": loss, "test_acc": acc}


@torch.no_grad()
def evaluate(gopt, models, dataset, device, comm, nodes: bool = True) -> dict[str, float]:
    """Test metrics of the averaged model xbar, and the spread of the nodes' own models
    over every rank, for the data set's task (the keys of :data:`METRICS`). With
    ``nodes=False`` the nodes' models are not evaluated (every rank must pass the same:
    the spread is gathered collectively) and ``node_*`` is left out."""
    X = gopt.flat.data
    xbar = gopt.average()
    own = X[0].clone()
    X[0].copy_(xbar)  # evaluate xbar in hosted model 0 (its buffers, e.g. BatchNorm statistics)
    try:
        out = test_metrics(models[0], dataset, device)
    finally:
        X[0].copy_(own)
    if not nodes:
        out["consensus_distance"] = gopt.consensus_distance()
        return out
    lm = dataset.task == LANGUAGE_MODEL
    per_node = []
    for m_ in models:
        loss, acc = _scores(m_, dataset.x_test, dataset.y_test, dataset.task, device)
        per_node.append([loss / math.log(2) / dataset.bytes_per_token if lm else acc])
    every = comm.all_gather(torch.tensor(per_node, dtype=torch.float64), record=False).reshape(-1)
    key = "node_bpb" if lm else "node_acc"
    out.update({f"{key}_min": float(every.min()), f"{key}_max": float(every.max()),
                f"{key}_mean": float(every.mean()), "consensus_distance": gopt.consensus_distance()})
    return out


@torch.no_grad()
def evaluate_vectorized(gopt, dataset, device, nodes: bool = True) -> dict[str, float]:
    """The batched simulation's evaluation (classification): xbar's test loss and
    accuracy, and the nodes' own accuracies over ``vectorized.eval_nodes(n)`` (every
    node up to ``vectorized.EVAL_NODES``, else that many evenly spaced), in batched
    calls. The keys of :data:`METRICS` for classification (less ``node_*`` with
    ``nodes=False``: xbar's figures are those of its own call either way)."""
    from gossip import vectorized  # the batched model's own forward

    x_test = dataset.x_test.to(device)
    y_test = dataset.y_test.to(device)
    X = gopt.flat.data
    xbar = gopt.average()
    loss, acc = vectorized.node_accuracies(gopt, x_test, y_test, xbar.unsqueeze(0))
    out = {"test_loss": float(loss[0]), "test_acc": float(acc[0])}
    if nodes:
        every = vectorized.node_accuracies(gopt, x_test, y_test, X[vectorized.eval_nodes(X.shape[0]).to(X.device)])[1]
        out.update({"node_acc_min": float(every.min()), "node_acc_max": float(every.max()),
                    "node_acc_mean": float(every.mean())})
    out["consensus_distance"] = gopt.consensus_distance()
    return out


def mean_over_nodes(comm, values: list[float]) -> float:
    """The mean of one value per hosted node over every node of the run."""
    t = torch.tensor([[v] for v in values], dtype=torch.float64)
    return float(comm.all_reduce(t, op="mean", record=False)[0, 0])


def global_mean(comm, value: float, distributed: bool) -> float:
    """The mean over the ranks of one value per rank (the value itself in one process)."""
    if not distributed:
        return value
    t = torch.tensor([[value]], dtype=torch.float64)
    return float(comm.all_reduce(t, op="mean", record=False)[0, 0])
