"""MergeComp (Wang et al. 2021, arXiv:2103.15195): compress and send gradients in groups, overlapped with backward.

The algorithm scheduled is dist-EF-SGD (Zheng et al. 2019, arXiv:1905.10936, Alg. 2, with momentum Alg. 4
without blocks; ``gossip.algorithms.efsgd``), applied group by group (Wang et al. 2021 (arXiv:2103.15195)
Alg. 1): for group k of step t, with x_k its slice of the gradient buffer,

1. momentum (mu > 0): m[x_k] = mu m[x_k] + g[x_k];  v = g[x_k] + mu m[x_k];
2. worker error feedback: p = v + (eta_{t-1}/eta_t) e[x_k]; payload = C_k(p);
   e[x_k] = p - C_k(p) (random keys: stream 2k of (seed, node, t));
3. communicate: all-gather of the payloads (all-reduce of the values for the
   ``identity`` compressor, the full-precision baseline);
4. replicated server: p~ = mean_i C_k(p_i) + (eta_{t-1}/eta_t) e~[x_k];
   Delta~ = C_k(p~); e~[x_k] = p~ - Delta~ (shared key: stream 2k + 1);
5. the gradient of group k becomes Delta~.

With one group (``--merge whole``) this is exactly ``efsgd`` (same keys, same
payloads, same reduction order). The error memories and the momentum are flat
vectors over the whole model, cut into groups by the current partition, so they
survive a change of partition. ``blocksign`` keeps one block per parameter tensor
whatever the grouping.

Overlap. The gradients are laid out in the order back-propagation produces them, so
each group is one contiguous slice. A post-accumulate-grad hook on every parameter
copies its gradient into that buffer; when every tensor of a group is in (and all
earlier groups have been launched), the group is encoded and its asynchronous
collective posted, while backward goes on. The step then waits only for what is
still in flight, decodes, and applies the server step. Overlap needs one node per
process (torchrun); in the in-process simulation all groups are processed at the
step, with the same results.

Partitions (``merge``): ``"layer"`` (one group per tensor), ``"whole"`` (one group),
an int N (N groups, split chosen by the cost model), ``"auto"`` (Wang et al. 2021, arXiv:2103.15195, Alg. 2).
N and auto first learn the backward order (step 1), then time ``profile_steps``
layer-wise steps in which each tensor is encoded, sent and decoded on its own (so
each cost is measured alone), fit the linear costs of Assumption 5 (see
:mod:`gossip.schedule.cost`), and take the model's best split for each y. auto then
runs the candidates y = 1..Y in turn, one step each, for a warm-up round and then
``trial_steps`` timed rounds (interleaved, so a change of load on the machine hits
every candidate alike), and applies Alg. 2 to their median iteration times. Every decision is made on rank 0 and broadcast, so all
ranks always use the same partition; it is part of the state (checkpoints).
"""

from __future__ import annotations

import copy
import math
import statistics
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any, Callable

import torch

from gossip import compress as _compress
from gossip.algorithms._centralized import ErrorFeedback, CentralizedBase, check_fraction, check_spec
from gossip.algorithms._common import check_int, node_keys, shared_key, step_tag
from gossip.algorithms.base import ParamLayout, WireFormat
from gossip.algorithms.efsgd import ef_momentum, ef_pull, ef_push
from gossip.schedule.cost import CostModel, alg2, best_partition, fit_linear
from gossip.schedule.partition import Partition, parse_merge

__all__ = ["MergeComp", "MergeCompConfig", "MergeCompState", "DEFAULT_ALPHA"]

#: Wang et al. 2021 (arXiv:2103.15195) gives no value for alpha; 5% is the order of the gains of its Table 3.
#: With the default Y = 2 it has no effect (Alg. 2 returns X_2 unless F(2) > F(1)).
DEFAULT_ALPHA = 0.05


