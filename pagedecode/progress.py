"""Progress bars for long work (loading a model's layers, downloads: model/hub.py), shown only
when stderr is a terminal: a log file or a test's captured output gets no carriage-return noise."""
from __future__ import annotations

import sys
from typing import Iterable, TypeVar

T = TypeVar("T")


def progress(items: Iterable[T], what: str, total: int | None = None) -> Iterable[T]:
    """`items`, drawn as a tqdm bar labelled `what` on a terminal; unchanged anywhere else."""
    if not sys.stderr.isatty():
        return items
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    return tqdm(items, desc=what, total=total, leave=False, unit="layer" if "layer" in what else "it")
