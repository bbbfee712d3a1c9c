"""server/transport.py's protocol in a real uvicorn, in a thread, with a small ASGI app."""
import asyncio
import logging
import socket
import struct
import threading
import time

import pytest
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from pagedecode.server.transport import ConnectionLimits, GuardedH11Protocol


def serve_in_thread(app, http, loop="auto"):
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, http=http, log_level="warning",
                                           lifespan="off", loop=loop))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    end = time.time() + 30
    while not server.started:
        assert time.time() < end
        time.sleep(0.02)
    return server, thread, server.servers[0].sockets[0].getsockname()[1]


@pytest.mark.parametrize("protocol,loop", [("uvicorn", "asyncio"), ("guarded", "asyncio"), ("guarded", "uvloop")])
def test_no_write_reaches_a_connection_the_client_closed(protocol, loop, caplog):
    """The client goes away while the response streams, and the handler writes a batch of chunks
    before the loop reads the close (a busy loop: many streams): the first write that fails
    closes the transport, and each further write made asyncio log 'socket.send() raised
    exception.' (uvicorn hears of the loss only on the next loop iteration): shown on asyncio's own
    loop; the guard holds on uvloop too (uvicorn's "auto" picks it when installed; its transport
    logs 'uvloop: socket.send() raised exception.')."""
    if loop == "uvloop":
        pytest.importorskip("uvloop")
    reset = threading.Event()

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"first\n", "more_body": True})
        reset.wait(5)
        time.sleep(0.1)                                        # the loop busy: the close not read yet
        for _ in range(12):                                    # a batch of chunks, no await that yields
            await send({"type": "http.response.body", "body": b"chunk\n" * 100, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    http = H11Protocol if protocol == "uvicorn" else GuardedH11Protocol.configured(ConnectionLimits())
    server, thread, port = serve_in_thread(app, http, loop=loop)
    try:
        with caplog.at_level(logging.WARNING, logger="asyncio"):
            c = socket.create_connection(("127.0.0.1", port))
            c.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            got = b""
            while b"first" not in got:
                got += c.recv(4096)
            # an abortive close (RST, as a killed client's kernel sends): the first write fails at
            # once, not only after the peer's RST to it has come back, which a loaded machine delays
            c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            c.close()
            reset.set()
            time.sleep(0.5)
        warnings = [r for r in caplog.records if "socket.send() raised exception" in r.getMessage()]
        assert (len(warnings) > 0) if protocol == "uvicorn" else (len(warnings) == 0)
    finally:
        server.should_exit = True
        thread.join(10)
