"""The gateway's own listening socket (``gateway.server.serving.make_listen_socket``):
the connections it accepts under asyncio have Nagle's algorithm off and its send buffer."""

from __future__ import annotations

import asyncio
import socket

from gateway.server.serving import make_listen_socket


async def test_accepted_connections_have_tcp_nodelay_and_the_send_buffer():
    sock = make_listen_socket("127.0.0.1", 0, 64 * 1024)
    sock.setblocking(False)
    accepted: asyncio.Future[tuple[int, int]] = asyncio.get_running_loop().create_future()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = writer.get_extra_info("socket")
        accepted.set_result((conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY),
                             conn.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)))
        writer.close()

    server = await asyncio.start_server(handle, sock=sock)
    try:
        _reader, writer = await asyncio.open_connection(*sock.getsockname())
        nodelay, sndbuf = await asyncio.wait_for(accepted, 10)
        writer.close()
    finally:
        server.close()
        await server.wait_closed()
    # without it a small frame written while the previous one is unacknowledged waits for
    # the client's delayed acknowledgement (up to 40 ms)
    assert nodelay != 0
    assert sndbuf >= 64 * 1024  # Linux reports twice the value set
