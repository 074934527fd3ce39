"""Training algorithms: one module per family, each a Config, a State and a step.

Strings become objects here only: ``build(name, comm, **options)``; ``available()``
lists the names with a one-line description each.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from gossip._registry import Registry

from gossip.algorithms.allreduce import AllReduce, AllReduceConfig
from gossip.algorithms.base import COMMON_OPTIONS, Algorithm, ParamLayout, WireFormat
from gossip.algorithms.efsgd import (
    DistEFSGD,
    EFBlockSGD,
    EFBlockSGDConfig,
    EFBlockSGDM,
    EFBlockSGDMConfig,
    EFSGDConfig,
    SignSGD,
    SignSGDConfig,
    Signum,
    SignumConfig,
)
from gossip.algorithms.localsgd import (
    DiLoCo,
    DiLoCoConfig,
    LocalSGD,
    LocalSGDConfig,
    SlowMo,
    SlowMoConfig,
)
from gossip.algorithms.demo import DeMo, DeMoConfig
from gossip.algorithms.sparseloco import SparseLoCo, SparseLoCoConfig
from gossip.algorithms.noloco import NoLoCo, NoLoCoConfig
from gossip.algorithms.muloco import MuLoCo, MuLoCoConfig
from gossip.algorithms.efmomentum import EFMomentum, EFMomentumConfig
from gossip.algorithms.powersgd import PowerSGD, PowerSGDConfig
from gossip.algorithms.sketched import (
    LocalTopK,
    LocalTopKConfig,
    Sketched,
    SketchedConfig,
    TrueTopK,
    TrueTopKConfig,
)
from gossip.algorithms.choco import Choco, ChocoConfig, ChocoState
from gossip.algorithms.sgp import SGP, SGPConfig, SGPState
from gossip.algorithms.decentralized import (
    DCD,
    DPSGD,
    ECD,
    DCDConfig,
    DPSGDConfig,
    ECDConfig,
    GossipState,
    Naive,
    NaiveConfig,
)

__all__ = [
    "Algorithm",
    "COMMON_OPTIONS",
    "MERGE_OPTIONS",
    "ParamLayout",
    "WireFormat",
    "AllReduce",
    "AllReduceConfig",
    "DPSGD",
    "DPSGDConfig",
    "Naive",
    "NaiveConfig",
    "DCD",
    "DCDConfig",
    "ECD",
    "ECDConfig",
    "GossipState",
    "Choco",
    "ChocoConfig",
    "ChocoState",
    "SGP",
    "SGPConfig",
    "SGPState",
    "DistEFSGD",
    "EFSGDConfig",
    "EFBlockSGD",
    "EFBlockSGDConfig",
    "EFBlockSGDM",
    "EFBlockSGDMConfig",
    "SignSGD",
    "SignSGDConfig",
    "Signum",
    "SignumConfig",
    "PowerSGD",
    "PowerSGDConfig",
    "EFMomentum",
    "EFMomentumConfig",
    "Sketched",
    "SketchedConfig",
    "TrueTopK",
    "TrueTopKConfig",
    "LocalTopK",
    "LocalTopKConfig",
    "LocalSGD",
    "LocalSGDConfig",
    "SlowMo",
    "SlowMoConfig",
    "DiLoCo",
    "DiLoCoConfig",
    "DeMo",
    "DeMoConfig",
    "SparseLoCo",
    "SparseLoCoConfig",
    "NoLoCo",
    "NoLoCoConfig",
    "MuLoCo",
    "MuLoCoConfig",
    "available",
    "build",
    "config_class",
    "is_decentralized",
    "local_momentum_default",
    "local_optimizer_default",
]

#: the algorithms: name -> (class, Config); every part of the project reaches them here
_REGISTRY: Registry[tuple[type[Algorithm], type]] = Registry("algorithm")
for _cls, _cfg in (
    (AllReduce, AllReduceConfig),
    (DPSGD, DPSGDConfig),
    (Naive, NaiveConfig),
    (DCD, DCDConfig),
    (ECD, ECDConfig),
    (Choco, ChocoConfig),
    (SGP, SGPConfig),
    (DistEFSGD, EFSGDConfig),
    (EFBlockSGD, EFBlockSGDConfig),
    (EFBlockSGDM, EFBlockSGDMConfig),
    (SignSGD, SignSGDConfig),
    (Signum, SignumConfig),
    (PowerSGD, PowerSGDConfig),
    (EFMomentum, EFMomentumConfig),
    (Sketched, SketchedConfig),
    (TrueTopK, TrueTopKConfig),
    (LocalTopK, LocalTopKConfig),
    (LocalSGD, LocalSGDConfig),
    (SlowMo, SlowMoConfig),
    (DiLoCo, DiLoCoConfig),
    (DeMo, DeMoConfig),
    (SparseLoCo, SparseLoCoConfig),
    (NoLoCo, NoLoCoConfig),
    (MuLoCo, MuLoCoConfig),
):
    _REGISTRY.register(_cls.name, (_cls, _cfg), _cls.summary)


def available() -> dict[str, str]:
    """Algorithm names and one-line descriptions."""
    return _REGISTRY.available()


def _lookup(name: str) -> tuple[type[Algorithm], type]:
    return _REGISTRY.get(name)


def config_class(name: str) -> type:
    """The Config dataclass of the registered algorithm ``name`` (its options and defaults)."""
    return _lookup(name)[1]


def is_decentralized(name: str) -> bool:
    """Whether the algorithm exchanges with graph neighbours (needs a topology)."""
    return _lookup(name)[0].decentralized


def local_momentum_default(name: str) -> float:
    """Momentum of the CLI's local SGD optimizer when --momentum is unset."""
    return _lookup(name)[0].local_momentum_default


