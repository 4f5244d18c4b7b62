"""A free TCP port on this host, for a rendezvous that must not collide with another job's."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port the OS has just handed out (another process may still take it before the rendezvous binds it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
