"""What the benchmarks share: where results go (never over a committed file unless --out says
so), and a PNG beside each JSON when matplotlib is installed (`make bench` installs it)."""
from __future__ import annotations

import json
import sys
import time
from datetime import date
from pathlib import Path
from typing import Any, Callable

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