def local_optimizer_default(name: str) -> str:
    """The CLI's local optimizer when --optimizer is unset: "sgd", "adamw" (diloco, ...)
    or "muon" (muloco)."""
    return _lookup(name)[0].local_optimizer_default


def default_topology(name: str) -> str:
    """The CLI's --topology when it is unset: "ring", or "onepeer-exp" for sgp."""
    return _lookup(name)[0].default_topology


#: the EF family's scheduling options: with ``merge`` set, ``build`` returns MergeComp
#: (Wang et al. 2021, arXiv:2103.15195) scheduling that algorithm group by group
MERGE_OPTIONS = ("merge", "merge_max_groups", "merge_alpha", "merge_profile_steps", "merge_trial_steps")
_MERGEABLE = ("efsgd", "efblocksgd", "efblocksgdm")


def _build_mergecomp(name: str, comm: Any, options: dict[str, Any]) -> Algorithm:
    from gossip.algorithms.mergecomp import MergeComp, MergeCompConfig

    if name not in _MERGEABLE:
        raise ValueError(f"merge applies to {', '.join(_MERGEABLE)} (MergeComp schedules the EF family), not {name}")
    sched = {k.removeprefix("merge_"): options.pop(k) for k in MERGE_OPTIONS[1:] if k in options}
    sched["merge"] = options.pop("merge")
    # the scheduled algorithm's own Config: its checks, its defaults, its compressor
    # (efblocksgd's is blocksign: one block per parameter tensor, whatever the grouping)
    base = _config(name, config_class(name), options)
    cfg = MergeCompConfig(compressor=base.compressor, momentum=base.momentum, seed=base.seed, **sched)
    return MergeComp(cfg, comm)


def _config(name: str, cfg_cls: type, options: dict[str, Any]) -> Any:
    try:
        return cfg_cls(**options)
    except TypeError as e:
        accepted = ", ".join(f.name for f in dataclasses.fields(cfg_cls))
        if "unexpected keyword" in str(e):
            raise ValueError(f"{name}: {e}; accepted options: {accepted}") from None
        raise


def build(name: str, comm: Any, *, common: Mapping[str, Any] | None = None, **options: Any) -> Algorithm:
    """``build("ecd", comm, compressor="quant:bits=8", seed=0)``.

    ``options`` go to the algorithm's Config, which must take each of them. ``common``
    holds a caller's values of :data:`COMMON_OPTIONS` (a training run's seed,
    compressor and momentum), which it has for any algorithm: each is passed where the
    Config takes it and left out elsewhere, as are None values; ``options`` win.

    For efsgd, efblocksgd and efblocksgdm, ``merge`` (``"layer"``, ``"whole"``, N or
    ``"auto"``) with ``merge_max_groups``, ``merge_alpha``, ``merge_profile_steps`` and
    ``merge_trial_steps`` schedules the algorithm with MergeComp (Wang et al. 2021, arXiv:2103.15195).
    """
    cls, cfg_cls = _lookup(name)
    if common:
        unknown = sorted(set(common) - set(COMMON_OPTIONS))
        if unknown:
            raise ValueError(f"`common` holds only {', '.join(COMMON_OPTIONS)}, got {', '.join(unknown)}")
        takes = {f.name for f in dataclasses.fields(cfg_cls)}
        options = {**{k: v for k, v in common.items() if k in takes and v is not None}, **options}
    if options.get("merge") is not None:
        return _build_mergecomp(name, comm, dict(options))
    for k in MERGE_OPTIONS:
        options.pop(k, None)
    return cls(_config(name, cfg_cls, options), comm)