@dataclass(frozen=True, kw_only=True)
class MergeCompConfig:
    """The schedule's options; the tensors come from the layout given to ``setup``."""

    compressor: str = "sign"
    momentum: float = 0.0
    seed: int = 0
    merge: str | int = "auto"
    max_groups: int = 2
    alpha: float = DEFAULT_ALPHA
    profile_steps: int = 5
    trial_steps: int = 4

    def __post_init__(self) -> None:
        comp = check_spec(self.compressor, "mergecomp")
        if comp.name == "blocksign" and (comp.config.offsets is not None or comp.config.block is not None):
            raise ValueError(
                "mergecomp: blocksign's blocks are the parameter tensors under --merge; give plain 'blocksign'"
            )
        check_fraction("momentum", self.momentum)
        check_int("seed", self.seed, minimum=0)
        object.__setattr__(self, "merge", parse_merge(self.merge))
        check_int("max_groups", self.max_groups, minimum=1)
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not 0 < self.alpha < 1:
            raise ValueError(f"Arg `alpha` must lie in (0, 1), got {self.alpha!r}")
        check_int("profile_steps", self.profile_steps, minimum=1)
        check_int("trial_steps", self.trial_steps, minimum=1)


@dataclass
class MergeCompState:
    """``order``: parameter indices in backward order (``order_known`` once learnt);
    ``sizes``: the current partition; ``error`` (m, d), ``server_error`` (1, d) and
    ``momentum`` (m, d or empty) are laid out in that order. ``phase`` is where the
    schedule is ("order", "profile", "trial", "done"), ``phase_step`` how many steps
    it has run, ``search`` the measurements and the report so far."""

    t: int
    lr: float
    prev_lr: float
    order: tuple[int, ...]
    order_known: bool
    sizes: tuple[int, ...]
    phase: str
    phase_step: int
    error: torch.Tensor
    server_error: torch.Tensor
    momentum: torch.Tensor
    search: dict = field(default_factory=dict)


