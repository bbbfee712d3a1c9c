"""What the benchmarks share: where results go (never over a committed file unless --out says
so), a PNG beside each JSON when matplotlib is installed (`make bench` installs it), and the
side-by-side runs of source trees, idle or beside a busy neighbour."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from datetime import date
from pathlib import Path
from typing import Any, Callable, Iterator

RESULTS = Path(__file__).resolve().parent / "results"


def result_path(name: str, out: str | None) -> Path:
    """--out as given, else a new file benchmarks/results/<name>-<date>-<unix time>.json."""
    if out:
        path = Path(out)
    else:
        stem = f"{name}-{date.today().isoformat()}-{int(time.time())}"
        path, n = RESULTS / f"{stem}.json", 1
        while path.exists():                       # two runs in one second
            n += 1
            path = RESULTS / f"{stem}-{n}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def write_json(path: Path, result: Any) -> None:
    path.write_text(json.dumps(result, indent=1) + "\n")


def plot(path: Path, draw: Callable[[Any], Any], size: tuple[float, float] = (10, 4), ncols: int = 1) -> None:
    """draw(axes) on a new figure, saved as path's .png."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (make bench installs it)", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, ncols, figsize=size)
    draw(axes)
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=110)
    plt.close(fig)


def run_in_tree(tree: str | Path, code: str, timeout: float = 1800) -> Any:
    """`python -c code` with the source tree's pagedecode (and its compiled extension) imported: its
    own process, the tree as working directory (which -c puts before PYTHONPATH) and on PYTHONPATH;
    the JSON of its last line of output."""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, cwd=tree,
                       env={**os.environ, "PYTHONPATH": str(tree)})
    if p.returncode:
        raise SystemExit(f"{tree}: {p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


@contextlib.contextmanager
def busy_neighbours(n: int = 1) -> Iterator[None]:
    """n processes spinning on a core each (`while 1: pass`) while the block runs."""
    busy = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for p in busy:
            p.kill()
            p.wait()
