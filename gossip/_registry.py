"""One registry mechanism for every family of named parts.

Algorithms, compressors, topologies, models and data sets are each a
:class:`Registry`: names in registration order, each with its entry (a class, a
builder, a row) and a one-line summary; an unknown name is one line naming it and
the known ones. This module imports nothing, so any package can use it.
"""

from __future__ import annotations

from typing import Any, Callable, Generic, Iterator, TypeVar

__all__ = ["Registry"]

T = TypeVar("T")


class Registry(Generic[T]):
    """``kind``: what the names name ("algorithm", "compressor", ...); ``error``: the
    exception class of an unknown name; ``known``: the word before the list of names in
    that message; ``sort``: list the names sorted (else in registration order)."""

    def __init__(self, kind: str, *, error: Callable[[str], Exception] = ValueError, known: str = "known",
                 sort: bool = False) -> None:
        self.kind = kind
        self._error = error
        self._known = known
        self._sort = sort
        self._entries: dict[str, T] = {}
        self._summaries: dict[str, str] = {}

    def register(self, name: str, entry: T, summary: str = "") -> T:
        if not isinstance(name, str) or not name:
            raise ValueError(f"register: a {self.kind} name must be a non-empty string, got {name!r}")
        if name in self._entries:
            raise self._error(f"register: a {self.kind} named {name!r} is already registered")
        self._entries[name] = entry
        self._summaries[name] = summary
        return entry

    def unregister(self, name: str) -> None:
        """Forget ``name`` (no error if it is unknown): for tests that register a part."""
        self._entries.pop(name, None)
        self._summaries.pop(name, None)

    def names(self) -> list[str]:
        return sorted(self._entries) if self._sort else list(self._entries)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, name: Any) -> T:
        """The entry of ``name``, or the one-line error naming the known ones."""
        if name not in self:
            raise self._error(f"unknown {self.kind} {name!r}; {self._known}: {', '.join(self.names())}")
        return self._entries[name]

    def summary(self, name: Any) -> str:
        self.get(name)
        return self._summaries[name]

    def available(self) -> dict[str, str]:
        """Names and their one-line summaries."""
        return {n: self._summaries[n] for n in self.names()}

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(self.names())})"
