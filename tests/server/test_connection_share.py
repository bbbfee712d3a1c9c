"""Trickling bodies and one greedy address cannot hold the connection cap (issue 34, item 6):
at the cap a connection whose body arrives slower than --min-body-rate is closed first (408),
and one client address holds at most --max-connections-per-client connections."""
import select
import time

import httpx

from .test_serve_process import closed_by_server

HEAD = (b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        b"content-length: 1000\r\n\r\n")


def trickle(s, n, source="127.0.0.1"):
    """n connections from `source`, each with its headers and one body byte of 1000 sent."""
    import socket
    conns = []
    for _ in range(n):
        c = socket.create_connection(("127.0.0.1", s.port), timeout=10, source_address=(source, 0))
        c.sendall(HEAD + b"{")
        conns.append(c)
    return conns


def client(source):
    return httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=10)


def test_trickling_bodies_are_closed_first_at_the_cap(serve):
    s = serve("--max-connections", "16", "--max-connections-per-client", "16", "--body-timeout", "30")
    slow = trickle(s, 16)
    time.sleep(1.3)                                    # past the grace: 1 byte in 1.3 s, under 1024 bytes/s
    with client("127.0.0.2") as c:
        answers = [c.get(s.url + "/health").status_code for _ in range(3)]
        r = c.post(s.url + "/v1/completions", json={"prompt": "Once", "max_tokens": 2})
    assert answers == [200] * 3 and r.status_code == 200
    replies = []
    ready, _, _ = select.select(slow, [], [], 0.5)     # the ones the server closed (or answered)
    closed = sum(closed_by_server(x, 0.5 if x in ready else 0.01, replies) for x in slow)
    assert closed >= 1 and all(b"408 Request Timeout" in x and b"body_too_slow" in x for x in replies if x)
    assert s.stop() == 0


def test_a_fast_body_is_not_closed_for_a_slow_one(serve):
    """Within the grace a body is not judged: every connection busy and young gives the 503."""
    s = serve("--max-connections", "4", "--max-connections-per-client", "4", "--body-timeout", "30")
    busy = trickle(s, 4)
    with client("127.0.0.2") as c:
        r = c.get(s.url + "/health")
    assert r.status_code == 503 and r.json()["error"]["code"] == "too_many_connections"
    assert not any(closed_by_server(x, 0.05) for x in busy)
    assert s.stop() == 0


def test_one_address_holds_at_most_its_share(serve):
    s = serve("--max-connections", "16", "--max-connections-per-client", "4", "--min-body-rate", "0",
              "--body-timeout", "30")
    busy = trickle(s, 4)
    with client("127.0.0.1") as mine, client("127.0.0.2") as other:
        refused = mine.get(s.url + "/health")
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "too_many_connections_from_client"
        assert "--max-connections-per-client 4" in refused.json()["error"]["message"]
        assert other.get(s.url + "/health").status_code == 200         # another address is served
    for x in busy:
        x.close()
    time.sleep(0.3)
    idle = [s.connect() for _ in range(4)]                             # idle ones of its own make room
    with client("127.0.0.1") as mine:
        assert mine.get(s.url + "/health").status_code == 200
    assert closed_by_server(idle[0], 5)
    assert s.stop() == 0
