"""A port for a test's server to listen on.

Binding port 0 and handing the number to a server started afterwards races with every outgoing
connection the machine makes meanwhile: the kernel gives those local ports from the same ephemeral
range (Linux: ``ip_local_port_range``, 32768-60999 by default), and a tensor-parallel engine's ranks
connect to each other while its server starts (``podium serve -tp 2`` then failed to bind, "address
already in use"). So the port comes from below that range, where only an explicit bind takes one.
"""

from __future__ import annotations

import random
import socket

_RANDOM = random.Random()  # seeded from the OS: parallel test processes pick different ports


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing is bound to now, below the ephemeral range."""
    high = _ephemeral_low()
    low = max(1024, high - 12000)
    for _ in range(500):
        port = _RANDOM.randrange(low, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # below the range every port is taken: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
