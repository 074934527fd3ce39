"""The training run behind ``gossip.train``: build, train, evaluate, log, checkpoint.

One code path serves both modes: under torchrun a process hosts its own rank
(``m = 1``); with ``--simulate N`` one process hosts all N nodes (``m = N``). Either way
the hosted nodes' parameters are the rows of one ``(m, d)`` buffer and every node
trains on its own shard.

Files written to the run directory (see README "Run directory"):
``config.json`` at the start, ``metrics-rank<k>.jsonl`` (one per node), checkpoints,
and ``summary.json`` at the end.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import math
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import topologies
from gossip import algorithms, checkpoint, compress, data, models
from gossip._atomic import write_atomically
from gossip.config import TrainConfig
from gossip.runtime import GossipOptimizer

__all__ = ["RunError", "Diverged", "run", "FINGERPRINT_KEYS"]


class RunError(RuntimeError):
    """A failure the user can act on (bad data dir, damaged checkpoint, dead peer)."""

    exit_code = 2


class Diverged(RunError):
    """Training produced a non-finite loss or model: an outcome, recorded in summary.json."""

    exit_code = 1


#: config keys whose change makes a checkpoint unusable for an exact continuation
FINGERPRINT_KEYS = (
    "algo", "compressor_spec", "topology", "degree", "rows", "cols", "weights", "lazy",
    "model_name", "data", "partition", "epochs", "batch_size", "lr", "lr_schedule",
    "momentum", "local_momentum", "weight_decay", "seed", "merge", "merge_max_groups", "merge_alpha",
    "algo_options",
)


# --------------------------------------------------------------------------------------
# set-up
# --------------------------------------------------------------------------------------
@dataclass
class _Env:
    world_size: int
    distributed: bool
    rank: int  # this process's rank (0 in the simulation)


def _detect_env(cfg: TrainConfig) -> _Env:
    under_torchrun = "WORLD_SIZE" in os.environ and "RANK" in os.environ
    if cfg.simulate is not None:
        if under_torchrun and int(os.environ["WORLD_SIZE"]) > 1:
            raise RunError("--simulate runs all nodes in one process: do not combine it with torchrun")
        return _Env(world_size=cfg.simulate, distributed=False, rank=0)
    if under_torchrun:
        return _Env(int(os.environ["WORLD_SIZE"]), True, int(os.environ["RANK"]))
    return _Env(world_size=1, distributed=False, rank=0)


def _build_topology(cfg: TrainConfig, n: int):
    if not algorithms.is_decentralized(cfg.algo):
        return None
    if n < 2:
        raise RunError(
            f"--algo {cfg.algo} is decentralized and needs at least 2 nodes, got 1 process; "
            f"run under torchrun --nproc_per_node N or with --simulate N (or use --algo allreduce)"
        )
    params: dict[str, Any] = {}
    for key in ("degree", "rows", "cols", "weights"):
        if getattr(cfg, key) is not None:
            params[key] = getattr(cfg, key)
    if cfg.lazy:
        params["lazy"] = True
    if cfg.topology == "expander":
        params.setdefault("seed", cfg.seed)
    try:
        return topologies.build(cfg.topology, n, **params)
    except (ValueError, TypeError) as e:
        raise RunError(f"--topology {cfg.topology} with world size {n}: {e}") from None


def _build_algorithm(cfg: TrainConfig, comm, model):
    """Registry lookup plus what some algorithms need to know of the model."""
    fields = {f.name for f in dataclasses.fields(algorithms.config_class(cfg.algo))}
    opts: dict[str, Any] = {"seed": cfg.seed, **dict(cfg.algo_options)}  # --algo-opt: checked by TrainConfig
    if "compressor" in fields and cfg.compressor_spec is not None:
        opts["compressor"] = cfg.compressor_spec
    if "momentum" in fields and cfg.momentum is not None:
        opts["momentum"] = cfg.momentum
    params = list(model.parameters())
    if cfg.merge is not None:  # MergeComp schedules the efsgd family group by group
        return _build_mergecomp(cfg, comm, params, fields)
    if "shapes" in fields:  # PowerSGD: which tensors are matrices
        opts["shapes"] = tuple(tuple(p.shape) for p in params)
    if "offsets" in fields:  # blockwise sign: one block per tensor
        offs, o = [], 0
        for p in params:
            offs.append(o)
            o += p.numel()
        opts["offsets"] = tuple(offs)
    try:
        return algorithms.build(cfg.algo, comm, **opts)
    except (ValueError, TypeError) as e:
        raise RunError(f"--algo {cfg.algo}: {e}") from None


def _build_mergecomp(cfg: TrainConfig, comm, params, fields):
    from gossip.schedule import MergeComp, MergeCompConfig

    defaults = {f.name: f.default for f in dataclasses.fields(algorithms.config_class(cfg.algo))}
    spec = cfg.compressor_spec if "compressor" in fields else "blocksign"  # efblocksgd(m): per tensor
    momentum = cfg.momentum if cfg.momentum is not None else defaults.get("momentum", 0.0)
    try:
        config = MergeCompConfig(
            shapes=tuple(tuple(p.shape) for p in params), compressor=spec, momentum=momentum,
            seed=cfg.seed, merge=cfg.merge, max_groups=cfg.merge_max_groups, alpha=cfg.merge_alpha,
        )
        return MergeComp(config, comm)
    except (ValueError, TypeError) as e:
        raise RunError(f"--merge {cfg.merge}: {e}") from None


def _device(cfg: TrainConfig, env: _Env) -> torch.device:
    if cfg.device == "cpu":
        return torch.device("cpu")
    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RunError("--device cuda: no CUDA device is available; use --device cpu or auto")
        local = int(os.environ.get("LOCAL_RANK", "0")) if env.distributed else 0
        return torch.device("cuda", local)
    return torch.device("cpu")


def _lr_at(cfg: TrainConfig, step: int, total: int) -> float:
    if cfg.lr_schedule == "cosine":
        return 0.5 * cfg.lr * (1.0 + math.cos(math.pi * step / max(1, total)))
    if cfg.lr_schedule == "step":
        return cfg.lr * (0.1 ** ((step >= 0.5 * total) + (step >= 0.75 * total)))
    return cfg.lr


def _default_out(cfg: TrainConfig) -> str:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    topo = cfg.topology if algorithms.is_decentralized(cfg.algo) else "allreduce"
    name = f"{cfg.algo}-{topo}" if topo != cfg.algo else cfg.algo
    return str(Path("runs") / f"{stamp}-{name}")


# --------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------
def run(cfg: TrainConfig) -> dict | None:
    """Train as configured; returns the summary on rank 0 (None elsewhere)."""
    env = _detect_env(cfg)
    topo = _build_topology(cfg, env.world_size)  # pure: fails the same way on every rank
    device = _device(cfg, env)
    if cfg.resume is not None and not Path(cfg.resume).is_dir():
        raise RunError(f"--resume {cfg.resume!r}: no such run directory")
    try:
        dataset = data.build_dataset(cfg.data, data_dir=cfg.data_dir, seed=cfg.seed)
    except data.DataError as e:
        raise RunError(str(e)) from None

    from gossip import comm as gcomm

    import torch.distributed as dist

    try:
        if env.distributed:
            gcomm.init_from_env(
                backend="nccl" if device.type == "cuda" else "gloo", timeout=cfg.timeout, device=device
            )
            comm = gcomm.DistCommunicator(topo, device=device, timeout=cfg.timeout)
        else:
            comm = gcomm.SimulatedCommunicator(topo, world_size=env.world_size, device=device)
        if cfg.emulate_latency:
            from gossip.comm.latency import LatencyCommunicator

            comm = LatencyCommunicator(comm, cfg.emulate_latency / 1000.0)
        return _train(cfg, env, topo, device, dataset, comm)
    except gcomm.PeerError as e:
        raise RunError(str(e)) from None
    finally:
        if env.distributed and dist.is_initialized():
            dist.destroy_process_group()


def _agree_out_dir(cfg: TrainConfig, env: _Env, comm) -> Path:
    out = cfg.resume or cfg.out or (_default_out(cfg) if env.rank == 0 else None)
    if env.distributed:
        import torch.distributed as dist

        box = [out]
        dist.broadcast_object_list(box, src=0)
        out = box[0]
    return Path(out)


def _train(cfg, env, topo, device, dataset, comm) -> dict | None:
    n = env.world_size
    nodes = [int(i) for i in comm.nodes]
    is_main = env.rank == 0
    out = _agree_out_dir(cfg, env, comm)
    out.mkdir(parents=True, exist_ok=True)
    cfg_dict = cfg.to_dict()
    fingerprint = checkpoint.config_fingerprint(cfg_dict, FINGERPRINT_KEYS)

    # Step 1: identical x_1 on every node, one model and local optimizer per hosted node
    mdl = []
    for _ in nodes:
        torch.manual_seed(cfg.seed)
        mdl.append(
            models.build_model(cfg.model_name, input_shape=dataset.input_shape, num_classes=dataset.num_classes).to(device)
        )
    # algorithms with their own momentum get it; the local optimizer then has none
    opts = [
        torch.optim.SGD(m.parameters(), lr=cfg.lr, momentum=cfg.local_momentum, weight_decay=cfg.weight_decay)
        for m in mdl
    ]
    algo = _build_algorithm(cfg, comm, mdl[0])
    gopt = GossipOptimizer(mdl, opts, algo)
    dim = gopt.flat.dim

    # Step 2: each node's shard of the training data
    shards = data.partition(dataset.y_train, n, scheme=cfg.partition, seed=cfg.seed)
    loaders = [
        data.ShardLoader(dataset.x_train, dataset.y_train, shards[i], cfg.batch_size, seed=cfg.seed, node=i, device=device)
        for i in nodes
    ]
    spe = loaders[0].steps_per_epoch
    total = cfg.epochs * spe  # the learning-rate schedule spans the whole run
    stop = total if cfg.max_steps is None else min(total, cfg.max_steps)
    ledger = comm.ledger

    step, elapsed, losses = 0, 0.0, None
    if cfg.resume is not None:
        step, elapsed, losses = _resume(cfg, env, out, fingerprint, gopt, loaders, ledger, comm)
    if is_main and step == 0:
        _write_json(out / "config.json", {
            **cfg_dict, "world_size": n, "params": dim, "mode": "torchrun" if env.distributed else "simulate",
            "hostname": socket.gethostname(), "torch": torch.__version__,
            "bits": _bits(cfg.compressor_spec),
            "compressor_payload_bytes": _payload_bytes(algo, dim),
        })
    metrics = [_Metrics(out / f"metrics-rank{i}.jsonl", keep_until=step if cfg.resume else None) for i in nodes]

    # full-precision D-PSGD's bytes per node per step on this topology, for the ratio
    dpsgd_bytes = _dpsgd_bytes(topo if topo is not None else _reference_topology(cfg, n), dim)
    header = _header(cfg, n, dim, algo, dpsgd_bytes, env)
    if is_main:
        print(header, flush=True)

    bar = _progress(cfg, is_main, stop, step)
    if hasattr(algo, "on_event") and is_main:  # MergeComp's decisions, as they happen
        algo.on_event = lambda line: bar.write(line) if bar is not None else print(line, flush=True)
        if step > 0 and algo.state.phase == "done" and cfg.merge not in ("layer", "whole"):
            algo.on_event(f"mergecomp: partition {algo.partition} restored from the checkpoint")
    t0 = time.perf_counter() - elapsed  # wall time of the run, across resumes
    last_eval: dict[str, Any] = {}
    last_loss = [float("nan")] * len(nodes)
    log_losses: list[list[float]] = [[] for _ in nodes]  # since the last metrics record
    epoch_losses: list[list[float]] = [[] for _ in nodes]  # since the start of the epoch
    if losses is not None:  # resumed: the partial records of the interrupted epoch
        log_losses, epoch_losses = losses["log_losses"], losses["epoch_losses"]
    try:
        while step < stop:
            epoch = step // spe
            lr = _lr_at(cfg, step, total)
            for o in opts:
                for g in o.param_groups:
                    g["lr"] = lr
            if hasattr(algo, "set_lr"):
                algo.set_lr(lr)  # algorithms that rescale their error memories by eta_{t-1}/eta_t
            gopt.zero_grad()
            with ledger.phase("compute"):
                for r, (m_, ld) in enumerate(zip(mdl, loaders)):
                    xb, yb = ld.next_batch()
                    loss = F.cross_entropy(m_(xb), yb)
                    loss.backward()
                    last_loss[r] = float(loss.detach())
                    log_losses[r].append(last_loss[r])
                    epoch_losses[r].append(last_loss[r])
            bad = [i for i, v in zip(nodes, last_loss) if not math.isfinite(v)]
            if bad:
                raise Diverged(f"training diverged at step {step + 1}: non-finite loss on node(s) {bad}")
            try:
                gopt.step()
            except ValueError as e:
                if "non-finite" not in str(e) and "too large" not in str(e):
                    raise
                raise Diverged(f"training diverged at step {step + 1}: {e}") from None
            ledger.step()
            step += 1
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{sum(last_loss) / len(last_loss):.4f}", refresh=False)
            if step % cfg.log_every == 0 or step == stop:
                snap = ledger.as_dict(detail=True)
                for r, i in enumerate(nodes):
                    metrics[r].write({
                        "kind": "train", "step": step, "epoch": step / spe, "time": time.perf_counter() - t0,
                        "loss": sum(log_losses[r]) / len(log_losses[r]), "lr": lr,
                        **_node_ledger(snap, r, len(nodes)),
                    })
                    log_losses[r] = []
            if step % spe == 0 or step == stop:
                last_eval = _evaluate(gopt, mdl, dataset, device, comm, step, spe)
                # mean training loss of the nodes over the epoch's steps
                last_eval["train_loss"] = _mean_over_nodes(comm, [sum(v) / max(1, len(v)) for v in epoch_losses])
                epoch_losses = [[] for _ in nodes]
                for r in range(len(nodes)):
                    metrics[r].write({"kind": "eval", "step": step, "epoch": step / spe, "time": time.perf_counter() - t0, **last_eval})
                if is_main:
                    line = _epoch_line(step / spe, cfg.epochs, last_eval, ledger, dpsgd_bytes, n, step)
                    (bar.write(line) if bar is not None else print(line, flush=True))
            if cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and step < stop:
                _save(out, env, step, fingerprint, gopt, loaders, ledger, n, nodes, cfg_dict, time.perf_counter() - t0,
                      {"epoch_losses": epoch_losses, "log_losses": log_losses})
    except Diverged as e:
        if is_main:
            _write_json(out / "summary.json", {
                "algo": cfg.algo, "topology": cfg.topology if topo is not None else None, "world_size": n,
                "compressor": cfg.compressor_spec, "bits": _bits(cfg.compressor_spec), "epochs": cfg.epochs,
                "steps": step, "diverged": True, "reason": str(e),
                "final_train_loss": None, "final_test_loss": None, "final_test_acc": None,
                "consensus_distance": None, "wall_time_s": time.perf_counter() - t0,
            })
        raise
    finally:
        if bar is not None:
            bar.close()
        for m_ in metrics:
            m_.close()
    _save(out, env, step, fingerprint, gopt, loaders, ledger, n, nodes, cfg_dict, time.perf_counter() - t0,
                      {"epoch_losses": epoch_losses, "log_losses": log_losses})
    wall = time.perf_counter() - t0
    snap = ledger.as_dict()
    summary = {
        "algo": cfg.algo,
        "topology": cfg.topology if topo is not None else None,
        "world_size": n,
        "compressor": cfg.compressor_spec,
        "bits": _bits(cfg.compressor_spec),
        "model": cfg.model_name,
        "data": cfg.data,
        "params": dim,
        "epochs": cfg.epochs,
        "steps": step,
        "final_train_loss": last_eval.get("train_loss"),
        "final_test_loss": last_eval.get("test_loss"),
        "final_test_acc": last_eval.get("test_acc"),
        "consensus_distance": last_eval.get("consensus_distance"),
        "bytes_sent_per_node_per_step": _bytes_per_node_step(snap, n, step, env),
        "bytes_ratio_to_dpsgd": (_bytes_per_node_step(snap, n, step, env) / dpsgd_bytes) if dpsgd_bytes else None,
        "time_split_s": {k: snap["time"].get(k, 0.0) for k in ("compute", "compress", "communicate")},
        "wall_time_s": wall,
        "mode": "torchrun" if env.distributed else "simulate",
        "diverged": False,
        "latency_ms": cfg.emulate_latency,
        "latency_mode": "emulated" if cfg.emulate_latency else None,
        "merge": algo.report() if hasattr(algo, "report") else None,
    }
    summary["bytes_sent_per_node_per_step"] = _global_mean(comm, summary["bytes_sent_per_node_per_step"], env)
    if is_main:
        _write_json(out / "summary.json", summary)
        print(f"run directory: {out}", flush=True)
        return summary
    return None


# --------------------------------------------------------------------------------------
# evaluation
# --------------------------------------------------------------------------------------
@torch.no_grad()
def _accuracy(model, x, y, batch: int = 1000) -> tuple[float, float]:
    model.eval()
    loss_sum, correct = 0.0, 0
    for s in range(0, len(y), batch):
        logits = model(x[s : s + batch])
        loss_sum += float(F.cross_entropy(logits, y[s : s + batch], reduction="sum"))
        correct += int((logits.argmax(1) == y[s : s + batch]).sum())
    model.train()
    return loss_sum / len(y), correct / len(y)


@torch.no_grad()
def _evaluate(gopt: GossipOptimizer, mdl, dataset, device, comm, step: int, spe: int) -> dict:
    """Test loss/accuracy of the averaged model xbar, and the spread of the nodes' own."""
    x_test = dataset.x_test.to(device)
    y_test = dataset.y_test.to(device)
    X = gopt.flat.data
    xbar = gopt.average()
    own = X[0].clone()
    X[0].copy_(xbar)  # evaluate xbar in hosted model 0 (its buffers, e.g. BatchNorm statistics)
    test_loss, test_acc = _accuracy(mdl[0], x_test, y_test)
    X[0].copy_(own)
    local = torch.tensor([[_accuracy(m_, x_test, y_test)[1]] for m_ in mdl], dtype=torch.float64)
    every = comm.all_gather(local, record=False).reshape(-1)
    return {
        "test_loss": test_loss,
        "test_acc": test_acc,
        "node_acc_min": float(every.min()),
        "node_acc_max": float(every.max()),
        "node_acc_mean": float(every.mean()),
        "consensus_distance": gopt.consensus_distance(),
    }


