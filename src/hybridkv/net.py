"""Loopback helpers shared by the local sidecar, tensor-parallel rendezvous, benchmarks and tests."""

from __future__ import annotations

import socket

LOOPBACK_HOST = "127.0.0.1"


def free_loopback_port() -> int:
    """A TCP port free on loopback now; the caller binds it a moment later (a rare race another process may win)."""
    with socket.socket() as sock:
        sock.bind((LOOPBACK_HOST, 0))
        return sock.getsockname()[1]
