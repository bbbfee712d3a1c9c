"""One chat-template render's account (template_sandbox.py draws on it): the limits it may
spend, its deadline and steps left, the expanded sizes of the values it has made, and the render
itself, which streams the output and cuts it at max_chars. The running render's budget is a
context variable, so the sandbox's operators and filters find it without being handed it."""
from __future__ import annotations

import time
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Iterable

from jinja2.utils import Namespace


@dataclass(frozen=True)
class TemplateLimits:
    """What one render may spend (safe defaults; `serve --chat-template-*` sets them)."""
    time_s: float = 1.0            # wall time of one render
    max_chars: int = 4 << 20       # the output's length, and any one value's expanded size
    max_steps: int = 1_000_000     # loop iterations plus items yielded by lazy filters

    def __post_init__(self) -> None:
        if not (self.time_s > 0 and self.max_chars >= 1 and self.max_steps >= 1):
            raise ValueError(f"template limits must be positive, got {self}")


class TemplateLimitError(Exception):
    """A render crossed one of its TemplateLimits."""


class RenderBudget:
    """One render's account: its deadline, steps left, and the expanded sizes it has measured
    (by id, each object kept alive here so its id is not reused while the render runs)."""

    def __init__(self, limits: TemplateLimits) -> None:
        self.limits = limits
        self.deadline = time.monotonic() + limits.time_s
        self.steps_left = limits.max_steps
        self._sizes: dict[int, tuple[Any, int]] = {}

    def step(self) -> None:
        self.steps_left -= 1
        if self.steps_left < 0:
            raise TemplateLimitError(f"more than {self.limits.max_steps} loop steps")
        if self.steps_left & 255 == 0:
            self.check_time()

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateLimitError(f"rendering took longer than {self.limits.time_s}s")

    def allow(self, size: int, what: str) -> None:
        if size > self.limits.max_chars:
            raise TemplateLimitError(f"{what} would be {size} characters (at most {self.limits.max_chars})")

    def size_of(self, value: Any) -> int:
        """The expanded size of `value`: at most about what str(value) prints, stopping early
        (and saying so by a size over the limit) once it passes max_chars."""
        if isinstance(value, str):
            return len(value)
        if isinstance(value, bool) or value is None or isinstance(value, float):
            return 5
        if isinstance(value, int):
            return value.bit_length() * 3 // 10 + 1
        known = self._sizes.get(id(value))
        if known is not None:
            return known[1]
        if isinstance(value, dict):
            items: Iterable[Any] = (x for kv in value.items() for x in kv)
        elif isinstance(value, (list, tuple, set, frozenset)):
            items = value
        elif isinstance(value, Namespace):
            items = object.__getattribute__(value, "_Namespace__attrs").values()
        else:
            return 8
        total = 2
        for item in items:
            total += self.size_of(item) + 2
            if total > self.limits.max_chars:
                break
        self._sizes[id(value)] = (value, total)
        return total

    def checked(self, value: Any, what: str) -> Any:
        self.check_time()
        self.allow(self.size_of(value), what)
        return value


_CURRENT: ContextVar[RenderBudget | None] = ContextVar("pagedecode_template_budget", default=None)


def budget() -> RenderBudget:
    """The running render's budget; outside a render (jinja folding constants at compile
    time) a fresh default one, so a constant too large to fold is left for the render to refuse."""
    return _CURRENT.get() or RenderBudget(TemplateLimits())


def render_bounded(template: Any, limits: TemplateLimits, variables: dict[str, Any]) -> str:
    """The template's output for `variables`, or TemplateLimitError."""
    b = RenderBudget(limits)
    token = _CURRENT.set(b)
    try:
        out: list[str] = []
        size = 0
        for chunk in template.generate(**variables):
            size += len(chunk)
            b.allow(size, "the output")
            b.check_time()
            out.append(chunk)
        return "".join(out)
    except RecursionError:
        raise TemplateLimitError("recursion too deep") from None
    except MemoryError:
        raise TemplateLimitError("out of memory") from None
    finally:
        _CURRENT.reset(token)
