"""`pagedecode serve --ray --replicas 2`: its own local Ray cluster, two replicas behind Serve's
proxy, a request answered, SIGTERM -> exit 0 and no Ray process of its left. A slow test (Ray's
start-up is most of a minute on two cores): PAGEDECODE_SLOW=1 or -m slow runs it."""
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("ray", reason="Ray is not installed (pip install 'pagedecode[ray]')")
httpx = pytest.importorskip("httpx")
psutil = pytest.importorskip("psutil")


def alive(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.slow
def test_serve_ray_two_replicas_answer_and_shut_down_clean():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = subprocess.Popen([sys.executable, "-m", "pagedecode.cli", "serve", "--ray", "--replicas", "2", "--port",
                          str(port), "--max-batch-size", "8"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    lines, ready = [], threading.Event()

    def read():
        for line in p.stdout:
            lines.append(line)
            if "replicas on Ray Serve at" in line:
                ready.set()
        ready.set()
    threading.Thread(target=read, daemon=True).start()
    try:
        assert ready.wait(240) and p.poll() is None, "".join(lines[-40:])
        seen = set()
        for k in range(4):
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": f"Hi {k}", "max_tokens": 2},
                           timeout=60)
            assert r.status_code == 200, r.text
            seen.add(r.headers["x-pagedecode-replica"])
        assert seen == {"replica-0", "replica-1"}
        pids = {c.pid for c in psutil.Process(p.pid).children(recursive=True)}
        p.send_signal(signal.SIGTERM)
        assert p.wait(120) == 0
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any(map(alive, pids)):
            time.sleep(0.25)
        assert not [q for q in pids if alive(q)]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
