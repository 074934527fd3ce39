"""The centralized compressed algorithms as DistributedDataParallel communication hooks.

.. code-block:: python

    from gossip import ddp
    model = DDP(model)
    state = ddp.hook_state(model, "efsgd", compressor="quant:bits=8", optimizer=opt)
    model.register_comm_hook(state, ddp.hook)

A DDP script stays as it is; these two lines replace DDP's all-reduce of the
gradients by the algorithm's compressed reduction. What the hook does with one
``GradBucket`` (a flat buffer of some parameters' gradients):

1. warm-up: during the first ``warmup_steps`` iterations (1 by default) the bucket is
   all-reduced in full precision (mean), as torch's own ``powerSGD_hook`` does for its
   first ``start_powerSGD_iter`` iterations. DDP puts every parameter in one bucket for
   its first iteration and rebuilds its buckets, in the order the gradients become
   ready, before the second; memories set up on the first iteration's bucket would
   not fit the rebuilt ones;
2. the bucket's parameters are looked up in the model; a *group* is the parameters of
   one bucket as first seen after the warm-up, in the model's ``parameters()`` order.
   Each group has its own instance of the algorithm, set up on the group's
   ``ParamLayout`` (so per-tensor blocks and PowerSGD's matrices are the bucket's
   tensors, as in ``powerSGD_hook``) with its own State: error-feedback memories,
   momentum, warm-start matrices. Group ``g`` is seeded with ``seed + g``;
3. the group's gradients (gathered from the bucket, which DDP orders by readiness) go
   through the algorithm's ``reduce_gradients`` as one ``(1, d)`` row, after
   ``set_lr`` with the optimizer's step size, and are scattered back. A bucket that
   holds several whole groups (the first iteration of a new DDP model after
   :meth:`HookState.load_state_dict`: one bucket of everything) runs each group in
   turn, so a resumed run computes exactly what the uninterrupted one did;
4. the hook posts the group's exchange and returns a ``torch.futures.Future`` of the
   bucket's buffer, completed with the reduced direction by the time backward ends
   (DDP copies it into the parameters' ``.grad``). The collectives run over DDP's
   process group through a :class:`gossip.comm.DistCommunicator` whose
   :class:`~gossip.comm.Ledger` (``state.ledger``) counts every byte.

Overlap, as torch's own hooks overlap their all-reduce: the hook posts the bucket's
exchange and returns while it is on the wire, and backward goes on computing the
next buckets' gradients. The all-gathered exchange (``exchange=allgather``) and the
warm-up all-reduce are one collective each. The sharded exchange has two stages
(push to the shard owners, then the owners' pull), and the pull can only be posted
once the push has arrived. Gloo and NCCL pair collectives by the order each rank
posts them in a process group, so the pulls go through a second group over the same
ranks, made with the hook state, and every stage is posted by the hooks themselves,
in bucket order, never from a callback: the hook of bucket ``k`` posts bucket
``k``'s push, then the pulls of the buckets whose pushes have arrived, in order, up
to the first still on the wire (it never waits for one: backward goes on). When the
last bucket arrives backward is over: its hook posts the remaining pulls, waits for
every bucket's exchange in turn, decodes the directions into the buffers and
completes the futures, on the hook's thread (the compressors and the ledger are not
shared with communication threads). No thread is started: work handles and futures
only. ``overlap=False`` waits inside every hook instead (what the overlap saves is
measured by ``experiments/bench_ddp_overlap.py`` against it and against torch's own
all-reduce). powersgd, efmomentum, the top-k family and allreduce still reduce inside
the hook.

Chunks: on gloo a message leaves only once its receiver has announced the receive, and
the announcement queues behind that rank's own outgoing data; whole buckets exchanged
both ways at once leave a slow link idle in one direction. With ``chunk_kb="auto"``
(the default) the first bucket of the algorithm's first iteration measures the link
(:meth:`gossip.comm.DistCommunicator.tune_chunks`: a few tiny all-reduces and one of
256 KiB, outside the ledger) and every later stage of an exchange goes as collectives
of at most four times the link's bandwidth-delay product per peer, 64 KiB or more:
small chunks on a slow, near link; whole messages where the product is large. The
bits and the bytes are those of whole messages.

Momentum: an algorithm that applies momentum itself (powersgd, efblocksgdm, signum,
efmomentum, sketched, truetopk, localtopk by default, demo) must have a local optimizer with
none. Pass ``optimizer=`` to :func:`hook_state`: it is refused in one line
(:class:`gossip.runtime.MomentumConflict`) when both have momentum, and its
``param_groups[0]["lr"]`` is handed to ``set_lr`` before every iteration (the EF-SGD
family rescales its memories by ``eta_{t-1} / eta_t``). Without it the step size is
taken as constant, and for an algorithm that owns momentum a warning says that the
optimizer's could not be checked.

The decentralized algorithms (dpsgd, dcd, ecd, naive) act on the models, not on the
gradients, and are no hooks; MergeComp (``merge``) schedules tensors during backward
itself and is not offered here either.
"""

