"""A free TCP port on this host, for a rendezvous that must not collide with another job's, and a launch retried on
another port when one was taken all the same."""

from __future__ import annotations

import socket
from collections.abc import Callable

from megatron_ppo.parallel.distributed import PORT_IN_USE

# What torch's TCPStore (c10d) says when the rendezvous port was taken between `free_port()` and its bind, and what
# our start says then (`init_distributed`'s `LaunchError`).
PORT_TAKEN = ("EADDRINUSE", "Address already in use", "address already in use", PORT_IN_USE)


def free_port() -> int:
    """A port the OS has just handed out (another process may still take it before the rendezvous binds it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def port_taken(text: str) -> bool:
    """Whether a launch's log or error says its rendezvous port was already taken."""
    return any(marker in text for marker in PORT_TAKEN)


def on_a_free_port[Result](
    launch: Callable[[int], Result], log: Callable[[Result], str] = lambda _: "", attempts: int = 3
) -> Result:
    """`launch(port)` on a port `free_port()` handed out; when the port was taken before the rendezvous bound it
    (two suites on one machine) — an AssertionError, or a result whose `log` says so — again on another port,
    `attempts` times in all. Any other failure, and the last attempt's, is the caller's."""
    for attempt in range(1, attempts + 1):
        try:
            result = launch(free_port())
        except AssertionError as error:
            if attempt == attempts or not port_taken(str(error)):
                raise
            continue
        if attempt == attempts or not port_taken(log(result)):
            return result
    raise AssertionError("unreachable")
