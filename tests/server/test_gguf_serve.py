"""`pagedecode serve --model FILE.gguf`: the real command in its own process, driven by the
openai client."""
import os
import re
import subprocess
import sys
import time

import pytest


@pytest.mark.parametrize("extra", [[], ["--kv-cache-dtype", "float16"]])
def test_serve_a_gguf_file(stories_path, extra):
    """The second: a half-size KV cache (EngineConfig.kv_cache_dtype through serve's flag), the
    same greedy text."""
    gguf = stories_path / "source" / "stories260K.gguf"
    if not gguf.is_file():
        pytest.skip(f"{gguf} not found")
    import openai
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "pagedecode.cli", "serve", "--model", str(gguf), "--port", "0",
                             "--grace-seconds", "1", *extra],
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        url, lines = None, []
        deadline = time.monotonic() + 120
        assert proc.stderr is not None
        while url is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            lines.append(line)
            if not line and proc.poll() is not None:
                break
            m = re.search(r"Uvicorn running on (http://\S+)", line)
            url = m.group(1) if m else None
        assert url, f"server did not start (exit {proc.poll()})"
        cache = "float16" if extra else "float32"
        assert any(re.search(rf"stories260K: weights [\d.]+ MB \(float32 [\d.]+ MB.*\), KV cache of \d+ tokens in "
                             rf"{cache} \([\d.]+ MB\), \d+ threads", ln) for ln in lines), "".join(lines)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
        assert [m.id for m in client.models.list().data] == ["stories260K"]
        r = client.completions.create(model="stories260K", prompt="Once upon a time", max_tokens=16, temperature=0)
        assert r.choices[0].text == ", there was a little girl named Lily. She loved to play"
        with pytest.raises(openai.BadRequestError):           # the file has no chat template
            client.chat.completions.create(model="stories260K", messages=[{"role": "user", "content": "Hi"}])
    finally:
        proc.terminate()
        proc.wait(timeout=30)