def _mean_over_nodes(comm, values: list[float]) -> float:
    t = torch.tensor([[v] for v in values], dtype=torch.float64)
    return float(comm.all_reduce(t, op="mean", record=False)[0, 0])


def _global_mean(comm, value: float, env: _Env) -> float:
    if not env.distributed:
        return value
    t = torch.tensor([[value]], dtype=torch.float64)
    return float(comm.all_reduce(t, op="mean", record=False)[0, 0])


# --------------------------------------------------------------------------------------
# accounting and printing
# --------------------------------------------------------------------------------------
def _node_ledger(snap: dict, r: int, hosted: int) -> dict:
    """Cumulative bytes of hosted row r and its share of the time, from a detailed snapshot."""
    sent = snap["per_node"]["sent"][r]
    recv = snap["per_node"]["received"][r]
    t = snap["time"]
    return {
        "bytes_sent": sent, "bytes_recv": recv,
        "compute_s": t.get("compute", 0.0) / hosted,
        "compress_s": t.get("compress", 0.0) / hosted,
        "comm_s": t.get("communicate", 0.0) / hosted,
    }


def _bytes_per_node_step(snap: dict, n: int, steps: int, env: _Env) -> float:
    if steps == 0:
        return 0.0
    hosted = 1 if env.distributed else n
    return snap["bytes"]["sent"] / hosted / steps


