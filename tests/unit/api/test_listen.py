"""The listening socket posttrain binds before it imports torch (api/listen.py): connections
accepted from it get Nagle's algorithm turned off, as uvicorn's own sockets do. Without it,
every response on a kept-alive connection waited for the client's delayed ACK."""

from __future__ import annotations

import asyncio
import socket

from posttrain.api.listen import listening_socket


def test_connections_accepted_from_the_listening_socket_have_tcp_nodelay():
    sock = listening_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]

    async def scenario() -> int:
        accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                conn = transport.get_extra_info("socket")
                accepted.set_result(conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        server = await asyncio.get_running_loop().create_server(Probe, sock=sock)
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            nodelay = await asyncio.wait_for(accepted, timeout=30)
            writer.close()
            return nodelay
        finally:
            server.close()
            await server.wait_closed()

    assert asyncio.run(scenario()) != 0
