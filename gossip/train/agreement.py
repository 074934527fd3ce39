"""Agreement across ranks: what every rank must share before anything is written.

Under torchrun each rank parses its own command line and reads its own data; a run
whose ranks differ would train something nobody asked for. Before the first exchange
:func:`agree_config` compares the run-defining config (:data:`AGREE_KEYS`) and a digest
of the data set (:func:`data_identity`) across the ranks, and every rank stops with
the same line naming what differs. :func:`agree_out_dir` gives every rank rank 0's
run directory, :func:`claim_out` refuses one that holds another run, on every rank
alike, before anything is written. :func:`failing_ranks`, :func:`gathered` and :func:`gathered_max` are
the collective decisions the rest of the run takes (all ranks succeed or all
stop; every rank acts on the largest value any rank saw). In the one-process
simulation every check is local.
"""

from __future__ import annotations

import datetime as _dt
import errno
import json
import math
import os
from pathlib import Path

import torch

from gossip import algorithms, rundir
from gossip.train.assembly import Env
from gossip.train.config import AGREE_KEYS, RESUME_AUTO, TrainConfig, agree_keys
from gossip.errors import RunError

__all__ = ["AGREE_KEYS", "agree_config", "agree_out_dir", "drop_unclaimed_default", "agreement_record", "claim_out", "data_identity",
           "disagreement", "failing_ranks",
           "gathered", "gathered_max", "init_group"]


def failing_ranks(comm, distributed: bool, ok: bool) -> list[int]:
    """The ranks where ``ok`` is false, as every rank sees them (one all-gather under
    torchrun; this process's own answer in one process, as rank 0)."""
    if not distributed:
        return [] if ok else [0]
    flags = comm.all_gather(torch.tensor([[float(ok)]], dtype=torch.float64), record=False)
    return [int(i) for i in torch.nonzero(flags[:, 0] < 1).flatten()]


def gathered(comm, distributed: bool, values: list[float]) -> list[list[float]]:
    """Every rank's ``values``, by rank (this process's own alone in one process)."""
    if not distributed:
        return [[float(v) for v in values]]
    return comm.all_gather(torch.tensor([values], dtype=torch.float64), record=False).tolist()


def gathered_max(comm, distributed: bool, values: list[float]) -> list[float]:
    """Each of ``values``' largest value over the ranks: the value every rank acts on."""
    return [max(column) for column in zip(*gathered(comm, distributed, values))]


def claim_out(cfg: TrainConfig, out: Path, distributed: bool, is_main: bool, comm) -> None:
    """Refuse a run directory that holds another run (all ranks agree), then create it;
    ``--overwrite`` first removes the previous run's own files (rank 0)."""
    err = _prepare_out(cfg, out)
    bad = failing_ranks(comm, distributed, err is None)  # every rank fails together, not one writing alone
    if err is None and bad:
        err = f"--out {str(out)!r} cannot be used on rank(s) {bad}"
    if err is not None:
        raise RunError(err)
    if cfg.run.overwrite and is_main and out.is_dir():
        try:
            rundir.remove_run_files(out)
        except (rundir.RunDirError, OSError) as e:
            raise RunError(f"--overwrite {str(out)!r}: {getattr(e, 'strerror', None) or e}") from None
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RunError(f"--out {str(out)!r}: cannot create the run directory ({e.strerror})") from None
    if distributed:  # nobody writes before rank 0 has cleared
        comm.all_gather(torch.zeros(1, 1, dtype=torch.float64), record=False)


def _default_out(cfg: TrainConfig) -> str:
    """``runs/<time>-<algo>-<topology>-<pid>``, created here so that two runs started in
    the same second on this host never share it (rank 0 chooses; the ranks agree)."""
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    algo = cfg.algorithm.name
    topo = cfg.comm.topology if algorithms.is_decentralized(algo) else "allreduce"
    name = f"{algo}-{topo}" if topo != algo else algo
    for k in range(1000):
        out = Path("runs") / (f"{stamp}-{name}-{os.getpid()}" + (f"-{k}" if k else ""))
        try:
            out.mkdir(parents=True, exist_ok=False)
            return str(out)
        except FileExistsError:
            continue
        except OSError as e:
            raise RunError(f"cannot create the run directory {str(out)!r} ({e.strerror}); give --out DIR") from None
    raise RunError("cannot find a free default run directory under runs/; give --out DIR")


