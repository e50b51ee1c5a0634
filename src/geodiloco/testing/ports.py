"""Free ports for servers a test starts itself."""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_PORT = 10_000


def free_port() -> int:
    """A port free now, for a server a test starts later (a torch rendezvous store, a
    coordinator's own process). Chosen below the kernel's ephemeral range: a port the kernel hands
    out for a bind to port 0 or for a client's source port could be taken by another process
    between this check and the server's bind (a flaky EADDRINUSE); one below it only by another
    explicit choice, picked at random from some 20,000."""
    try:
        ephemeral_low = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32_768
    for _ in range(100):
        port = random.randrange(LOWEST_PORT, max(ephemeral_low, LOWEST_PORT + 1_000))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # every try taken: whatever the kernel gives
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
