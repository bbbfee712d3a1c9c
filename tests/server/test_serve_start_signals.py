"""`pagedecode serve` told to stop before it answers /health: while the model loads (SIGTERM's and
SIGINT's default action, at once) and while uvicorn starts beside the grammar backend's warm-up
(the drain, exit 0, without waiting for the warm-up's import). Each must be gone within 3 s."""
import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

GONE_WITHIN_S = 3.0

# A grammar warm-up that outlasts any test: the parse worker blocked on an event nobody sets when
# serve stops (the real one imports xgrammar and transformers: 2 s quiet, over 10 s on a loaded
# machine). The test never waits on it: serve must exit without it.
SLOW_WARMUP = """
import threading
from pagedecode.runtime import grammar_compiler as g
_backend = g.GrammarCompiler._backend
def slow_backend(self):
    print("slow warm-up running", flush=True)
    threading.Event().wait()
    _backend(self)
g.GrammarCompiler._backend = slow_backend
"""

# Says when the model's load begins (the signal then lands inside Engine.from_pretrained).
LOAD_MARKER = """
from pagedecode.model import loader
_load_model = loader.load_model
def load_model(*args, **kw):
    print("loading the model", flush=True)
    return _load_model(*args, **kw)
loader.load_model = load_model
"""


def with_hook(tmp_path, code):
    """The environment of a child whose interpreter runs `code` first (a sitecustomize)."""
    (tmp_path / "sitecustomize.py").write_text(code)
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)}


class Starting:
    """`python -m pagedecode.cli serve --model MODEL`, its output read by a thread."""

    def __init__(self, model, env=None):
        self.p = subprocess.Popen([sys.executable, "-m", "pagedecode.cli", "serve", "--model", str(model),
                                   "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  env={**os.environ, **(env or {})})
        self.lines = []
        threading.Thread(target=lambda: self.lines.extend(self.p.stdout), daemon=True).start()

    @property
    def output(self):
        return "".join(self.lines)

    def wait_for(self, text, timeout=120):
        end = time.time() + timeout
        while text not in self.output:
            assert self.p.poll() is None and time.time() < end, self.output[-3000:]
            time.sleep(0.005)

    def stop(self, sig):
        """sig, then the exit code and the seconds it took (None, None: still running after 3 s)."""
        t0 = time.time()
        self.p.send_signal(sig)
        try:
            code = self.p.wait(timeout=GONE_WITHIN_S)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
            return None, None
        return code, time.time() - t0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_the_model_loads_ends_serve_at_once(smollm2_path, tmp_path, sig):
    """The real model's file, signalled as its load begins (no server yet, nothing to drain): the
    signal's default action, the process gone within 3 s (SIGINT's KeyboardInterrupt was seen lost
    there, the load going on for 30 s)."""
    s = Starting(smollm2_path, env=with_hook(tmp_path, LOAD_MARKER))
    s.wait_for("loading the model")
    code, _ = s.stop(sig)
    assert code is not None, f"still running {GONE_WITHIN_S} s after {sig.name}:\n{s.output[-3000:]}"
    assert code == -sig, s.output[-3000:]
    assert "Uvicorn running" not in s.output


@pytest.mark.skipif(importlib.util.find_spec("xgrammar") is None, reason="no grammar backend to warm")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_uvicorn_starts_drains_without_waiting_for_the_grammar_warmup(stories_path, tmp_path, sig):
    """Signalled once uvicorn has its handlers (it says "Started server process"), before /health
    answers, with the grammar worker busy for a minute: the drain, exit 0, within 3 s (it waited
    for the warm-up at the interpreter's exit: 10.5 s under load)."""
    s = Starting(stories_path, env=with_hook(tmp_path, SLOW_WARMUP))
    s.wait_for("Started server process")
    code, _ = s.stop(sig)
    assert code == 0, f"exit {code} {GONE_WITHIN_S} s after {sig.name}:\n{s.output[-3000:]}"
    assert "Finished server process" in s.output
    assert "slow warm-up running" in s.output          # the worker was busy when serve ended
