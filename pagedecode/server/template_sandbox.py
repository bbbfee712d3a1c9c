"""A jinja2 sandbox whose every render ends, quickly, in bounded memory.

A chat template comes from the model file, which may be hostile: `{{ 'x' * 10**9 }}`,
`{{ '%0999999999d' % 1 }}`, `{{ messages|tojson(indent=10**8) }}` allocate gigabytes in one C call;
nested `range(100000)` loops never end. A Python thread cannot be stopped from outside, so
the bounds are inside the sandbox, checked before anything large is built:

- every value the template makes has an expanded size (a string's length, a container's items
  counted as often as `str()` would print them, an integer's digits) of at most
  `TemplateLimits.max_chars`: `*`, `+` and `**` are checked before they run, and the results
  of calls, filters, `~` and list / dict literals after (small inputs cannot make a large
  result before the check: the amplifiers are the operators and the arguments below);
- an integer argument larger than `max_chars` (a width, a count, a size) is refused, as is a
  number that large in a `%` or `str.format` pattern;
- `join`, `replace`, `indent`, `sum` and `tojson` are bounded by what they would produce;
- every loop iteration and every item a lazy filter yields is a step: at most `max_steps`, and
  the clock is read each 256 steps and at each operator, call and output chunk;
- the output, streamed, is cut at `max_chars`.

Any bound crossed raises TemplateLimitError, which names the bound. The render's account (its
limits, deadline, steps and measured sizes) and the render itself: template_budget.py.
"""
from __future__ import annotations

import json
import operator
import re
from functools import wraps
from typing import Any, Callable, Iterable, Iterator

from jinja2 import nodes
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

from .template_budget import RenderBudget, TemplateLimitError, budget

QUADRATIC_INPUT = 16 << 10       # striptags / urlize / wordwrap scan their input per match
_NUMBER = re.compile(r"\d+")


def _small_ints(args: Iterable[Any], what: str) -> None:
    most = budget().limits.max_chars
    for a in args:
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > most:
            raise TemplateLimitError(f"{what}: an argument of {a} (at most {most})")


def _pattern(text: Any, what: str) -> None:
    """A `%` or str.format pattern's widths and precisions, each at most max_chars."""
    if isinstance(text, str):
        _small_ints((int(n) if len(n) <= 12 else 1 << 62 for n in _NUMBER.findall(text)), what)