def _reference_topology(cfg: TrainConfig, n: int):
    """For a centralized run, the configured graph (or a ring) on n nodes, for the byte ratio."""
    for name in (cfg.topology, "ring", "complete"):
        try:
            return topologies.build(name, n)
        except (ValueError, TypeError):
            continue
    return None


def _dpsgd_bytes(topo, dim: int) -> float:
    """Bytes per node per step of full-precision D-PSGD on this topology (0 if none)."""
    if topo is None:
        return 0.0
    return float(topo.degrees.mean()) * compress.build("identity").payload_nbytes(dim)


def _bits(spec: str | None) -> int | None:
    if spec is None:
        return 32
    if spec.startswith("quant") and "bits=" in spec:
        return int(spec.split("bits=")[1].split(",")[0])
    return None


def _payload_bytes(algo, dim: int) -> int | None:
    c = algo.payload_compressor
    return None if c is None else int(c.payload_nbytes(dim))


def _fmt_bytes(b: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(b) < 1024 or unit == "GB":
            return f"{b:.1f} {unit}" if unit != "B" else f"{b:.0f} B"
        b /= 1024
    return f"{b:.1f} GB"


def _header(cfg, n, dim, algo, dpsgd_bytes, env) -> str:
    mode = f"torchrun, {n} ranks" if env.distributed else f"simulation, {n} nodes in one process"
    comp = cfg.compressor_spec or "none (fp32)"
    lat = f" latency: emulated {cfg.emulate_latency:g} ms per message round" if cfg.emulate_latency else ""
    extra = f"({','.join(f'{k}={v}' for k, v in cfg.algo_options)})" if cfg.algo_options else ""
    return (
        f"gossip.train: algo={cfg.algo}{extra} compressor={comp} topology="
        f"{cfg.topology if algorithms.is_decentralized(cfg.algo) else '-'} model={cfg.model_name} "
        f"({dim:,} params) data={cfg.data}/{cfg.partition} [{mode}]{lat}"
    )


def _epoch_line(epoch: float, epochs, ev, ledger, dpsgd_bytes, n, step) -> str:
    snap = ledger.as_dict()
    hosted = len(ledger.nodes)
    per_step = snap["bytes"]["sent"] / hosted / max(1, step)
    ratio = f" ({per_step / dpsgd_bytes:.3f}x D-PSGD)" if dpsgd_bytes else ""
    t = snap["time"]
    return (
        f"epoch {(f'{epoch:.0f}' if epoch == int(epoch) else f'{epoch:.2f}'):>3}/{epochs}  train {ev['train_loss']:.4f}  test {ev['test_loss']:.4f}  "
        f"acc {ev['test_acc']:.2%} [nodes {ev['node_acc_min']:.2%}-{ev['node_acc_max']:.2%}]  "
        f"consensus {ev['consensus_distance']:.3g}  sent/node/step {_fmt_bytes(per_step)}{ratio}  "
        f"time compute {t.get('compute', 0):.1f}s compress {t.get('compress', 0):.1f}s "
        f"comm {t.get('communicate', 0):.1f}s"
    )


def _progress(cfg, is_main, total, start):
    if not (cfg.progress and is_main):
        return None
    from tqdm.auto import tqdm

    # disable=None: no bar when stderr is not a terminal (logs, CI), the epoch lines remain
    return tqdm(total=total, initial=start, unit="step", dynamic_ncols=True, leave=False, disable=None)


def _write_json(path: Path, obj: Any) -> None:
    text = json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n"
    write_atomically(path, lambda f: f.write(text.encode()))


class _Metrics:
    """Append-only JSONL writer; on resume, drops records past the checkpoint's step."""

    def __init__(self, path: Path, keep_until: int | None = None) -> None:
        if keep_until is not None and path.exists():
            kept = []
            for line in path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if rec.get("step", 0) <= keep_until:
                    kept.append(line)
            path.write_text("".join(k + "\n" for k in kept))
        elif keep_until is None and path.exists():
            path.unlink()
        self._fh = open(path, "a", buffering=1)

    def write(self, rec: dict) -> None:
        self._fh.write(json.dumps(rec) + "\n")

    def close(self) -> None:
        self._fh.close()


# --------------------------------------------------------------------------------------
# checkpoints
# --------------------------------------------------------------------------------------
def _save(out, env, step, fingerprint, gopt, loaders, ledger, n, nodes, cfg_dict, elapsed, losses) -> None:
    payload = {
        "losses": losses,
        "step": step,
        "elapsed_s": float(elapsed),
        "optimizer": gopt.state_dict(),
        "loaders": [ld.state_dict() for ld in loaders],
        "ledger": ledger.state_dict(),
        "nodes": nodes,
        "config": cfg_dict,
    }
    checkpoint.save_checkpoint(
        checkpoint.checkpoint_path(out, step, env.rank), payload,
        config=cfg_dict, fingerprint_keys=FINGERPRINT_KEYS, fingerprint=fingerprint, world_size=n,
    )


def _resume(cfg, env, out, fingerprint, gopt, loaders, ledger, comm) -> int:
    ok = 1.0
    err = None
    step, elapsed, losses = 0, 0.0, None
    try:
        path = checkpoint.latest_checkpoint(out, rank=env.rank, num_ranks=env.world_size if env.distributed else 1)
        if path is None:
            raise checkpoint.CheckpointError(f"--resume {str(out)!r}: no checkpoint found in that directory")
        ck = checkpoint.load_checkpoint(
            path, expect_config={k: cfg.to_dict()[k] for k in FINGERPRINT_KEYS},
            expect_fingerprint=fingerprint, expect_world_size=env.world_size,
        )
        p = ck
        gopt.load_state_dict(p["optimizer"])
        for ld, s in zip(loaders, p["loaders"]):
            ld.load_state_dict(s)
        ledger.load_state_dict(p["ledger"])
        step = int(p["step"])
        elapsed = float(p["elapsed_s"])
        losses = p["losses"]
    except (checkpoint.CheckpointError, ValueError, KeyError) as e:
        ok, err = 0.0, e
    if env.distributed:  # every rank fails together instead of hanging at the next exchange
        flags = comm.all_gather(torch.tensor([[ok, float(step)]], dtype=torch.float64), record=False)
        if err is None and bool((flags[:, 0] < 1).any()):
            bad = [int(i) for i in torch.nonzero(flags[:, 0] < 1).flatten()]
            err = checkpoint.CheckpointError(f"--resume: the checkpoint of rank(s) {bad} could not be loaded")
        elif err is None and len(set(flags[:, 1].tolist())) != 1:
            err = checkpoint.CheckpointError("--resume: ranks have checkpoints of different steps")
    if err is not None:
        raise RunError(str(err)) from None
    return step, elapsed, losses
