"""Training among nodes that may not be honest: attacks, robust aggregation rules, clipping.

Three kinds of object, each built from a spec string at the edge (``name:key=value,...``):

* an **attack** (:func:`parse_attack`, :data:`ATTACKS`): what a Byzantine node sends
  instead of its honest message. :class:`Adversary` holds the attackers (a seeded draw,
  :func:`choose_attackers`) and crafts their rows of a batch of outgoing messages:

  - ``signflip``: the negated honest message;
  - ``scaled:factor=F``: ``F`` times the honest message;
  - ``gaussian:sigma=S``: the honest message plus ``N(0, S^2 I)`` noise;
  - ``alie[:z=Z]``: "A Little Is Enough" (Baruch, Baruch and Goldberg, arXiv:1902.06156):
    ``mu - z sigma``, the coordinate-wise mean and standard deviation of the honest
    messages, ``z`` from the paper's count of supporters unless given;
  - ``ipm:eps=E``: inner-product manipulation ("Fall of Empires", Xie, Koyejo and Gupta,
    arXiv:1903.03936): ``-E`` times the mean of the honest messages;
  - ``labelflip``: honest computation on flipped labels (``y -> C - 1 - y``): the
    messages are the honest ones of a poisoned node (:meth:`Adversary.flip_labels`);
  - ``lazy[:every=E]``: a stale copy of an earlier message, computed afresh only every
    ``E`` exchanges (the ``step`` the algorithm passes to :meth:`Adversary.craft` counts
    its exchanges: a gossip method's with ``local_steps`` > 1 and a periodic method's
    rounds, not their local steps).

  ``alie`` and ``ipm`` are omniscient: they read the honest messages of every node, as
  their papers assume; a batch that does not hold them (one rank of a distributed run)
  is refused.
* an **aggregator** (:func:`parse_aggregator`, :data:`AGGREGATORS`) for the messages of
  all nodes: ``mean``, coordinate-wise ``median`` and ``trimmed:f=F`` (Yin, Chen,
  Ramchandran and Bartlett, arXiv:1803.01498), and ``cclip[:tau=T,iters=L,beta=B]``,
  centered clipping around the previous aggregate of the workers' momenta (Karimireddy,
  He and Jaggi, "Learning from History for Byzantine Robust Optimization",
  arXiv:2012.10333), with a fixed radius ``tau`` or, without it, an adaptive one: at
  each clipping step the median of the senders' distances to the centre
  (:meth:`Aggregator.scales`); ``beta`` is the workers' momentum (torch's convention,
  ``m <- beta m + g``; the algorithm applies it before the message is sent, so the
  local optimizer then has none). They work on one
  shard of coordinates at a time (:meth:`Aggregator.__call__`), so the sharded layout
  applies them where the shard is owned.
* **ClippedGossip** (:func:`parse_robust`, He, Karimireddy and Jaggi, "Byzantine-robust
  Decentralized Learning via ClippedGossip", arXiv:2202.01545): :func:`clipped_mix`.

Pure tensor code: nothing here communicates.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import torch

__all__ = [
    "AGGREGATORS", "ATTACKS", "ROBUST", "Adversary", "Aggregator", "AttackSpec", "ClippedGossipSpec",
    "alie_z", "choose_attackers", "clipped_mix", "parse_aggregator", "parse_attack", "parse_robust",
]

#: attack -> its parameters and their defaults
ATTACKS: dict[str, dict[str, float]] = {
    "signflip": {},
    "scaled": {"factor": -4.0},
    "gaussian": {"sigma": 1.0},
    "alie": {"z": float("nan")},  # nan: the paper's z from n and the number of attackers
    "ipm": {"eps": 0.1},
    "labelflip": {},
    "lazy": {"every": 50.0},
}
#: attacks that read every honest message (omniscient)
OMNISCIENT = ("alie", "ipm")
#: aggregator -> its parameters and their defaults (None: required)
AGGREGATORS: dict[str, dict[str, float | None]] = {
    "mean": {},
    "median": {},
    "trimmed": {"f": None},
    "cclip": {"tau": float("nan"), "iters": 1.0, "beta": 0.0},  # nan: the adaptive radius
}
#: the robust gossip rules of the decentralized family
ROBUST: dict[str, dict[str, float | None]] = {
    "clippedgossip": {"b": 1.0, "tau": float("nan")},
}


def _parse(spec: Any, table: dict[str, dict[str, Any]], what: str) -> tuple[str, dict[str, float]]:
    """``name:key=value,...`` -> (name, parameters with defaults); one line on bad input."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"{what} must be a spec string NAME[:key=value,...], got {spec!r}; "
                         f"accepted: {', '.join(table)}")
    name, _, rest = spec.strip().partition(":")
    if name not in table:
        raise ValueError(f"unknown {what} {name!r}; accepted: {', '.join(table)}")
    params: dict[str, Any] = dict(table[name])
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or key not in table[name]:
            keys = ", ".join(table[name]) or "none"
            raise ValueError(f"{what} {name!r}: bad parameter {item!r}; its parameters: {keys}")
        try:
            v = float(value)
        except ValueError:
            raise ValueError(f"{what} {name}: {key} must be a number, got {value!r}") from None
        if not math.isfinite(v):
            raise ValueError(f"{what} {name}: {key} must be finite, got {value!r}")
        params[key] = v
    missing = [k for k, v in params.items() if v is None]
    if missing:
        raise ValueError(f"{what} {name} needs {', '.join(f'{k}=' for k in missing)} "
                         f"(e.g. {name}:{missing[0]}=1)")
    return name, params