def drop_unclaimed_default(cfg: TrainConfig, out: Path, is_main: bool) -> None:
    """Remove the default run directory :func:`agree_out_dir` created (rank 0) when the
    run is refused before it claimed it: a refused run leaves no run directory behind. A directory
    the user named, or one that holds anything, is left alone."""
    if is_main and cfg.run.out is None and cfg.run.resume is None:
        try:
            out.rmdir()  # only an empty directory goes
        except OSError:
            pass


def _prepare_out(cfg: TrainConfig, out: Path) -> str | None:
    """Make ``out`` ready for this run, or say in one line why not (None: ready).

    A run directory that already holds files is refused unless the run continues it
    (``--resume``) or replaces it (``--overwrite``: rank 0 deletes the previous run's
    own files first, as :func:`gossip.rundir.run_files` lists them, and leaves any
    other file alone; a ``config.json`` or ``summary.json`` that is not a run's is
    refused). Nothing is written before every rank has agreed.
    """
    try:
        return _check_out(cfg, out)
    except OSError as e:  # a name too long for the file system, a directory we may not list
        return f"--out {str(out)!r}: {e.strerror or e}" + (": give a shorter --out" if e.errno == errno.ENAMETOOLONG else "")


def _check_out(cfg: TrainConfig, out: Path) -> str | None:
    if out.exists() and not out.is_dir():
        return f"--out {str(out)!r} is a file, not a directory"
    if cfg.run.resume is None and out.is_dir() and any(out.iterdir()):
        if not cfg.run.overwrite:
            kept = ", ".join(sorted(p.name for p in out.iterdir())[:4])
            return (f"--out {str(out)!r} already holds a run ({kept}, ...); give --resume {str(out)!r} to "
                    f"continue it, --overwrite to replace it, or another --out")
        foreign = rundir.run_files(out)[1]
        if foreign:
            return (f"--overwrite: {str(foreign[0])!r} is not a gossip run's file and is left alone; "
                    f"move it or give another --out")
    return None



#: bytes of one array hashed in full; a larger one is hashed in evenly spaced rows of
#: about this many bytes in all (and its shape, which every row count changes)
_DIGEST_BYTES = 64 * 2**20
#: the data set's arrays the ranks compare, and what the message calls them
_DATA_PARTS = {"x_train": "training inputs", "y_train": "training labels",
               "x_test": "test inputs", "y_test": "test labels"}


def _array_digest(t: torch.Tensor) -> str:
    """``shape dtype sha256[:16]`` of an array; above :data:`_DIGEST_BYTES`, of evenly
    spaced rows (marked ``sampled``): cheap for large sets, and a file of other images
    changes the digest unless it differs from the others only in rows never sampled."""
    import hashlib

    t = t.detach().cpu().contiguous()
    rows = max(1, t.shape[0]) if t.dim() else 1
    stride = max(1, math.ceil(t.numel() * t.element_size() / _DIGEST_BYTES))
    part = t[::stride].contiguous() if stride > 1 and t.dim() else t
    h = hashlib.sha256(part.view(torch.uint8).numpy().tobytes() if part.numel() else b"")
    return (f"shape {tuple(t.shape)} {str(t.dtype).replace('torch.', '')} sha256 {h.hexdigest()[:16]}"
            + (f" (every {stride}th of {rows} rows)" if stride > 1 else ""))


def data_identity(dataset) -> dict[str, str]:
    """What every rank must hold alike: a digest of each of the data set's arrays."""
    return {k: _array_digest(getattr(dataset, k)) for k in _DATA_PARTS
            if isinstance(getattr(dataset, k, None), torch.Tensor)}


def agreement_record(cfg: TrainConfig, dataset=None) -> dict:
    """What a rank (or a ``--fault-tolerance`` replica) must share with every other: the
    run-defining config (:func:`gossip.train.config.agree_keys`) and a digest of each of the data
    set's arrays (keys ``data:<array>``), as JSON-able values."""
    flat = cfg.to_dict()
    mine = {k: flat.get(k) for k in agree_keys()}
    mine["resume_auto"] = cfg.run.resume == RESUME_AUTO
    if dataset is not None:
        mine.update({f"data:{k}": v for k, v in data_identity(dataset).items()})
    return mine


