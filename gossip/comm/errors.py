"""Peer errors; they live in :mod:`gossip.errors` (kept importable from here)."""

from gossip.errors import PeerConnectionError, PeerError, PeerPayloadError, PeerTimeoutError, format_peers

__all__ = ["PeerError", "PeerTimeoutError", "PeerPayloadError", "PeerConnectionError", "format_peers"]
