"""Training algorithms: one module per family, each a Config, a State and a step.

Strings become objects here only: ``build(name, comm, **options)``; ``available()``
lists the names with a one-line description each. The contract every algorithm keeps
(``setup(X, layout)``, the hooks, ``wire_format()``, ``owns_momentum``) is
:class:`~gossip.algorithms.base.Algorithm`'s.
"""

from __future__ import annotations

from typing import Any, Mapping

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
from gossip.algorithms.efmomentum import EFMomentum, EFMomentumConfig
from gossip.algorithms.mergecomp import MergeComp, MergeCompState
from gossip.algorithms.powersgd import PowerSGD, PowerSGDConfig
from gossip.algorithms.sketched import (
    LocalTopK,
    LocalTopKConfig,
    Sketched,
    SketchedConfig,
    TrueTopK,
    TrueTopKConfig,
)
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
    "MERGEABLE",
    "MergeComp",
    "MergeCompState",
    "Sketched",
    "SketchedConfig",
    "TrueTopK",
    "TrueTopKConfig",
    "LocalTopK",
    "LocalTopKConfig",
    "available",
    "build",
    "config_class",
    "is_decentralized",
    "local_momentum_default",
    "option_names",
]

_REGISTRY: dict[str, tuple[type[Algorithm], type]] = {
    "allreduce": (AllReduce, AllReduceConfig),
    "dpsgd": (DPSGD, DPSGDConfig),
    "naive": (Naive, NaiveConfig),
    "dcd": (DCD, DCDConfig),
    "ecd": (ECD, ECDConfig),
    "efsgd": (DistEFSGD, EFSGDConfig),
    "efblocksgd": (EFBlockSGD, EFBlockSGDConfig),
    "efblocksgdm": (EFBlockSGDM, EFBlockSGDMConfig),
    "signsgd": (SignSGD, SignSGDConfig),
    "signum": (Signum, SignumConfig),
    "powersgd": (PowerSGD, PowerSGDConfig),
    "efmomentum": (EFMomentum, EFMomentumConfig),
    "sketched": (Sketched, SketchedConfig),
    "truetopk": (TrueTopK, TrueTopKConfig),
    "localtopk": (LocalTopK, LocalTopKConfig),
}


#: the algorithms MergeComp (papers/004) can schedule: ``build(name, comm, merge=...)``
MERGEABLE = ("efsgd", "efblocksgd", "efblocksgdm")


def available() -> dict[str, str]:
    """Algorithm names and one-line descriptions."""
    return {name: cls.summary for name, (cls, _) in _REGISTRY.items()}


def _lookup(name: str) -> tuple[type[Algorithm], type]:
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown algorithm {name!r}; known: {', '.join(_REGISTRY)}"
        ) from None


def config_class(name: str) -> type:
    return _lookup(name)[1]


def is_decentralized(name: str) -> bool:
    return _lookup(name)[0].acts_on == "model"


def local_momentum_default(name: str) -> float:
    """Momentum of the CLI's local SGD optimizer when --momentum is unset."""
    return _lookup(name)[0].local_momentum_default


def option_names(name: str) -> tuple[str, ...]:
    """The options the algorithm's Config takes (its field names)."""
    return _config_fields(config_class(name))


def _config_fields(cfg_cls: type) -> tuple[str, ...]:
    import dataclasses

    return tuple(f.name for f in dataclasses.fields(cfg_cls))


def build(name: str, comm: Any, *, common: Mapping[str, Any] | None = None, **options: Any) -> Algorithm:
    """``build("ecd", comm, compressor="quant:bits=8", seed=0)``.

    ``options`` go to the algorithm's Config, which must take every one. ``common``
    holds values of :data:`COMMON_OPTIONS` a caller has for any algorithm (a training
    run's seed, compressor and momentum): each is passed where the Config takes it and
    left out elsewhere, as are None values; ``options`` win over it.

    For the EF family (:data:`MERGEABLE`), ``merge="layer" | "whole" | "auto" | N``
    returns the algorithm scheduled by MergeComp (``gossip.algorithms.mergecomp``).
    """
    cls, cfg_cls = _lookup(name)
    if common:
        unknown = sorted(set(common) - set(COMMON_OPTIONS))
        if unknown:
            raise ValueError(f"`common` takes {', '.join(COMMON_OPTIONS)}, got {', '.join(unknown)}")
        takes = _config_fields(cfg_cls)
        options = {**{k: v for k, v in common.items() if k in takes and v is not None}, **options}
    try:
        config = cfg_cls(**options)
    except TypeError as e:
        import dataclasses

        accepted = ", ".join(f.name for f in dataclasses.fields(cfg_cls))
        if "unexpected keyword" in str(e):
            raise ValueError(f"{name}: {e}; accepted options: {accepted}") from None
        raise
    if name in MERGEABLE and config.merge is not None:
        return MergeComp(config, comm, family=cls)
    return cls(config, comm)
