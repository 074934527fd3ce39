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
from gossip.algorithms.adpsgd import ADPSGD, ADPSGDConfig
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
    "ADPSGD",
    "ADPSGDConfig",
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
    "algorithm_class",
    "available",
    "build",
    "config_class",
    "default_topology",
    "make_config",
    "mergeable",
    "register",
    "is_decentralized",
    "local_momentum_default",
    "local_optimizer_default",
]

#: the algorithms: name -> class (its ``Config`` is a class attribute); every part of
#: the project reaches them here, and every per-algorithm fact is an attribute of the class
_REGISTRY: Registry[type[Algorithm]] = Registry("algorithm")


def register(cls: type[Algorithm]) -> type[Algorithm]:
    """Make an :class:`Algorithm` subclass buildable as ``cls.name`` (usable as a class
    decorator). The class declares ``name``, ``summary``, ``Config`` (a dataclass) and
    the attributes of :class:`Algorithm` where its defaults do not fit."""
    if not (isinstance(cls, type) and issubclass(cls, Algorithm)):
        raise TypeError(f"register: an algorithm must be an Algorithm subclass, got {cls!r}")
    if not dataclasses.is_dataclass(cls.Config):
        raise TypeError(f"register: {cls.__name__}.Config must be a dataclass, got {cls.Config!r}")
    _REGISTRY.register(cls.name, cls, cls.summary)
    return cls


for _cls in (AllReduce, DPSGD, Naive, DCD, ECD, Choco, SGP, DistEFSGD, EFBlockSGD, EFBlockSGDM, SignSGD, Signum,
             PowerSGD, EFMomentum, Sketched, TrueTopK, LocalTopK, LocalSGD, SlowMo, DiLoCo, DeMo, SparseLoCo, NoLoCo, MuLoCo, ADPSGD):
    register(_cls)


def available() -> dict[str, str]:
    """Algorithm names and one-line descriptions."""
    return _REGISTRY.available()


def algorithm_class(name: str) -> type[Algorithm]:
    """The class registered as ``name``: its attributes are the algorithm's facts
    (``acts_on``, ``decentralized``, ``state_copies``, ``mergeable``, ...)."""
    return _REGISTRY.get(name)


def config_class(name: str) -> type:
    """The Config dataclass of the registered algorithm ``name`` (its options and defaults)."""
    return algorithm_class(name).Config


def is_decentralized(name: str) -> bool:
    """Whether the algorithm exchanges with graph neighbours (needs a topology)."""
    return algorithm_class(name).decentralized


def local_momentum_default(name: str) -> float:
    """Momentum of the CLI's local SGD optimizer when --momentum is unset."""
    return algorithm_class(name).local_momentum_default


def local_optimizer_default(name: str) -> str:
    """The CLI's local optimizer when --optimizer is unset: "sgd", "adamw" (diloco, ...)
    or "muon" (muloco)."""
    return algorithm_class(name).local_optimizer_default


def default_topology(name: str) -> str:
    """The CLI's --topology when it is unset: "ring", or "onepeer-exp" for sgp."""
    return algorithm_class(name).default_topology


def mergeable() -> tuple[str, ...]:
    """The algorithms MergeComp can schedule (``merge=``): those declaring ``mergeable``."""
    return tuple(n for n in _REGISTRY.names() if _REGISTRY.get(n).mergeable)


#: the EF family's scheduling options: with ``merge`` set, ``build`` returns MergeComp
#: (Wang et al. 2021, arXiv:2103.15195) scheduling that algorithm group by group
MERGE_OPTIONS = ("merge", "merge_max_groups", "merge_alpha", "merge_profile_steps", "merge_trial_steps")


def _build_mergecomp(name: str, comm: Any, options: dict[str, Any]) -> Algorithm:
    from gossip.algorithms.mergecomp import MergeComp, MergeCompConfig

    if not algorithm_class(name).mergeable:
        raise ValueError(f"merge applies to {', '.join(mergeable())} (MergeComp schedules the EF family), not {name}")
    sched = {k.removeprefix("merge_"): options.pop(k) for k in MERGE_OPTIONS[1:] if k in options}
    sched["merge"] = options.pop("merge")
    # the scheduled algorithm's own Config: its checks, its defaults, its compressor
    # (efblocksgd's is blocksign: one block per parameter tensor, whatever the grouping)
    base = make_config(name, **options)
    cfg = MergeCompConfig(compressor=base.compressor, momentum=base.momentum, seed=base.seed, **sched)
    return MergeComp(cfg, comm)


def make_config(name: str, **options: Any) -> Any:
    """The Config of algorithm ``name`` from ``options``: its checks run here, with no
    communicator; an option it does not take is one line naming the accepted ones."""
    cfg_cls = config_class(name)
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
    cls = algorithm_class(name)
    if common:
        unknown = sorted(set(common) - set(COMMON_OPTIONS))
        if unknown:
            raise ValueError(f"`common` holds only {', '.join(COMMON_OPTIONS)}, got {', '.join(unknown)}")
        takes = {f.name for f in dataclasses.fields(cls.Config)}
        options = {**{k: v for k, v in common.items() if k in takes and v is not None}, **options}
    if options.get("merge") is not None:
        return _build_mergecomp(name, comm, dict(options))
    for k in MERGE_OPTIONS:
        options.pop(k, None)
    return cls(make_config(name, **options), comm)
