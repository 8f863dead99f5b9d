"""The server's listening socket, bound before anything heavy is imported.

A restarted server spends most of its start-up importing torch and transformers and then
restoring sessions (seconds; tens under load). A port that is not listening refuses
connections, and the SDK gives a refused request about 35 s of backoff (7 retries) before it
raises; a port that is listening queues them in the kernel's backlog, and each waits for the
server inside the SDK's 60 s read timeout instead. So `posttrain serve` binds first and hands
the socket to uvicorn, which accepts from it once the app has started.

Imports: nothing from posttrain (socket only: this runs before torch is imported).
"""

from __future__ import annotations

import socket

BACKLOG = 2048  # uvicorn's default: connections the kernel holds while the app starts


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port and listening; SO_REUSEADDR as uvicorn sets it, so a
    restart right after a crash can take the port back from connections in TIME_WAIT."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named, not 0: accepted sockets inherit it, and asyncio turns Nagle's
    # algorithm off (TCP_NODELAY) only on sockets whose proto says TCP. With proto 0 every
    # response on a kept-alive connection (headers and body are two writes) waited for the
    # client's delayed ACK: 44 ms per request against 0.25 ms (measured, GET /healthz).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(BACKLOG)
    return sock