import warnings
from typing import Any, Mapping

import torch
import torch.distributed as dist
# before the user's script creates its process group: imported later (torch._dynamo does
# it on a first compiled call) it keeps the gloo group alive past the interpreter's exit
# (see gossip.comm.distributed._preload_before_init)
import torch.distributed.nn.functional  # noqa: F401
from torch import nn

from gossip import algorithms as _algorithms
from gossip.algorithms.base import ParamLayout, Pending
from gossip.comm import DistCommunicator, Ledger
from gossip.runtime import check_momentum

__all__ = ["HOOK_ALGORITHMS", "HookState", "hook", "hook_state"]

#: the algorithms that work as DDP hooks: those that rewrite gradients (``acts_on``),
#: derived from the registry so a new gradient algorithm is a hook without an edit here
HOOK_ALGORITHMS: tuple[str, ...] = tuple(
    n for n in _algorithms.available() if _algorithms.algorithm_class(n).acts_on == "gradient"
)
_FORMAT = "gossip.ddp/1"


def hook_state(
    model: nn.Module,
    algorithm: str,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    process_group: Any = None,
    warmup_steps: int = 1,
    timeout: float = 300.0,
    overlap: bool = True,
    chunk_kb: int | str | None = "auto",
    **options: Any,
) -> "HookState":
    """The state for ``model.register_comm_hook(state, ddp.hook)``.

    ``model``: the DDP model (or the module it wraps), whose parameter names and order
    define the groups. ``algorithm``: one of :data:`HOOK_ALGORITHMS`; ``options`` go to
    its Config (``compressor="quant:bits=8"``, ``rank=2``, ``momentum=0.9``, ``seed``, ...)
    and are checked here. ``optimizer``: the local optimizer, for the momentum check and
    the step size (see the module docstring). ``process_group``: DDP's
    (``None``: the default group). ``warmup_steps`` (>= 1): iterations all-reduced in
    full precision before the algorithm starts. ``timeout``: seconds a collective may
    take before the peer is named in an error. ``overlap`` (default True): the hook
    returns before its exchange has arrived (see "Overlap" in the module docstring);
    False waits for it inside the hook, the way to measure what overlapping saves.
    ``chunk_kb``: an int posts each stage of a bucket's exchange as collectives of at
    most that many KiB per peer, which keeps both directions of a slow, low-latency
    gloo link busy (see "Chunks" in :mod:`gossip.comm.distributed`); None posts whole
    messages; ``"auto"`` (default) measures the link once, when the algorithm's first
    iteration starts, and picks the chunk from its bandwidth and round trip
    (:meth:`gossip.comm.DistCommunicator.tune_chunks`; whole messages on NCCL).
    """
    return HookState(model, algorithm, optimizer=optimizer, process_group=process_group,
                     warmup_steps=warmup_steps, timeout=timeout, overlap=overlap, chunk_kb=chunk_kb, **options)


class _Group:
    """The parameters of one bucket (model order) and the algorithm reducing them."""

    __slots__ = ("positions", "names", "layout", "algorithm")

    def __init__(self, positions: tuple[int, ...], names: tuple[str, ...], layout: ParamLayout,
                 algorithm: Any) -> None:
        self.positions, self.names, self.layout, self.algorithm = positions, names, layout, algorithm


class _Segments:
    """Where a group's tensors lie in a bucket's buffer: ``(offset, numel)`` per tensor,
    in the group's (model) order. DDP fills a bucket in reverse model order, so the
    group's row is the buffer's runs permuted; each run is copied whole (a memcpy),
    where an index gather and scatter move the values one by one."""

    __slots__ = ("runs",)

    def __init__(self, runs: tuple[tuple[int, int], ...]) -> None:
        self.runs = runs

    def identity(self, numel: int) -> bool:
        """Whether the runs are the whole buffer of ``numel`` values, in order."""
        at = 0
        for o, n in self.runs:
            if o != at:
                return False
            at += n
        return at == numel

    def gather(self, buf: torch.Tensor) -> torch.Tensor:
        """The group's values out of the bucket's flat ``buf``, in the group's order."""
        return torch.cat([buf[o:o + n] for o, n in self.runs])

    def scatter(self, values: torch.Tensor, buf: torch.Tensor) -> None:
        """Write the group's flat ``values`` back to their places in ``buf``."""
        at = 0
        for o, n in self.runs:
            buf[o:o + n].copy_(values[at:at + n])
            at += n


