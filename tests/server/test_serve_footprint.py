"""`pagedecode serve --model <the Q4_1 SmolLM2 file>` at defaults holds at most 600 MB resident
after a request, torch included (issue 36): the weights once, the KV cache where it was written,
the server, the grammar backend warmed as it started answering. Its start-up log states the
weights and the KV cache it holds."""
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

MOST_RSS = 600e6


def status_of(pid):
    with open(f"/proc/{pid}/status") as f:
        return {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f) if k in ("VmRSS", "VmHWM")}


def cpu_of(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_until_idle(pid, most_s=90.0):
    """Until the process used under 0.05 s of CPU in 0.5 s: the work after the request is done."""
    end = time.monotonic() + most_s
    before = cpu_of(pid)
    while time.monotonic() < end:
        time.sleep(0.5)
        now = cpu_of(pid)
        if now - before < 0.05:
            return
        before = now


@pytest.fixture
def serving(smollm2_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}     # as a user starts it
    p = subprocess.Popen([sys.executable, "-m", "pagedecode.cli", "serve", "--model", str(smollm2_path), "--port", "0"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines, started = [], threading.Event()

    def read():
        for line in p.stdout:
            lines.append(line)
            if "Uvicorn running on" in line:
                started.set()
        started.set()
    threading.Thread(target=read, daemon=True).start()
    started.wait(300)
    text = "".join(lines)
    match = re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", text)
    assert match, "serve did not start:\n" + text
    yield p, f"http://127.0.0.1:{match.group(1)}", lines
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def test_serve_at_defaults_is_resident_within_600_mb_after_a_request(serving):
    p, url, lines = serving
    r = httpx.post(url + "/v1/chat/completions", timeout=120,
                   json={"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 8})
    assert r.status_code == 200, r.text
    wait_until_idle(p.pid)
    held = status_of(p.pid)
    log = "".join(lines)
    weights = re.search(r"weights ([\d.]+) MB \(q4_1 [\d.]+ MB, q8_0 [\d.]+ MB.*?KV cache of (\d+) tokens in float32 "
                        r"\(([\d.]+) MB\)", log)
    assert weights, log
    assert 90 < float(weights.group(1)) < 100 and int(weights.group(2)) == 2912, log      # the file's size; 128 MiB
    assert held["VmRSS"] < MOST_RSS, (held, log[-2000:])
