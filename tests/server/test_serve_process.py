"""`pagedecode serve` as a process: the drain on SIGTERM, connection hygiene (timeouts, the
connection cap, the open-file limit), a taken port. Real subprocesses over stories260k, driven by
raw sockets and httpx."""
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx

from .test_contract_http import sse


def closed_by_server(sock, within, replies=None):
    """True when the server closes the connection (EOF or reset) within `within` seconds; what
    it sent meanwhile is appended to `replies`."""
    sock.settimeout(max(within, 0.01))
    data = b""
    try:
        while chunk := sock.recv(4096):
            data += chunk
        return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False
    finally:
        if replies is not None:
            replies.append(data)


def request_log(output):
    return [json.loads(ln.split("request ", 1)[1]) for ln in output.splitlines() if "pagedecode.server INFO request {" in ln]


def admitted(s):
    """Requests the server has taken: live (running, waiting) and ended. (Counting live ones alone
    raced the first requests' ends: in a CI run the first ones finished before the last client was
    admitted, and the count never reached them all.)"""
    metrics = httpx.get(s.url + "/metrics").text
    return sum(float(ln.split()[1]) for ln in metrics.splitlines()
               if ln.startswith(("pagedecode:num_requests_running ", "pagedecode:num_requests_waiting ",
                                 "pagedecode:request_success_total{", "pagedecode:request_failure_total{")))


# -- the drain -------------------------------------------------------------------------------------

def test_sigterm_drains_every_client_and_exits_0(serve):
    """24 streams and 24 non-streaming requests (2 batch slots, so most wait) when SIGTERM
    comes: /health and new requests get 503 during the grace; afterwards every stream ends with
    its final chunk and [DONE], every non-streaming client gets 200 with a finish reason, none
    is logged transport_error, and the process exits 0."""
    s = serve("--grace-seconds", "1.5", "--max-batch-size", "2")
    body = {"prompt": "Once upon a time", "max_tokens": 480, "ignore_eos": True}
    streams, plains = {}, {}

    def stream(i):
        with httpx.stream("POST", s.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            streams[i] = (r.status_code, sse([ln for ln in r.iter_lines() if ln]))

    def plain(i):
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=60)
        plains[i] = (r.status_code, r.json())
    clients = [threading.Thread(target=f, args=(i,)) for i in range(24) for f in (stream, plain)]
    for t in clients:
        t.start()
    end = time.time() + 60
    while admitted(s) < 48:                             # every request admitted
        assert time.time() < end
        time.sleep(0.05)
    s.p.send_signal(signal.SIGTERM)
    end = time.time() + 10
    health = httpx.get(s.url + "/health").status_code
    while health != 503 and time.time() < end:
        time.sleep(0.02)
        health = httpx.get(s.url + "/health").status_code
    assert health == 503
    late = httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert late.status_code == 503 and late.headers["retry-after"]
    for t in clients:
        t.join(60)
    assert s.p.wait(timeout=60) == 0
    assert len(streams) == len(plains) == 24
    reasons = []
    for code, items in streams.values():
        assert code == 200 and items[-1][1] == "[DONE]"
        final = items[-2][1]["choices"][0]
        assert final["finish_reason"] in ("length", "cancelled")
        reasons.append(final["finish_reason"])
    for code, out in plains.values():
        assert code == 200
        reasons.append(out["choices"][0]["finish_reason"])
    assert "cancelled" in reasons and set(reasons) <= {"length", "cancelled"}
    logged = request_log(s.output)
    assert len(logged) == 48 and {r["finish_reason"] for r in logged} <= {"max_output_tokens", "cancelled"}
    assert "Traceback" not in s.output and "nanobind" not in s.output


def test_a_second_signal_ends_the_grace_at_once(serve):
    s = serve("--grace-seconds", "600", "--max-batch-size", "1")
    body = {"prompt": "Once upon a time", "max_tokens": 480, "ignore_eos": True, "stream": True}
    ends = []

    def stream():
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=60) as r:
            ends.append(sse([ln for ln in r.iter_lines() if ln])[-2:])
    clients = [threading.Thread(target=stream) for _ in range(12)]
    for t in clients:
        t.start()
    end = time.time() + 60
    while admitted(s) < 12:
        assert time.time() < end
        time.sleep(0.05)
    s.p.send_signal(signal.SIGINT)
    time.sleep(0.3)
    start = time.time()
    s.p.send_signal(signal.SIGINT)
    assert s.p.wait(timeout=60) == 0 and time.time() - start < 20
    for t in clients:
        t.join(10)
    assert len(ends) == 12 and all(last == (None, "[DONE]") for _, last in ends)
    assert "cancelled" in [final[1]["choices"][0]["finish_reason"] for final, _ in ends]


# -- connections -----------------------------------------------------------------------------------