class HookState:
    """One algorithm instance per group of parameters (a DDP bucket), lazily set up.

    ``ledger``: the bytes and times of every collective (warm-up included);
    ``iteration``: DDP iterations reduced so far; ``algorithms``: the group's
    algorithm instances, in the order the groups were made. :meth:`state_dict` /
    :meth:`load_state_dict` hold every group's State, so a resumed run continues
    bit-identically. Build it with :func:`hook_state`.
    """

    def __init__(self, model: nn.Module, algorithm: str, *, optimizer: Any = None, process_group: Any = None,
                 warmup_steps: int = 1, timeout: float = 300.0, overlap: bool = True,
                 chunk_kb: int | str | None = "auto", **options: Any) -> None:
        if not isinstance(algorithm, str) or algorithm not in HOOK_ALGORITHMS:
            known = _algorithms.available()
            # every registered algorithm without a hook acts on the models (gossip mixing, or
            # local SGD's periodic averaging), which a gradient hook cannot do
            why = ("acts on the models, not on the gradients (use gossip.GossipOptimizer)"
                   if isinstance(algorithm, str) and algorithm in known else "is not an algorithm")
            raise ValueError(f"gossip.ddp: {algorithm!r} {why}; DDP hooks exist for {', '.join(HOOK_ALGORITHMS)}")
        if "merge" in options or any(k.startswith("merge_") for k in options):
            raise ValueError("gossip.ddp: `merge` (MergeComp) schedules tensors during backward itself and is "
                             "not a DDP hook; DDP's buckets are the groups here (tune them with bucket_cap_mb)")
        _check_options(warmup_steps, overlap, chunk_kb)
        if not isinstance(model, nn.Module):
            raise TypeError(f"gossip.ddp: `model` must be the nn.Module (DDP or not), got {type(model).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"gossip.ddp: `optimizer` must be a torch.optim.Optimizer or None, got "
                            f"{type(optimizer).__name__}")
        module = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
        # DDP reduces only the parameters that require gradients: the same here
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("gossip.ddp: the model has no parameters that require gradients")
        # the Config's checks run now, not in the middle of a backward pass; the
        # algorithms themselves are built per group, with the communicator, in _build
        config = _algorithms.make_config(algorithm, **options)
        momentum = _algorithms.algorithm_class(algorithm).momentum_of(config)
        if optimizer is not None:
            check_momentum(algorithm, momentum, [optimizer])  # the one-line MomentumConflict
        elif momentum > 0:
            warnings.warn(
                f"gossip.ddp: {algorithm} applies its own momentum; the local optimizer must have none "
                "(pass optimizer= to hook_state to have it checked)", stacklevel=3)
        self.name = algorithm
        self.options = dict(options)
        self.seed = int(config.seed)
        self.warmup_steps = warmup_steps
        self.overlap = overlap
        self.optimizer = optimizer
        self.comm = DistCommunicator(group=process_group, timeout=timeout,
                                     pull_group=_pull_group(process_group) if overlap else None,
                                     chunk_bytes=chunk_kb * 1024 if isinstance(chunk_kb, int) else None)
        #: "auto": the link is measured when the algorithm's first iteration starts
        self._tune_chunks = chunk_kb == "auto"
        self.iteration = 0
        self._params = [p for _, p in named]
        self._names = [n for n, _ in named]
        self._position = {id(p): k for k, p in enumerate(self._params)}
        self._groups: list[_Group] = []
        self._group_of: dict[int, int] = {}  # parameter position -> group index
        self._plans: dict[tuple[int, ...], list[tuple[_Group, _Segments | None]]] = {}
        #: this iteration's buckets whose exchanges are in flight, in the order posted
        self._in_flight: list[tuple[Any, ...]] = []

    # ------------------------------------------------------------------ views
    @property
    def ledger(self) -> Ledger:
        """Bytes sent and received and time per phase, over every bucket and iteration."""
        return self.comm.ledger

    @property
    def algorithms(self) -> list[Any]:
        return [g.algorithm for g in self._groups]

    @property
    def groups(self) -> list[tuple[str, ...]]:
        """The parameter names of every group, in the model's order."""
        return [g.names for g in self._groups]

    # ------------------------------------------------------------------ groups
    def _build(self, index: int) -> Any:
        # every hook algorithm's Config takes a seed; groups draw independent randomness
        return _algorithms.build(self.name, self.comm, **{**self.options, "seed": self.seed + index})

    def _new_group(self, positions: list[int]) -> _Group:
        positions = sorted(positions)
        names = tuple(self._names[k] for k in positions)
        layout = ParamLayout.from_shapes([tuple(self._params[k].shape) for k in positions], names)
        p0 = self._params[positions[0]]
        algo = self._build(len(self._groups))
        with self.ledger.setup():
            algo.setup(torch.zeros(1, layout.dim, dtype=p0.dtype, device=p0.device), layout)
        group = _Group(tuple(positions), names, layout, algo)
        for k in positions:
            self._group_of[k] = len(self._groups)
        self._groups.append(group)
        self._plans.clear()
        return group

    def _plan(self, bucket: Any) -> list[tuple[_Group, _Segments | None]]:
        """For a bucket: each group it holds, and where the group's tensors lie in the
        bucket's buffer (None when the buffer is the group, in order)."""
        params = bucket.parameters()
        try:
            order = tuple(self._position[id(p)] for p in params)
        except KeyError:
            raise RuntimeError("gossip.ddp: a bucket holds a parameter that is not in the model given to "
                               "hook_state; pass the DDP model (or its module)") from None
        plan = self._plans.get(order)
        if plan is not None:
            return plan
        numels = [self._params[k].numel() for k in order]
        if sum(numels) != bucket.buffer().numel():
            raise RuntimeError(f"gossip.ddp: bucket {bucket.index()} holds {bucket.buffer().numel()} values for "
                               f"parameters of {sum(numels)} (sparse gradients are not supported)")
        owners = {self._group_of.get(k) for k in order}
        if owners == {None}:
            groups = [self._new_group(list(order))]
        elif None in owners or any(set(self._groups[g].positions) - set(order) for g in owners):
            raise RuntimeError(
                f"gossip.ddp: bucket {bucket.index()} ({len(order)} tensors) cuts across the groups set up on "
                f"earlier buckets; DDP's buckets changed after the warm-up (find_unused_parameters? a "
                f"different bucket_cap_mb than the checkpoint's?)")
        else:
            groups = [self._groups[g] for g in sorted(owners)]
        offset, where = 0, {}
        for k, n in zip(order, numels):
            where[k] = (offset, n)
            offset += n
        plan = []
        for g in groups:
            seg = _Segments(tuple(where[k] for k in g.positions))
            plan.append((g, None if len(groups) == 1 and seg.identity(offset) else seg))
        self._plans[order] = plan
        return plan

    # ------------------------------------------------------------------ the hook's body
    @torch.no_grad()
    def _start(self, bucket: Any) -> list[tuple[Pending, _Segments | None]]:
        """Compress the bucket's groups and post their exchanges; nothing is waited."""
        buf = bucket.buffer()
        if self.iteration < self.warmup_steps:
            # 1. full precision while DDP settles its buckets
            handle = self.comm.all_reduce_async(buf.view(1, -1), op="mean")
            return [(Pending(handle, lambda r: r[0]), None)]
        if self._tune_chunks:  # the first bucket of the algorithm's first iteration, on every rank
            self._tune_chunks = False
            self.comm.tune_chunks()
        lr = None if self.optimizer is None else float(self.optimizer.param_groups[0]["lr"])
        started = []
        for group, idx in self._plan(bucket):
            # 2-3. the group's gradients as one row, through the algorithm
            G = buf.view(1, -1) if idx is None else idx.gather(buf).view(1, -1)
            if lr is not None:
                group.algorithm.set_lr(lr)
            algo = group.algorithm
            # an algorithm whose exchange completes asynchronously returns it in flight;
            # the others (allreduce's one collective) reduce inline, already complete
            started.append((algo.reduce_gradients_start(G), idx))
        return started

    @staticmethod
    def _finish(entry: tuple[Any, ...]) -> None:
        """Wait for a bucket's exchanges, decode each group's direction into the bucket's
        buffer and complete the bucket's future; on this (the hook's) thread."""
        buf, started, result = entry
        for pending, idx in started:
            G = pending.wait()
            if idx is not None:
                idx.scatter(G.reshape(-1), buf)
            elif G.data_ptr() != buf.data_ptr():
                buf.copy_(G.reshape(-1))
        result.set_result(buf)

    def hook_future(self, bucket: Any) -> torch.futures.Future:
        """The hook's work on one bucket (see the module docstring, step 4)."""
        result: torch.futures.Future = torch.futures.Future()
        entry = (bucket.buffer(), self._start(bucket), result)
        if not self.overlap:  # every stage posted and waited here: a completed future
            for pending, _ in entry[1]:
                pending.advance()
            self._finish(entry)
        else:
            self._in_flight.append(entry)
            if bucket.is_last():  # backward is done: finish every bucket, in order
                for e in self._in_flight:
                    for pending, _ in e[1]:
                        pending.advance()
                in_flight, self._in_flight = self._in_flight, []
                for e in in_flight:
                    self._finish(e)
            else:
                self._advance_ready()
        if bucket.is_last():
            self.iteration += 1
            self.ledger.step()
        return result

    def _advance_ready(self) -> None:
        """Post the later stages (pulls) of the buckets in flight, in bucket order, on the
        hook's thread. With the pulls in a process group of their own, every bucket
        whose push has arrived, up to the first whose push has not: backward is never
        held up by a push still on the wire. Otherwise the previous bucket's, after this
        bucket's push, as every rank does (waiting for that push if it is on the wire)."""
        if not self.comm.has_pull_group:
            if len(self._in_flight) > 1:
                for pending, _ in self._in_flight[-2][1]:
                    pending.advance()
            return
        for e in self._in_flight:
            for pending, _ in e[1]:
                if not pending.ready():
                    return
                pending.advance()

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """Every group's parameter names and algorithm State, the iteration count and
        the ledger: enough to continue bit-identically."""
        return {
            "format": _FORMAT,
            "algorithm": self.name,
            "iteration": self.iteration,
            "groups": [{"names": list(g.names), "state": g.algorithm.state_dict()} for g in self._groups],
            "ledger": self.ledger.state_dict(),
        }

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; the groups are set up here, from the
        saved parameter names, before any bucket arrives."""
        if not isinstance(sd, Mapping) or sd.get("format") != _FORMAT:
            got = sd.get("format") if isinstance(sd, Mapping) else type(sd).__name__
            raise ValueError(f"gossip.ddp: load_state_dict expects a HookState.state_dict() ({_FORMAT!r}), "
                             f"got format {got!r}")
        if sd["algorithm"] != self.name:
            raise ValueError(f"gossip.ddp: the state is {sd['algorithm']}'s, this hook runs {self.name}")
        index = {n: k for k, n in enumerate(self._names)}
        missing = [n for g in sd["groups"] for n in g["names"] if n not in index]
        if missing:
            raise ValueError(f"gossip.ddp: the state names parameters this model does not have: {missing[:5]}")
        self._groups, self._group_of, self._plans, self._in_flight = [], {}, {}, []
        for g in sd["groups"]:
            self._new_group([index[n] for n in g["names"]]).algorithm.load_state_dict(g["state"])
        self.iteration = int(sd["iteration"])
        self.ledger.load_state_dict(sd["ledger"])

    def __repr__(self) -> str:
        return (f"HookState({self.name}, {len(self._groups)} group(s), iteration={self.iteration}, "
                f"warmup_steps={self.warmup_steps})")


def _check_options(warmup_steps: Any, overlap: Any, chunk_kb: Any) -> None:
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 1:
        raise ValueError(f"gossip.ddp: `warmup_steps` must be an int >= 1 (DDP rebuilds its buckets after "
                         f"the first iteration), got {warmup_steps!r}")
    if not isinstance(overlap, bool):
        raise TypeError(f"gossip.ddp: `overlap` must be True or False, got {overlap!r}")
    if chunk_kb not in (None, "auto") and (isinstance(chunk_kb, bool) or not isinstance(chunk_kb, int)
                                           or chunk_kb < 1):
        raise ValueError(f"gossip.ddp: `chunk_kb` must be 'auto', None (whole exchanges) or an int >= 1, "
                         f"got {chunk_kb!r}")


def _pull_group(group: Any) -> Any:
    """A process group over ``group``'s ranks (the default group's where None), same
    backend, for the sharded exchanges' pulls (:class:`gossip.comm.DistCommunicator`'s
    ``pull_group``); None for a world of one. Made by every rank of ``group`` as it
    builds its hook state, as DDP itself is built."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) < 2:
        return None
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    return dist.new_group(ranks, backend=str(dist.get_backend(group)), use_local_synchronization=True)


# no ``from __future__ import annotations`` in this module: DDP's register_comm_hook
# compares these annotations with the real classes
def hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The communication hook: ``model.register_comm_hook(state, ddp.hook)``.

    Posts the bucket's exchange with ``state``'s algorithm (see the module docstring) and
    returns a future of the bucket's buffer, completed with the reduced direction when
    the last bucket's hook has run; DDP waits for it at the end of the backward pass.
    """
    return state.hook_future(bucket)
