"""A WebSocket client on a plain socket, for the probes (``bench/hostile_probe.py``) and
tests that must control every byte: when the client reads (a client that never reads),
and what a frame announces (a frame that lies about its length). The handshake is RFC
6455 section 4.1, the client frame section 5.2 (clients mask their frames)."""

from __future__ import annotations

import base64
import os
import socket

ZERO_MASK = b"\0\0\0\0"  # masking with zeros leaves the payload as is: no per-byte work for a flood


def client_frame(payload: bytes, opcode: int = 0x1, length: int | None = None, mask: bytes | None = None) -> bytes:
    """One masked, final client frame: header, mask and masked ``payload``.

    ``opcode``: 0x1 text, 0x2 binary, 0x9 ping... ``length`` overrides the payload length
    the header announces (a frame whose payload the caller sends after it, or never).
    ``mask``: 4 bytes; random when None."""
    mask = os.urandom(4) if mask is None else mask
    n = len(payload) if length is None else length
    if n < 126:
        head = bytes([0x80 | opcode, 0x80 | n])
    elif n < 1 << 16:
        head = bytes([0x80 | opcode, 0x80 | 126]) + n.to_bytes(2, "big")
    else:
        head = bytes([0x80 | opcode, 0x80 | 127]) + n.to_bytes(8, "big")
    if mask == ZERO_MASK:
        return head + mask + payload
    return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def handshake(host: str, port: int, cookie_header: str, origin: str, rcvbuf: int | None = None,
              source: str | None = None, timeout_s: float = 10.0) -> socket.socket:
    """A socket connected to ``ws://host:port/ws`` whose handshake is done (the 101
    response consumed; nothing else read). ``cookie_header``: the ``Cookie`` value;
    ``rcvbuf`` (bytes) shrinks the receive window before connecting; ``source``: the
    local address to connect from; ``timeout_s``: the socket's timeout.

    Raises:
        ConnectionError: the connection closed during the handshake, or it was refused
            (the message is the response's status line).
        OSError: the connection failed.
    """
    s = socket.socket()
    try:
        if rcvbuf:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        if source is not None:
            s.bind((source, 0))
        s.settimeout(timeout_s)
        s.connect((host, port))
        key = base64.b64encode(os.urandom(16)).decode()
        s.sendall((f"GET /ws HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                   f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\nOrigin: {origin}\r\n"
                   f"Cookie: {cookie_header}\r\n\r\n").encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = s.recv(1)
            if not chunk:
                raise ConnectionError("closed during the handshake")
            head += chunk
        if not head.startswith(b"HTTP/1.1 101"):
            raise ConnectionError(head.split(b"\r\n", 1)[0].decode(errors="replace"))
    except BaseException:
        s.close()  # a refused handshake leaves no socket open
        raise
    return s