def test_idle_and_slow_connections_are_closed_and_never_reach_the_engine(serve):
    """Connections that send nothing, trickle their headers, trickle their body or idle after a
    response are closed after their timeout; a trickled body never became a request."""
    s = serve("--header-timeout", "1", "--body-timeout", "1.5", "--keep-alive-timeout", "1")
    silent = [s.connect() for _ in range(20)]
    headers = [s.connect() for _ in range(5)]
    bodies = [s.connect() for _ in range(5)]
    for c in bodies:
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                  b"content-length: 1000\r\n\r\n{\"prompt\": \"Once")
    kept = s.connect()
    kept.sendall(b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
    assert b"200 OK" in kept.recv(4096)
    start = time.time()
    stop = threading.Event()

    def trickle():
        line = b"POST /v1/completions HTTP/1.1\r\nx-slow: " + b"a" * 100
        i = 0
        while not stop.is_set() and i < len(line):
            for c, data in [(c, line[i:i + 1]) for c in headers] + [(c, b" ") for c in bodies]:
                try:
                    c.send(data)
                except OSError:
                    pass
            i += 1
            time.sleep(0.1)
    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    assert httpx.get(s.url + "/health").status_code == 200          # a normal client meanwhile
    replies = []
    try:
        assert all(closed_by_server(c, 4 - (time.time() - start), replies) for c in silent + headers + bodies + [kept])
    finally:
        stop.set()
    assert time.time() - start < 4
    assert replies[:20] == [b""] * 20                                   # nothing asked, nothing said
    for reply, code in zip(replies[20:30], [b"header_timeout"] * 5 + [b"body_timeout"] * 5):
        assert reply.startswith(b"HTTP/1.1 408 ") and code in reply  # a clear reason
    assert httpx.get(s.url + "/health").status_code == 200
    metrics = httpx.get(s.url + "/metrics").text
    assert "pagedecode:num_requests_running 0.0" in metrics and "pagedecode:num_requests_waiting 0.0" in metrics
    assert request_log(s.output) == []                                 # no request was ever started
    assert s.stop() == 0
    assert "Traceback" not in s.output and "Exception in ASGI" not in s.output


def test_beyond_max_connections_idle_ones_make_room_then_503(serve):
    """At the cap a new client closes the longest-idle connection; when every connection has a
    request running (here: bodies still arriving), a new one gets a clear 503 at once."""
    s = serve("--max-connections", "4", "--header-timeout", "30", "--body-timeout", "30",
              "--max-connections-per-client", "4", "--min-body-rate", "0")          # the cap alone
    idle = [s.connect() for _ in range(4)]
    assert httpx.get(s.url + "/health").status_code == 200          # served: the oldest idle one made room
    assert closed_by_server(idle[0], 5)
    busy = [s.connect() for _ in range(4)]                           # evict the other idle ones
    for c in busy:
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                  b"content-length: 100\r\n\r\n{")
    time.sleep(0.3)
    r = httpx.get(s.url + "/health")
    assert r.status_code == 503 and r.json()["error"]["code"] == "too_many_connections"
    assert "--max-connections 4" in r.json()["error"]["message"]
    busy[0].close()
    end = time.time() + 10
    while httpx.get(s.url + "/health").status_code != 200:
        assert time.time() < end
        time.sleep(0.1)
    assert s.stop() == 0


def test_idle_sockets_beyond_the_open_file_limit_do_not_starve_clients(serve):
    """RLIMIT_NOFILE 256 and 300 idle sockets: normal clients are still served, at once (the
    header timeout is far away: the default cap keeps the sockets under the limit)."""
    s = serve("--header-timeout", "60", fd_limit=256)
    idle = [s.connect() for _ in range(300)]
    time.sleep(0.5)
    for _ in range(3):
        assert httpx.get(s.url + "/health", timeout=5).status_code == 200
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 8}, timeout=5)
        assert r.status_code == 200 and r.json()["choices"][0]["text"]
    for c in idle:
        c.close()
    assert s.stop() == 0


def test_a_port_in_use_is_one_line_and_exit_1(stories_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "pagedecode.cli", "serve", "--model", str(stories_path),
                            "--port", str(port)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [f"pagedecode serve: cannot listen on 127.0.0.1:{port}: "
                                             "Address already in use"]
    assert r.stdout == ""


def children(pid):
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d))
    return out


def test_sigterm_at_two_ranks_stops_the_workers_without_a_traceback(serve):
    """SIGTERM to the whole process group (as systemd sends it; a terminal's Ctrl-C reaches the
    group too): the workers leave stopping to rank 0, which drains and tells them to stop."""
    s = serve("--tensor-parallel-size", "2", "--grace-seconds", "2", session=True)
    workers = [c for c in children(s.p.pid) if "spawn_main" in open(f"/proc/{c}/cmdline").read()]
    assert len(workers) == 1
    r = httpx.post(s.url + "/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 16}, timeout=60)
    assert r.json()["choices"][0]["text"] == ", there was a little girl named Lily. She loved to play"
    os.killpg(s.p.pid, signal.SIGTERM)
    assert s.p.wait(timeout=60) == 0
    end = time.time() + 1
    while any(os.path.exists(f"/proc/{w}") for w in workers) and time.time() < end:
        time.sleep(0.05)
    assert not any(os.path.exists(f"/proc/{w}") for w in workers)
    assert "Traceback" not in s.output and "gloo" not in s.output, s.output[-3000:]