# -- operators --------------------------------------------------------------------------------
def _multiply(left: Any, right: Any) -> Any:
    b = budget()
    if isinstance(left, int) and isinstance(right, int):
        b.allow((left.bit_length() + right.bit_length()) * 3 // 10, "a product")
    elif isinstance(right, int) and not isinstance(left, (int, float)):
        b.allow(b.size_of(left) * max(right, 0), "a repetition")
    elif isinstance(left, int) and not isinstance(right, (int, float)):
        b.allow(b.size_of(right) * max(left, 0), "a repetition")
    return operator.mul(left, right)


def _power(left: Any, right: Any) -> Any:
    if isinstance(left, int) and isinstance(right, int) and right > 0:
        budget().allow(left.bit_length() * right * 3 // 10, "a power")
    return operator.pow(left, right)


def _add(left: Any, right: Any) -> Any:
    b = budget()
    if not isinstance(left, (int, float)):
        b.allow(b.size_of(left) + b.size_of(right), "a sum")
    return operator.add(left, right)


def _modulo(left: Any, right: Any) -> Any:
    if isinstance(left, str):
        _pattern(left, "a % format")
        _small_ints(right if isinstance(right, tuple) else (right,), "a % format")
    return budget().checked(operator.mod(left, right), "a % format")


# -- filters ----------------------------------------------------------------------------------
def _join(items: Iterable[Any], d: str = "", attribute: Any = None) -> str:
    b = budget()
    values = [x if attribute is None else x[attribute] if isinstance(x, dict) else getattr(x, attribute, "")
              for x in items]
    b.allow(sum(b.size_of(v) for v in values) + len(d) * len(values), "a join")
    return d.join(map(str, values))


def _replace(s: Any, old: str, new: str, count: int | None = None) -> str:
    text = str(s)
    hits = text.count(old) + (1 if old == "" else 0) if count is None else count
    budget().allow(len(text) + max(hits, 0) * len(new), "a replace")
    return text.replace(old, new) if count is None else text.replace(old, new, count)


def _indent(s: str, width: int | str = 4, first: bool = False, blank: bool = False) -> str:
    pad = " " * width if isinstance(width, int) else str(width)
    budget().allow(len(s) + (s.count("\n") + 1) * len(pad), "an indent")
    return _JINJA_INDENT(s, width, first, blank)


def _sum(iterable: Iterable[Any], attribute: Any = None, start: Any = 0) -> Any:
    b = budget()
    items = [getattr(x, attribute) if attribute is not None else x for x in iterable]
    if all(isinstance(x, (int, float)) for x in items) and isinstance(start, (int, float)):
        b.allow(max((abs(int(x)).bit_length() for x in items), default=0) * 3 // 10 + len(items), "a sum")
        return sum(items, start)
    b.allow(b.size_of(start) + sum(b.size_of(x) for x in items), "a sum")
    total = start                      # lists and tuples added once each, not rebuilt per item
    for x in items:
        total = total + x
        b.step()
    return total


def _tojson(value: Any, indent: int | str | None = None) -> str:
    """json.dumps, streamed and cut at max_chars (an indent multiplies by the nesting depth)."""
    b = budget()
    out: list[str] = []
    size = 0
    for chunk in json.JSONEncoder(ensure_ascii=False, indent=indent).iterencode(value):
        size += len(chunk)
        b.allow(size, "tojson")
        out.append(chunk)
    return "".join(out)


def _string(value: Any) -> str:
    return budget().checked(str(value), "a string")


def _small_input(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
    @wraps(f)
    def bounded(value: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(value, str) and len(value) > QUADRATIC_INPUT:
            raise TemplateLimitError(f"|{name} on {len(value)} characters (at most {QUADRATIC_INPUT})")
        return f(value, *args, **kwargs)
    return bounded


def _guarded(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
    """A filter with its integer arguments checked, its lazy results counted as steps and its
    result's size checked. (wraps copies jinja's pass_context / pass_environment mark: those
    filters get the context or environment first, then the value.)"""
    value_at = 1 if hasattr(f, "jinja_pass_arg") else 0

    @wraps(f)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        _small_ints((*args[value_at + 1:], *kwargs.values()), f"|{name}")
        if name == "format" and len(args) > value_at:
            _pattern(args[value_at], "|format")
        result = f(*args, **kwargs)
        if isinstance(result, Iterator) and not isinstance(result, str):
            return _steps(result)
        return budget().checked(result, f"|{name}")
    return guarded


_JINJA_INDENT: Callable[..., str] = ImmutableSandboxedEnvironment().filters["indent"]


# -- the template's syntax tree: loops stepped, concatenations and literals sized -------------
class _Bounding(NodeTransformer):
    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        node.iter = nodes.Filter(node.iter, "_pagedecode_steps", [], [], None, None, lineno=node.lineno)
        return node

    def _sized(self, node: nodes.Expr) -> nodes.Node:
        self.generic_visit(node)
        return nodes.Filter(node, "_pagedecode_sized", [], [], None, None, lineno=node.lineno)

    visit_Concat = visit_List = visit_Dict = visit_Tuple = _sized


def _steps(items: Iterable[Any]) -> Iterator[Any]:
    """A loop's (or a lazy filter's) items, each a step."""
    b = budget()
    for item in items:
        b.step()
        yield item


def _sized(value: Any) -> Any:
    return budget().checked(value, "a value")


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """ImmutableSandboxedEnvironment with the bounds above; render with `render_bounded`."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.binop_table.update({"*": _multiply, "**": _power, "+": _add, "%": _modulo})
        bounded = {"join": _join, "replace": _replace, "indent": _indent, "sum": _sum, "tojson": _tojson,
                   "string": _string, "pprint": _string}
        for name in ("striptags", "urlize", "wordwrap"):
            bounded[name] = _small_input(name, self.filters[name])
        self.filters.update(bounded)
        for name, f in list(self.filters.items()):
            self.filters[name] = _guarded(name, f)
        self.filters["_pagedecode_steps"] = _steps
        self.filters["_pagedecode_sized"] = _sized

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        tree = super()._parse(source, name, filename)
        return _Bounding().visit(tree)          # type: ignore[no-any-return]

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        budget().check_time()
        return self.binop_table[operator](left, right)

    def call(__self, __context: Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        b = budget()
        b.check_time()
        _small_ints((*args, *kwargs.values()), getattr(__obj, "__name__", "a call"))
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str):
            method = getattr(__obj, "__name__", "")
            if method == "join" and args:
                return _join(args[0], owner)
            if method == "replace" and len(args) >= 2:
                return _replace(owner, *args)
        result = super().call(__context, __obj, *args, **kwargs)
        if isinstance(result, Iterator) and not isinstance(result, str):
            return _steps(result)
        return b.checked(result, getattr(__obj, "__name__", "a call"))

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        wrapped = super().wrap_str_format(value)
        if wrapped is not None:                  # str.format / format_map: its pattern's widths
            _pattern(value.__self__, "str.format")
        return wrapped

    def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
        return not isinstance(obj, RenderBudget) and super().is_safe_attribute(obj, attr, value)
