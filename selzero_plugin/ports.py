"""A free TCP port for a rendezvous (the demo's torchrun, the test suite's launches).

[Note: rendezvous ports]
The usual recipe (bind port 0, read the port, close, hand it to the launcher) races with every
other process binding port 0 meanwhile: the kernel may hand the same port to one of them (a
gloo pair, another launcher's store) before the launcher binds it, and the launch then fails
or waits on a stranger's socket. Ports bound to 0 come from the ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``, 32768-60999 by default), so this picks a random
free port *below* it, where no such bind lands; only another caller of this function could
pick the same one, and each checks that the port is free.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

__all__ = ["free_port"]

_LOWEST = 15000  # above the ports services register by default


def free_port() -> int:
    """A port on 127.0.0.1 that is free now and outside the ephemeral range."""
    low = _ephemeral_low()
    if low - _LOWEST >= 1000:
        for _ in range(100):
            port = random.randrange(_LOWEST, low)
            if _bindable(port):
                return port
    with socket.socket() as s:  # no room below the ephemeral range: the usual recipe
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; macOS starts at 49152


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
