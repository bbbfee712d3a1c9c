"""A real server on an ephemeral loopback port: uvicorn in a thread over stories260k."""
import contextlib
import resource
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

import pagedecode as pd

TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}{{ bos_token }}{{ m['content'] }}{% endif %}"
            "{% endfor %}{% if add_generation_prompt %} Answer:{% endif %}")


class Running:
    def __init__(self, url, app, ae, server, thread):
        self.url, self.app, self.ae, self.server, self.thread = url, app, ae, server, thread

    @property
    def state(self):
        return self.app.state.pagedecode

    @property
    def engine(self):
        return self.ae.engine


def start_server(stories_path, *, api_key=None, template=TEMPLATE, engine_options=None, warm_grammar=True,
                 **build_options):
    """warm_grammar: return once the grammar backend has warmed (serve warms it while it starts
    answering), so that no test measures the import beside its own requests."""
    import uvicorn

    from pagedecode.server import build_app
    from pagedecode.server.chat import ChatTemplate, load_template
    from pagedecode.server.serve import generation_defaults, lifespan
    engine = pd.Engine.from_pretrained(stories_path, **{"model_name": "stories260k", "max_batch_size": 32,
                                                        **(engine_options or {})})
    _, specials = load_template(stories_path)
    ae = pd.AsyncEngine(engine)
    app = build_app(ae, model_name="stories260k", api_key=api_key,
                    chat_template=ChatTemplate(template, specials) if template else None,
                    generation_defaults=generation_defaults(stories_path), **build_options)
    app.router.lifespan_context = lifespan(ae, app, grace_s=2.0)
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(400):
        if server.started:
            break
        time.sleep(0.025)
    assert server.started, "server did not start"
    warming = engine.warm_grammar() if warm_grammar else None
    if warming is not None:
        warming.result(timeout=120)
    port = server.servers[0].sockets[0].getsockname()[1]
    return Running(f"http://127.0.0.1:{port}", app, ae, server, thread)


@contextlib.contextmanager
def slow_steps(engine, seconds=0.01):
    """Each engine step takes at least `seconds` while inside: a test whose client must leave
    while its request still runs does not race a fast machine (400 steps of stories260k finish
    within half a second on CI's)."""
    step = engine.step

    def slow():
        time.sleep(seconds)
        return step()
    engine.step = slow
    try:
        yield
    finally:
        del engine.step


def stop_server(s):
    s.server.should_exit = True
    s.thread.join(timeout=30)
    assert not s.thread.is_alive()


@pytest.fixture(scope="module")
def server(stories_path):
    s = start_server(stories_path, api_key="sekret")
    yield s
    stop_server(s)


class Serve:
    """`python -m pagedecode.cli serve ...` with its output collected by a thread."""

    def __init__(self, stories_path, *args, fd_limit=None, session=False):
        def limit():
            if fd_limit is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (fd_limit, fd_limit))
        self.p = subprocess.Popen([sys.executable, "-m", "pagedecode.cli", "serve", "--model", str(stories_path),
                                   "--port", "0", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, preexec_fn=limit, start_new_session=session)
        self.lines = []
        self.port = None
        started = threading.Event()

        def read():
            for line in self.p.stdout:
                self.lines.append(line)
                if self.port is None and "Uvicorn running on" in line:
                    self.port = int(line.rsplit(":", 1)[1].split()[0])
                    started.set()
            started.set()
        threading.Thread(target=read, daemon=True).start()
        started.wait(120)
        assert self.port, "server did not start:\n" + "".join(self.lines)
        self.url = f"http://127.0.0.1:{self.port}"

    @property
    def output(self):
        return "".join(self.lines)

    def connect(self):
        return socket.create_connection(("127.0.0.1", self.port), timeout=10)

    def stop(self):
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
        return self.p.wait(timeout=60)


@pytest.fixture
def serve(stories_path):
    started = []

    def start(*args, **kw):
        s = Serve(stories_path, *args, **kw)
        started.append(s)
        return s
    yield start
    for s in started:
        if s.p.poll() is None:
            s.p.kill()
            s.p.wait()
