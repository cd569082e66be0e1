"""Free TCP ports on the loopback interface for servers the tests start."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port nothing listens on now (another process may take it before the caller does)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