class MergeComp(CentralizedBase):
    """dist-EF-SGD scheduled in groups overlapped with backward; see the module docstring."""

    shards_flat = False  # it schedules the layers

    name = "mergecomp"
    Config = MergeCompConfig
    summary = "MergeComp (Wang et al. 2021, arXiv:2103.15195): efsgd compressed in merged groups, overlapped with backward"

    def __init__(self, config: MergeCompConfig, comm: Any) -> None:
        super().__init__(config, comm)
        self.numels: list[int] = []  # per tensor, from the layout given to setup
        self.n_tensors = 0
        self.spec = _compress.build(config.compressor).spec
        self.reduce = self.spec == "identity"  # linear: all-reduce the values
        #: with ``keep_timeline``: this step's (event, group or tensor position, time);
        #: ``last_timeline`` is the previous step's (events: grad, encode, launch, done,
        #: step, received)
        self.timeline: list[tuple[str, int, float]] = []
        self.last_timeline: list[tuple[str, int, float]] = []
        self.keep_timeline = False
        self._models: list[Any] = []
        self._hooks: list[Any] = []
        self._codecs: dict[tuple[int, int], tuple[Any, ErrorFeedback]] = {}
        self._last_end: float | None = None
        #: the fitted :class:`CostModel` of this process (``--merge N`` and ``auto``)
        self.cost_model: CostModel | None = None
        #: the groups of the current partition, set by _layout: each group's span of the
        #: flat vector, its tensors' bounds, and how many tensors it holds
        self._slices: list[tuple[int, int]] = []
        self._tensor_bounds: list[tuple[int, ...]] = []
        self._group_tensors: list[int] = []
        self._reset_step()

    # ---------------------------------------------------------------- set-up
    @classmethod
    def momentum_of(cls, config: Any) -> float:
        return config.momentum

    def wire_format(self) -> WireFormat:
        """The scheduled compressor's payloads (``blocksign``: one block per tensor)."""
        comp = _compress.build(self.config.compressor)
        if comp.name == "identity":
            return WireFormat("fp32", 32.0)
        return WireFormat(comp.spec, comp.code_bits(sum(self.numels) or 1))

    def setup(self, X: torch.Tensor, layout: ParamLayout | None = None) -> None:
        m, d = X.shape
        layout = self._take_layout(X, layout)
        self.numels = [n for n in layout.numels]
        self.n_tensors = len(self.numels)
        cfg, n = self.config, self.n_tensors
        if isinstance(cfg.merge, int) and cfg.merge > n:
            raise ValueError(f"--merge {cfg.merge}: the model has only {n} parameter tensors")
        mode = cfg.merge
        fixed = mode == "layer" or mode == "whole"
        self.state = MergeCompState(
            t=1, lr=1.0, prev_lr=0.0,
            # provisional: reverse definition order; whole (nothing to overlap) and the
            # simulation (no hooks) keep their order, whole the definition order, so that
            # it is exactly efsgd
            order=tuple(range(n)) if mode == "whole" else tuple(reversed(range(n))),
            order_known=m > 1 or mode == "whole",
            sizes=Partition.whole(n).sizes if mode == "whole" else Partition.layer(n).sizes,
            phase="done" if fixed else "order",
            phase_step=0,
            error=X.new_zeros(m, d),
            server_error=X.new_zeros(1, d),
            momentum=X.new_zeros(m, d) if cfg.momentum > 0 else X.new_zeros(0),
            search={"mode": str(mode)},
        )
        if not fixed and m > 1:
            raise ValueError(
                f"--merge {mode} times the backward pass of one node per process: run it under "
                "torchrun (or --simulate 1); --merge layer, whole work with any --simulate"
            )
        self._layout()

    def attach(self, models: list[Any]) -> None:
        """Register the gradient hooks (one model per process: overlap; else none)."""
        self.detach()
        self._models = list(models)
        if len(models) != 1:
            return
        trainable = [p for p in models[0].parameters() if p.requires_grad]  # the layout's tensors
        for j, p in enumerate(trainable):
            self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(j)))

    def detach(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    @property
    def payload_compressor(self) -> Any:
        return _compress.build(self.config.compressor)

    @property
    def partition(self) -> Partition:
        return Partition(self.state.sizes)

    def set_partition(self, partition: Partition | tuple[int, ...]) -> None:
        """Use this partition from the next step on and stop any search (call it the same
        way on every rank). The memories keep their values."""
        sizes = tuple(partition.sizes if isinstance(partition, Partition) else Partition(tuple(partition)).sizes)
        if sum(sizes) != self.n_tensors:
            raise ValueError(f"the partition covers {sum(sizes)} tensors, the model has {self.n_tensors}")
        self.state.phase, self.state.phase_step = "done", 0
        self._relayout(sizes=sizes)

    # ---------------------------------------------------------------- layout
    def _layout(self) -> None:
        """Index maps and group slices for the current order and partition."""
        st = self.state
        offs, o = [], 0
        for nm in self.numels:
            offs.append(o)
            o += nm
        self._param_off = offs
        pos_off, idx, p = {}, [], 0
        for j in st.order:
            pos_off[j] = p
            idx.append(torch.arange(offs[j], offs[j] + self.numels[j]))
            p += self.numels[j]
        self._pos_of_tensor = {j: k for k, j in enumerate(st.order)}
        self._layout_index = torch.cat(idx)  # layout position -> flat parameter index
        self._param_index = torch.empty_like(self._layout_index)
        self._param_index[self._layout_index] = torch.arange(self._layout_index.numel())
        part = Partition(st.sizes)
        self._group_of_pos = part.group_of()
        lay_numels = [self.numels[j] for j in st.order]
        self._slices, self._tensor_bounds = [], []
        for a, b in part.bounds:
            start = sum(lay_numels[:a])
            self._slices.append((start, start + sum(lay_numels[a:b])))
            rel, q = [], 0
            for nm in lay_numels[a:b]:
                rel.append(q)
                q += nm
            self._tensor_bounds.append(tuple(rel))
        self._group_tensors = [b - a for a, b in part.bounds]
        self._pos_off = [sum(lay_numels[:q]) for q in range(len(lay_numels))]
        self._reset_step()

    def _relayout(self, order: tuple[int, ...] | None = None, sizes: tuple[int, ...] | None = None) -> None:
        """Switch order and/or partition; the memories move with their values."""
        st = self.state
        if order is not None and tuple(order) != st.order:
            old_param_index = self._param_index
            st.order = tuple(order)
            self._layout()
            for name in ("error", "server_error", "momentum"):
                T = getattr(st, name)
                if T.numel():
                    setattr(st, name, T[:, old_param_index][:, self._layout_index].contiguous())
        if sizes is not None:
            st.sizes = tuple(sizes)
        self._layout()

    def _codec(self, k: int) -> tuple[Any, ErrorFeedback]:
        key = (self._slices[k], self._tensor_bounds[k])
        if key not in self._codecs:
            if self.spec.startswith("blocksign"):
                comp = _compress.build("blocksign", offsets=self._tensor_bounds[k])
            else:
                comp = _compress.build(self.config.compressor)
            self._codecs[key] = (comp, ErrorFeedback(comp))
        return self._codecs[key]

    # ---------------------------------------------------------------- per step
    def _reset_step(self) -> None:
        groups = len(self._slices)
        self._buf: torch.Tensor | None = None
        self._out: torch.Tensor | None = None
        self._missing = list(self._group_tensors)
        self._seen: set[int] = set()
        self._fired: list[int] = []
        self._launched = [False] * groups
        self._finished = [False] * groups
        self._handles: list[Any] = [None] * groups
        self._next = 0
        self._times: dict[str, Any] = {"hook_in": {}, "hook_out": {}, "enc": {}, "comm": {}, "dec": {}}
        if self.timeline:
            self.last_timeline = self.timeline
        self.timeline = []

    def _mark(self, event: str, k: int) -> None:
        if self.keep_timeline:
            self.timeline.append((event, k, perf_counter()))

    def _buffers(self, like: torch.Tensor) -> None:
        if self._buf is None:
            m, d = like.shape[0], self._layout_index.numel()
            self._buf = like.new_zeros(m, d)
            self._out = like.new_empty(m, d)

    def _overlapping(self) -> bool:
        st = self.state
        return bool(self._hooks) and st.order_known and st.phase in ("trial", "done")

    def _profiling(self) -> bool:
        return bool(self._hooks) and self.state.phase == "profile"

    def _make_hook(self, j: int) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            self._on_grad(j, p)

        return hook

    @torch.no_grad()
    def _on_grad(self, j: int, p: torch.Tensor) -> None:
        st = self.state
        if st is None or p.grad is None:
            return
        t_in = perf_counter()
        self._fired.append(j)
        if not (self._overlapping() or self._profiling()):
            return  # learning the order, or no overlap: everything happens at the step
        pos = self._pos_of_tensor[j]
        k = self._group_of_pos[pos]
        if pos in self._seen:
            raise RuntimeError(
                f"mergecomp: the gradient of parameter {j} was produced twice in one step; "
                "overlap needs exactly one backward() per optimizer step"
            )
        self._seen.add(pos)
        self._buffers(p.grad.reshape(1, -1))
        lo = self._pos_off[pos]
        self._buf[0, lo : lo + p.grad.numel()].copy_(p.grad.reshape(-1))
        self._mark("grad", pos)
        self._missing[k] -= 1
        if self._profiling():
            self._times["hook_in"][pos] = t_in
        # launch, in group order, every group whose gradients are all in
        while self._next < len(self._slices) and self._missing[self._next] == 0:
            g = self._next
            self._next += 1
            self._launch(g)
            if self._profiling():  # each tensor alone: encode, send, decode, timed apart
                t0 = perf_counter()
                self._handles[g].wait()
                self._times["comm"][g] = perf_counter() - t0
                self._finish(g)
        if self._profiling():
            self._times["hook_out"][pos] = perf_counter()
        elif self.keep_timeline:  # what of the in-flight work has completed by now
            for g in range(self._next):
                if self._handles[g] is not None and not self._finished[g] and self._handles[g].is_completed():
                    if not any(e == "done" and q == g for e, q, _ in self.timeline):
                        self._mark("done", g)

    def _launch(self, k: int) -> None:
        st, cfg, ledger = self.state, self.config, self.comm.ledger
        a, b = self._slices[k]
        t0 = perf_counter()
        self._mark("encode", k)
        with ledger.phase("compress"):
            mom = st.momentum[:, a:b] if cfg.momentum > 0 else st.momentum
            V = ef_momentum(self._buf[:, a:b], mom, cfg.momentum)
            if self.reduce:  # identity: e stays 0, the values themselves are reduced
                payload = V.clone()
            else:
                comp, fb = self._codec(k)
                keys = node_keys(cfg.seed, self.comm.nodes, st.t, 2 * k)
                payload = ef_push(fb, V, st.error[:, a:b], ratio=self._lr_ratio(), keys=keys, tag=step_tag(st.t))
        self._times["enc"][k] = perf_counter() - t0
        self._mark("launch", k)
        with ledger.phase("communicate"):
            if self.reduce:
                self._handles[k] = self.comm.all_reduce_async(payload, op="mean")
            else:
                self._handles[k] = self.comm.all_gather_async(payload)
        self._launched[k] = True

    def _finish(self, k: int) -> None:
        st, cfg, ledger = self.state, self.config, self.comm.ledger
        a, b = self._slices[k]
        res = self._handles[k].wait()
        self._mark("received", k)
        t0 = perf_counter()
        with ledger.phase("compress"):
            m = self._out.shape[0]
            if self.reduce:
                pulled = res[:1]
            else:
                comp, fb = self._codec(k)
                pulled = ef_pull(fb, res, st.server_error[:, a:b], numel=b - a, ratio=self._lr_ratio(),
                                 key=shared_key(cfg.seed, st.t, 2 * k + 1), tag=step_tag(st.t),
                                 dtype=self._out.dtype)
            self._out[:, a:b] = pulled.expand(m, b - a)
        self._times["dec"][k] = perf_counter() - t0
        self._finished[k] = True
        self._handles[k] = None

    @torch.no_grad()
    def reduce_gradients(self, G: torch.Tensor) -> None:
        st = self.state
        t_step = perf_counter()
        self._mark("step", -1)
        self._buffers(G)
        if self._next < len(self._slices):
            # groups whose gradients did not all arrive through hooks (no overlap, unused
            # parameters): take them from G, then launch in order
            lay = G[:, self._layout_index.to(G.device)]
            for k in range(self._next, len(self._slices)):
                a, b = self._slices[k]
                self._buf[:, a:b] = lay[:, a:b]
            while self._next < len(self._slices):
                self._next += 1
                self._launch(self._next - 1)
        for k in range(len(self._slices)):
            if not self._finished[k]:
                self._finish(k)
        G.copy_(self._out[:, self._param_index.to(G.device)])
        now = perf_counter()
        iter_s = None if self._last_end is None else now - self._last_end
        self._advance(iter_s, t_step)
        self._last_end = perf_counter()
        st.prev_lr = st.lr
        st.t += 1

    # ---------------------------------------------------------------- the schedule
    def _emit(self, line: str) -> None:
        self.state.search.setdefault("log", []).append(line)
        self._say(line)

    def _advance(self, iter_s: float | None, t_step: float) -> None:
        """End of a step: move the schedule on (same decisions on every rank)."""
        st, cfg = self.state, self.config
        if not st.order_known:
            self._learn_order()
        if st.phase == "order":
            st.phase, st.phase_step = "profile", 0
            self._reset_step()
            return
        if st.phase == "profile":
            self._record_profile(t_step)
            st.phase_step += 1
            if st.phase_step >= cfg.profile_steps:
                self._fit_and_plan()
            self._reset_step()
            return
        if st.phase == "trial":
            s = st.search
            y = s["trying"]
            k = st.phase_step  # step k of the trial: candidate plan[k % Y], round k // Y
            ys = s["plan"]
            if k >= len(ys) and iter_s is not None:  # round 0 warms every candidate up
                s["trial_times"].setdefault(str(y), []).append(iter_s)
            st.phase_step += 1
            if st.phase_step >= len(ys) * (cfg.trial_steps + 1):
                self._trials_done()
            else:
                self._try(ys[st.phase_step % len(ys)])
            self._reset_step()
            return
        self._reset_step()

    def _learn_order(self) -> None:
        st, n = self.state, self.n_tensors
        fired, seen = [], set()
        for j in self._fired:
            if j not in seen:
                seen.add(j)
                fired.append(j)
        order = fired + [j for j in reversed(range(n)) if j not in seen]
        order = self._bcast([order])[0] if len(order) == n else list(reversed(range(n)))
        st.order_known = True
        self._relayout(order=tuple(int(j) for j in order))
        self._emit(f"mergecomp: backward order learnt ({n} tensors)")

    def _bcast(self, rows: list[list[float]]) -> list[list[float]]:
        """Rank 0's table of numbers, on every rank (a collective; not counted)."""
        width = max(len(r) for r in rows)
        T = torch.full((len(rows), width), float("nan"), dtype=torch.float64)
        for i, r in enumerate(rows):
            T[i, : len(r)] = torch.tensor(r, dtype=torch.float64)
        m = len(self.comm.nodes)
        flat = T.reshape(1, -1).expand(m, -1).contiguous()
        got = self.comm.broadcast(flat, 0, record=False)[0].reshape(T.shape)
        out = []
        for i, r in enumerate(rows):
            vals = got[i]
            vals = vals[~torch.isnan(vals)]
            out.append([int(v) if float(v).is_integer() else float(v) for v in vals.tolist()])
        return out

    def _record_profile(self, t_step: float) -> None:
        """One layer-wise step's costs, per tensor in backward order."""
        s, tm = self.state.search, self._times
        n = self.n_tensors
        if len(tm["hook_in"]) != n or self._last_end is None:
            return  # a tensor without gradient, or no previous step to time from
        prof = s.setdefault("profile", {"head": [], "compute": [], "enc": [], "comm": [], "dec": []})
        ins, outs = tm["hook_in"], tm["hook_out"]
        prof["head"].append(ins[0] - self._last_end)
        prof["compute"].append([0.0] + [max(ins[p] - outs[p - 1], 0.0) for p in range(1, n)])
        for key in ("enc", "comm", "dec"):
            prof[key].append([tm[key][k] for k in range(n)])

    def _fit_and_plan(self) -> None:
        st, cfg = self.state, self.config
        s, n = st.search, self.n_tensors
        prof = s.get("profile")
        lay = [self.numels[j] for j in st.order]
        if prof and prof["head"]:
            med = lambda rows: [statistics.median(c) for c in zip(*rows)]  # noqa: E731
            model = CostModel(
                numels=tuple(lay), compute=tuple(med(prof["compute"])), head=statistics.median(prof["head"]),
                encode=fit_linear(lay, med(prof["enc"])), decode=fit_linear(lay, med(prof["dec"])),
                comm=fit_linear(lay, med(prof["comm"])),
            )
            want = [cfg.merge] if isinstance(cfg.merge, int) else list(range(1, min(cfg.max_groups, n) + 1))
            self.cost_model = model
            plans = [list(best_partition(model, y).sizes) for y in want]
            preds = [model.predict(Partition(tuple(p))) for p in plans]
            fit = model.to_dict()
        else:  # nothing measured (e.g. a parameter never got a gradient): even split
            want = [cfg.merge] if isinstance(cfg.merge, int) else [1]
            plans = [_even(n, y) for y in want]
            preds = [float("nan")] * len(plans)
            fit = None
        # rank 0 decides; every rank takes its plans
        plans = self._bcast(plans)
        s["model"] = fit
        s["candidates"] = {str(len(p)): {"sizes": p, "predicted_s": f} for p, f in zip(plans, preds)}
        s.pop("profile", None)
        if fit is not None:
            self._emit(
                "mergecomp: cost model h(x) = {:.3g} s + {:.3g} s/value, g(x) = {:.3g} s + {:.3g} s/value".format(
                    fit["h"]["base"], fit["h"]["per_value"], fit["g"]["base"], fit["g"]["per_value"])
            )
        if isinstance(cfg.merge, int):
            self._choose(plans[0], f"--merge {cfg.merge}")
        else:
            s["trial_times"] = {}
            s["plan"] = sorted(int(k) for k in s["candidates"])
            st.phase, st.phase_step = "trial", 0
            self._try(s["plan"][0])

    def _try(self, y: int) -> None:
        st = self.state
        st.phase = "trial"
        st.search["trying"] = y
        self._relayout(sizes=tuple(st.search["candidates"][str(y)]["sizes"]))

    def _trials_done(self) -> None:
        """Alg. 2 on the measured median iteration times (rank 0's, broadcast)."""
        st, cfg = self.state, self.config
        s = st.search
        ys = s["plan"]
        mine = [statistics.median(s["trial_times"].get(str(y), [])) if s["trial_times"].get(str(y)) else float("inf")
                for y in ys]
        (agreed,) = self._bcast([mine])
        for y, f in zip(ys, agreed):
            s["candidates"][str(y)]["measured_s"] = float(f)
        fmin = dict(zip(ys, (float(f) for f in agreed)))
        chosen, _ = alg2(lambda q: fmin[q], max(ys), cfg.alpha)
        self._choose(s["candidates"][str(chosen)]["sizes"], f"Alg. 2 (Y = {cfg.max_groups}, alpha = {cfg.alpha:g})")

    def _choose(self, sizes: list[int], why: str) -> None:
        st = self.state
        st.phase, st.phase_step = "done", 0
        st.search.pop("trying", None)
        st.search.pop("plan", None)
        st.search["chosen"] = list(sizes)
        self._relayout(sizes=tuple(int(v) for v in sizes))
        self._emit(f"mergecomp: partition {self.partition} chosen by {why} at step {st.t}")

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict:
        sd = super().state_dict()
        sd["search"] = copy.deepcopy(sd["search"])
        return sd

    def load_state_dict(self, sd: dict) -> None:
        super().load_state_dict(sd)
        st = self.state
        st.order, st.sizes = tuple(int(j) for j in st.order), tuple(int(v) for v in st.sizes)
        st.search = copy.deepcopy(st.search)
        self._layout()
        if st.phase == "done" and self.config.merge not in ("layer", "whole"):
            self._say(f"mergecomp: partition {self.partition} restored from the checkpoint")

    def summary_fields(self) -> dict[str, Any]:
        """summary.json's ``merge``: the schedule (the same dict as ``report``)."""
        return {"merge": self.report()}

    def report(self) -> dict:
        """What the schedule measured and decided (for logs and summaries)."""
        s = self.state.search
        return {
            "mode": str(self.config.merge),
            "groups": len(self.state.sizes),
            "sizes": list(self.state.sizes),
            "phase": self.state.phase,
            "model": s.get("model"),
            "candidates": s.get("candidates"),
            "log": list(s.get("log", [])),
        }


def _even(n: int, y: int) -> list[int]:
    """y groups with as equal a number of tensors as possible."""
    base, extra = divmod(n, y)
    return [base + (1 if k < extra else 0) for k in range(y)]