def disagreement(cfg: TrainConfig, records: list[dict], ids: list[int], unit: str = "rank") -> str | None:
    """One line naming what differs among ``records`` (each member's
    :func:`agreement_record`, member ``ids[i]`` of its ``unit``: rank, replica), or None
    when they agree: the config keys that differ with a member holding each value, else
    the data arrays that differ and who holds other data than the first member."""
    names = [f"{unit} {i}" for i in ids]
    keys = list(dict.fromkeys(k for rec in records for k in rec))
    diffs, data_diffs = [], []
    for key in keys:
        holders: dict[str, int] = {}
        for r, theirs in enumerate(records):
            holders.setdefault(json.dumps(theirs.get(key), sort_keys=True, default=str), r)
        if len(holders) > 1:
            if key.startswith("data:"):
                data_diffs.append(f"{_DATA_PARTS.get(key[5:], key[5:])}: " + ", ".join(
                    f"{json.loads(v)} on {names[r]}" for v, r in holders.items()))
            else:
                diffs.append(f"{key}: " + ", ".join(f"{v} on {names[r]}" for v, r in holders.items()))
    if diffs:
        return f"the {unit}s were started with different configs; {'; '.join(diffs)}"
    if data_diffs:
        odd = sorted({ids[r] for key in keys if key.startswith("data:")
                      for r, theirs in enumerate(records) if theirs.get(key) != records[0].get(key)})
        return (f"{unit}(s) {odd} hold other data than {names[0]} (--data {cfg.data.name}"
                f"{' --data-dir ' + repr(cfg.data.data_dir) if cfg.data.data_dir else ''}): {'; '.join(data_diffs)}; "
                f"give every {unit} the same data")
    return None


def agree_config(cfg: TrainConfig, env: Env, dataset=None, data_error: str | None = None) -> None:
    """Every rank compares the run-defining config, and a digest of its data set, with
    every other; on a mismatch all ranks stop with one line naming the differing keys
    (or arrays) and a rank holding each value."""
    import torch.distributed as dist

    mine = agreement_record(cfg, dataset)
    everyone: list[dict] = [None] * env.world_size  # type: ignore[list-item]
    mine["data_error"] = data_error
    dist.all_gather_object(everyone, mine)
    failed = [(r, theirs["data_error"]) for r, theirs in enumerate(everyone) if theirs.get("data_error")]
    if failed:  # a rank that could not load its data stops every rank, named
        raise RunError(f"rank {failed[0][0]} cannot load its data: {failed[0][1]}")
    for theirs in everyone:
        del theirs["data_error"]
    line = disagreement(cfg, everyone, list(range(env.world_size)))
    if line is not None:
        raise RunError(line)


def init_group(cfg: TrainConfig, env: Env, device: torch.device) -> None:
    """The process group; a rank that does not arrive is one line, not a store traceback."""
    import torch.distributed as dist

    from gossip import comm as gcomm

    try:
        gcomm.init_from_env(backend="nccl" if device.type == "cuda" else "gloo", timeout=cfg.comm.timeout,
                            device=device)
    except (dist.DistStoreError, dist.DistNetworkError) as e:
        where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RunError(
            f"rank {env.rank}: not all {env.world_size} ranks arrived at {where} within --timeout "
            f"{cfg.comm.timeout:g} s ({first}); start every rank, check MASTER_ADDR/MASTER_PORT, or raise --timeout"
        ) from None


def agree_out_dir(cfg: TrainConfig, env: Env) -> Path:
    """The run directory every rank uses: ``--resume DIR``, ``--out``, else a fresh
    default that rank 0 creates (its error, if any, stops every rank)."""
    resume = None if cfg.run.resume == RESUME_AUTO else cfg.run.resume
    out, err = resume or cfg.run.out, None
    if out is None and env.rank == 0:
        try:
            out = _default_out(cfg)
        except RunError as e:
            err = str(e)
    if env.distributed:  # rank 0's choice for all, or its error for all
        import torch.distributed as dist

        box = [out, err]
        dist.broadcast_object_list(box, src=0)
        out, err = box
    if err is not None:
        raise RunError(err)
    return Path(out)