@dataclasses.dataclass(frozen=True)
class AttackSpec:
    """A parsed ``--attack``: its name and its parameters (defaults filled in)."""

    name: str
    params: tuple[tuple[str, float], ...] = ()

    def get(self, key: str) -> float:
        return dict(self.params)[key]

    @property
    def omniscient(self) -> bool:
        return self.name in OMNISCIENT

    @property
    def spec(self) -> str:
        shown = [(k, v) for k, v in self.params if not (isinstance(v, float) and math.isnan(v))]
        return self.name + (":" + ",".join(f"{k}={v:g}" for k, v in shown) if shown else "")


def parse_attack(spec: Any) -> AttackSpec:
    """``--attack`` as an :class:`AttackSpec`; a bad spec raises one line."""
    name, params = _parse(spec, ATTACKS, "attack")
    if name == "lazy" and (params["every"] < 1 or params["every"] != int(params["every"])):
        raise ValueError(f"attack lazy: every must be an integer >= 1, got {params['every']:g}")
    if name == "gaussian" and params["sigma"] < 0:
        raise ValueError(f"attack gaussian: sigma must be >= 0, got {params['sigma']:g}")
    return AttackSpec(name, tuple(params.items()))


def choose_attackers(n: int, k: int, seed: int) -> tuple[int, ...]:
    """``k`` of the ``n`` nodes, drawn from the run's seed (the same on every process):
    ascending ids. ``k`` must be below ``n / 2``: a Byzantine majority defeats every rule."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"--byzantine must be a non-negative integer, got {k!r}")
    if 2 * k >= n:
        raise ValueError(f"--byzantine {k} of {n} nodes: the attackers must be fewer than half the nodes "
                         f"(K < n/2, here K <= {(n - 1) // 2}); no aggregation survives a Byzantine majority")
    rng = np.random.default_rng([int(seed) & 0xFFFFFFFF, 0xB12A, n, k])
    return tuple(sorted(int(i) for i in rng.choice(n, size=k, replace=False)))


def alie_z(n: int, k: int) -> float:
    """The paper's ``z_max`` (arXiv:1902.06156, Sec. 4): ``s = floor(n/2 + 1) - k``
    supporters needed, ``z = Phi^{-1}((n - k - s) / (n - k))``."""
    from statistics import NormalDist

    s = math.floor(n / 2 + 1) - k
    p = (n - k - s) / (n - k)
    p = min(max(p, 1e-6), 1 - 1e-6)
    return float(NormalDist().inv_cdf(p))


class Adversary:
    """The attackers of a run and their attack.

    ``attackers``: the Byzantine node ids; ``n``: the number of nodes; ``seed``: the
    seed of the gaussian attack's noise (a pure function of seed, node and step).
    :meth:`craft` rewrites the attackers' rows of a batch of outgoing messages.
    """

    def __init__(self, attack: AttackSpec, attackers: tuple[int, ...], n: int, *, seed: int = 0) -> None:
        self.attack, self.attackers, self.n, self.seed = attack, tuple(attackers), int(n), int(seed)
        self._set = set(self.attackers)
        self._stale: dict[tuple[str, int], torch.Tensor] = {}

    def __repr__(self) -> str:
        return f"Adversary({self.attack.spec}, attackers={list(self.attackers)}, n={self.n})"

    def rows(self, nodes: torch.Tensor) -> list[int]:
        """The hosted rows that are attackers."""
        return [r for r, i in enumerate(nodes.tolist()) if int(i) in self._set]

    @property
    def crafts_messages(self) -> bool:
        """False for ``labelflip``: its messages are honest computations on bad data."""
        return self.attack.name != "labelflip"

    def check_hosting(self, m: int, what: str) -> None:
        """An omniscient attack needs every honest message in the batch it crafts."""
        if self.attack.omniscient and m != self.n:
            raise ValueError(f"--attack {self.attack.name} is omniscient (it reads every honest node's message) "
                             f"and needs the nodes in one process: run it with --simulate N; under torchrun use "
                             f"signflip, scaled, gaussian, labelflip or lazy ({what})")

    @torch.no_grad()
    def craft(self, M: torch.Tensor, nodes: torch.Tensor, step: int, *, stream: str = "msg") -> torch.Tensor:
        """``M`` (m, d) with the attackers' rows replaced by what they send at ``step``:
        ``M`` itself where no hosted row is an attacker or the attack does not craft,
        else a new tensor (``M`` is left alone: it may be the node's own model)."""
        bad = self.rows(nodes)
        if not bad or not self.crafts_messages:
            return M
        a = self.attack
        out = M.clone()
        idx = torch.tensor(bad, dtype=torch.long, device=M.device)
        if a.name == "signflip":
            out[idx] = -M[idx]
        elif a.name == "scaled":
            out[idx] = a.get("factor") * M[idx]
        elif a.name == "gaussian":
            for r in bad:
                g = torch.Generator().manual_seed((self.seed * 1_000_003 + int(nodes[r]) * 7919 + step) & (2**63 - 1))
                noise = torch.randn(M.shape[1], generator=g, dtype=torch.float32).to(M.device, M.dtype)
                out[r] = M[r] + a.get("sigma") * noise
        elif a.name in OMNISCIENT:
            self.check_hosting(M.shape[0], "craft")
            honest = [r for r in range(M.shape[0]) if r not in set(bad)]
            H = M[honest]
            mu = H.mean(0)
            if a.name == "alie":
                z = a.get("z")
                z = alie_z(self.n, len(self.attackers)) if math.isnan(z) else z
                out[idx] = mu - z * H.std(0, unbiased=len(honest) > 1)
            else:
                out[idx] = -a.get("eps") * mu
        elif a.name == "lazy":
            every = int(a.get("every"))
            for r in bad:
                key = (stream, int(nodes[r]))
                if key not in self._stale or step % every == 0:
                    self._stale[key] = M[r].clone()
                out[r] = self._stale[key]
        return out

    def flip_labels(self, y: torch.Tensor, nodes: torch.Tensor, num_classes: int) -> torch.Tensor:
        """``labelflip``: the attackers' rows of a batch of labels (one row per hosted
        node, or one batch where a single node is hosted) as ``C - 1 - y``."""
        if self.attack.name != "labelflip":
            return y
        bad = self.rows(nodes)
        if not bad:
            return y
        y = y.clone()
        if y.dim() >= 1 and y.shape[0] == len(nodes) and len(nodes) > 1:
            for r in bad:
                y[r] = num_classes - 1 - y[r]
        else:
            y = num_classes - 1 - y
        return y

    def describe(self) -> dict[str, Any]:
        return {"attack": self.attack.spec, "attackers": list(self.attackers)}


class Aggregator:
    """A rule over the ``k`` messages of one shard: ``agg(Q, j) -> (L,)`` where ``Q`` is
    ``(k, L)``, one row per sender. ``cclip`` keeps its centre (the previous aggregate,
    the "history" of arXiv:2012.10333), one per shard ``j``.

    ``cclip``'s radius is fixed (``tau``) or adaptive (``tau`` unset): at each clipping
    step, the median of the senders' distances to the centre (the lower of the two
    middle ones for an even count). Fewer than half the senders are Byzantine, so that
    median lies between two honest senders' distances: the attackers cannot widen it,
    and it follows the honest momenta's spread as it grows and shrinks over training,
    where a fixed radius is too wide early (when every message is short, an attack
    passes unclipped) or too narrow late. About half the honest messages are clipped at
    each step; ``iters`` steps bring the centre to them.

    ``dim``: the length of the whole message whose shards the rule sees (None: each call
    sees a whole message). A fixed ``tau`` is a radius for the whole message, as in the
    paper; a shard of ``L`` of its ``dim`` values is clipped to ``tau * sqrt(L / dim)``
    (:meth:`radius`). The shards' radii then add up, in squares, to ``tau**2``: a
    sender's clipped difference, all shards together, is at most ``tau`` long, the bound
    the paper's rule gives it. The same ``tau`` on every shard would let each sender
    move the aggregate ``sqrt(n)`` times as far over ``n`` shards. (The adaptive radius
    of a shard is the median over that shard's distances.)"""

    def __init__(self, name: str, params: dict[str, float]) -> None:
        self.name, self.params = name, dict(params)
        self.center: dict[int, torch.Tensor] = {}
        self.dim: int | None = None

    @property
    def adaptive(self) -> bool:
        """``cclip`` without ``tau``: the median distance as the radius."""
        return self.name == "cclip" and math.isnan(self.params["tau"])

    def radius(self, width: int, norms: torch.Tensor | None = None) -> torch.Tensor | float:
        """``cclip``'s radius for a shard of ``width`` values: the median of ``norms``
        (the senders' distances over the shard) where it is adaptive, else the whole
        radius ``tau`` where ``dim`` is unset or the shard is the whole message, else the
        shard's share of it."""
        if self.adaptive:
            if norms is None:
                raise ValueError("cclip's adaptive radius needs the senders' distances")
            return norms.median()
        tau = self.params["tau"]
        if self.dim is None or width >= self.dim:
            return tau
        return tau * math.sqrt(width / self.dim)

    @property
    def spec(self) -> str:
        p = ",".join(f"{k}={v:g}" for k, v in self.params.items() if not math.isnan(v))
        return self.name + (f":{p}" if p else "")

    @property
    def is_mean(self) -> bool:
        return self.name == "mean"

    def check_nodes(self, n: int, flag: str = "--aggregator") -> None:
        if self.name == "trimmed":
            f = self.params["f"]
            if f != int(f) or f < 0 or 2 * f >= n:
                raise ValueError(f"{flag} trimmed:f={f:g} over {n} nodes: f must be an integer with "
                                 f"0 <= f < n/2 (here f <= {(n - 1) // 2}), as 2f values of each coordinate are dropped")

    @torch.no_grad()
    def __call__(self, Q: torch.Tensor, j: int = 0) -> torch.Tensor:
        Q = Q.to(torch.float32)
        k = Q.shape[0]
        if self.name == "mean":
            return Q.mean(0)
        if self.name == "median":
            # the true median of an even count: the mean of the two middle values
            s = Q.sort(0).values
            return (s[(k - 1) // 2] + s[k // 2]) / 2
        if self.name == "trimmed":
            f = int(self.params["f"])
            self.check_nodes(k)
            s = Q.sort(0).values
            return s[f: k - f].mean(0)
        # cclip: v <- v + mean_i clip(m_i - v, tau), iters times, from the last aggregate
        iters = int(self.params["iters"])
        v = self.center.get(j)
        if v is None or v.shape[0] != Q.shape[1]:
            v = torch.zeros(Q.shape[1], dtype=Q.dtype, device=Q.device)
        for _ in range(max(1, iters)):
            D = Q - v
            norms = D.norm(dim=1, keepdim=True)
            v = v + (D * _clip_factors(norms, self.radius(Q.shape[1], norms))).mean(0)
        self.center[j] = v.clone()
        return v

    def scales(self, sq: torch.Tensor) -> torch.Tensor:
        """``cclip``'s factor (k, 1) for each sender, from its squared distance ``sq`` (k,)
        to the centre over the whole message: ``min(1, tau / ||m_i - v||)``, ``tau``
        fixed or the median of the distances."""
        norms = sq.sqrt().unsqueeze(1)
        return _clip_factors(norms, self.radius(self.dim or 0, norms))  # the whole message's radius

    def state(self) -> dict[int, torch.Tensor]:
        return {j: v.clone() for j, v in self.center.items()}


def _clip_factors(norms: torch.Tensor, tau: Any) -> torch.Tensor:
    """``min(1, tau / ||d||)`` for each distance in ``norms``: the factor that clips a
    difference of that length to the radius ``tau`` (a number or a 0-d tensor)."""
    return torch.where(norms > tau, tau / norms.clamp_min(1e-30), torch.ones_like(norms))


def parse_aggregator(spec: Any) -> Aggregator:
    """``--aggregator`` as an :class:`Aggregator`; a bad spec raises one line."""
    name, params = _parse(spec, AGGREGATORS, "aggregator")
    if name == "cclip":
        if params["tau"] <= 0:
            raise ValueError(f"aggregator cclip: tau must be > 0, got {params['tau']:g}")
        if params["iters"] < 1 or params["iters"] != int(params["iters"]):
            raise ValueError(f"aggregator cclip: iters must be an integer >= 1, got {params['iters']:g}")
        if not 0 <= params["beta"] < 1:
            raise ValueError(f"aggregator cclip: beta (the workers' momentum) must be in [0, 1), got {params['beta']:g}")
    if name == "trimmed" and (params["f"] < 0 or params["f"] != int(params["f"])):
        raise ValueError(f"aggregator trimmed: f must be a non-negative integer, got {params['f']:g}")
    return Aggregator(name, params)


@dataclasses.dataclass(frozen=True)
class ClippedGossipSpec:
    """ClippedGossip's radius: a fixed ``tau``, or (``tau`` unset) the adaptive rule of
    the authors' experiments: each node clips its ``b`` farthest neighbours to the
    distance of the next one."""

    b: int = 1
    tau: float | None = None

    @property
    def spec(self) -> str:
        return "clippedgossip:" + (f"tau={self.tau:g}" if self.tau is not None else f"b={self.b}")


def parse_robust(spec: Any) -> ClippedGossipSpec:
    """``--robust`` as a :class:`ClippedGossipSpec`; a bad spec raises one line."""
    name, params = _parse(spec, ROBUST, "robust rule")
    b, tau = params["b"], params["tau"]
    if b < 0 or b != int(b):
        raise ValueError(f"robust rule clippedgossip: b must be a non-negative integer, got {b:g}")
    if not math.isnan(tau) and tau <= 0:
        raise ValueError(f"robust rule clippedgossip: tau must be > 0, got {tau:g}")
    return ClippedGossipSpec(int(b), None if math.isnan(tau) else float(tau))


@torch.no_grad()
def clipped_mix(Y: torch.Tensor, D: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
                degrees: torch.Tensor, rule: ClippedGossipSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """ClippedGossip's mixing (arXiv:2202.01545, Alg. 1):
    ``x_i <- y_i + sum_{j != i} W_ij CLIP(y_j - y_i, tau_i)``.

    ``Y`` (m, d): the hosted nodes' own half-step models; ``D`` (k, d): the received
    messages; ``index``/``weights``/``degrees``: each hosted node's neighbours (a
    :class:`~gossip.comm.Received`'s). Returns (the new models, each node's ``tau_i``).
    """
    m, width = index.shape
    out = Y.clone()
    taus = torch.zeros(m, dtype=torch.float64)
    if width == 0:
        return out, taus
    for r in range(m):
        deg = int(degrees[r])
        if deg == 0:
            continue
        nb = D[index[r, :deg].to(D.device)]
        diff = nb - Y[r]
        dist = diff.norm(dim=1)
        if rule.tau is not None:
            tau = torch.tensor(rule.tau, dtype=dist.dtype, device=dist.device)
        else:
            ranked = dist.sort(descending=True).values
            tau = ranked[min(rule.b, deg - 1)]
        scale = _clip_factors(dist, tau)
        w = weights[r, :deg].to(dtype=Y.dtype, device=Y.device)
        out[r] += ((w * scale).unsqueeze(1) * diff).sum(0)
        taus[r] = float(tau)
    return out, taus
