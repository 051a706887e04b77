"""Find the metric names that PromQL expressions refer to.

This is not a PromQL parser. It is a lexer plus the few rules needed to tell a metric
name apart from a function, an aggregation, a keyword or a label name, which is all the
observability tests need. Grafana template variables (`$var`, `${var}`, `${var:fmt}`,
`[[var]]`) are accepted wherever PromQL allows a value or a duration.

Names are returned exactly as written (`foo_bucket` stays `foo_bucket`); `base_names`
maps histogram series back to the histogram's name when the caller says which
histograms exist.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")

# Keywords that are followed by a parenthesised list of label names, not an expression.
_LABEL_LIST_KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
_KEYWORDS = _LABEL_LIST_KEYWORDS | {"bool", "offset", "and", "or", "unless", "atan2", "inf", "nan"}

_STRING = r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`'
_TEMPLATE_VAR = r"\$\{[^}]*\}|\$\w+|\[\[[^\]]*\]\]"
_TOKEN = re.compile(
    rf"""
    (?P<space>\s+|\#[^\n]*)
  | (?P<string>{_STRING})
  | (?P<range>\[(?:\[\[[^\]]*\]\]|[^\[\]])*\])
  | (?P<var>{_TEMPLATE_VAR})
  | (?P<duration>(?:\d+(?:ms|[smhdwy]))+(?![\w:]))
  | (?P<number>0[xX][0-9a-fA-F]+|(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<brace>\{{)
  | (?P<op>==|!=|>=|<=|[-+*/%^<>(),@])
    """,
    re.VERBOSE,
)
_MATCHER_TOKEN = re.compile(
    rf"""
    (?P<space>\s+)
  | (?P<string>{_STRING})
  | (?P<ident>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<op>=~|!~|!=|=)
  | (?P<comma>,)
  | (?P<close>\}})
    """,
    re.VERBOSE,
)


@dataclass(frozen=True)
class Matcher:
    """One label matcher of a selector, e.g. `model_name=~"$model_name"`."""

    label: str
    op: str
    value: str


@dataclass(frozen=True)
class Selector:
    """A vector selector: its metric name (None when it has none) and its label matchers."""

    name: str | None
    matchers: tuple[Matcher, ...]

    def matcher(self, label: str) -> Matcher | None:
        return next((m for m in self.matchers if m.label == label), None)


@dataclass(frozen=True)
class _Token:
    kind: str
    text: str
    matchers: tuple[Matcher, ...] = ()


def _unquote(literal: str) -> str:
    body = literal[1:-1]
    if literal[0] == "`":
        return body
    return re.sub(r"\\(.)", r"\1", body)


def _lex_matchers(expr: str, pos: int) -> tuple[tuple[Matcher, ...], int]:
    """Read the label matchers after the `{` at `expr[pos - 1]`; return them and the end."""
    matchers: list[Matcher] = []
    pending: list[tuple[str, str]] = []  # the current item's tokens, as (kind, text)
    while True:
        m = _MATCHER_TOKEN.match(expr, pos)
        if m is None:
            raise ValueError(f"bad label matcher at offset {pos} in {expr!r}")
        pos = m.end()
        kind = m.lastgroup
        if kind == "space":
            continue
        if kind in ("comma", "close"):
            if pending:
                matchers.append(_matcher_from(pending, expr))
                pending = []
            if kind == "close":
                return tuple(matchers), pos
            continue
        pending.append((str(kind), m.group()))


def _matcher_from(item: list[tuple[str, str]], expr: str) -> Matcher:
    kinds = [kind for kind, _ in item]
    if kinds == ["string"]:  # Prometheus 3: {"metric.name", ...}
        return Matcher("__name__", "=", _unquote(item[0][1]))
    if len(item) == 3 and kinds[0] in ("ident", "string") and kinds[1:] == ["op", "string"]:
        label = item[0][1] if kinds[0] == "ident" else _unquote(item[0][1])
        return Matcher(label, item[1][1], _unquote(item[2][1]))
    raise ValueError(f"bad label matcher {' '.join(t for _, t in item)!r} in {expr!r}")


def _tokens(expr: str) -> list[_Token]:
    tokens: list[_Token] = []
    pos, depth = 0, 0
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if m is None:
            raise ValueError(f"unexpected {expr[pos]!r} at offset {pos} in {expr!r}")
        kind, text = str(m.lastgroup), m.group()
        pos = m.end()
        if kind == "space":
            continue
        if kind == "brace":
            matchers, pos = _lex_matchers(expr, pos)
            tokens.append(_Token("selector", text, matchers))
            continue
        if text == "(":
            depth += 1
        elif text == ")":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ')' at offset {pos - 1} in {expr!r}")
        tokens.append(_Token(kind, text))
    if depth:
        raise ValueError(f"unbalanced '(' in {expr!r}")
    return tokens


def _skip_parens(tokens: list[_Token], i: int) -> int:
    """Index just past the parenthesised group that starts at tokens[i]."""
    depth = 0
    for j in range(i, len(tokens)):
        if tokens[j].kind == "op" and tokens[j].text in "()":
            depth += 1 if tokens[j].text == "(" else -1
            if depth == 0:
                return j + 1
    raise AssertionError("_tokens checked that parentheses balance")


def _selector(name: str | None, matchers: tuple[Matcher, ...], expr: str) -> Selector:
    for m in matchers:
        if m.label != "__name__":
            continue
        if m.op != "=":
            raise ValueError(f"metric name given by a {m.op!r} matcher in {expr!r}")
        if name is not None and name != m.value:
            raise ValueError(f"two metric names, {name!r} and {m.value!r}, in {expr!r}")
        name = m.value
    return Selector(name, tuple(m for m in matchers if m.label != "__name__"))


def selectors(expr: str) -> list[Selector]:
    """Every vector selector in `expr`, in order. Raises ValueError on input it can't lex."""
    tokens = _tokens(expr)
    found: list[Selector] = []
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        nxt = tokens[i + 1] if i + 1 < len(tokens) else None
        if tok.kind == "ident" and tok.text.lower() in _LABEL_LIST_KEYWORDS:
            i = _skip_parens(tokens, i + 1) if nxt is not None and nxt.text == "(" else i + 1
            continue
        if tok.kind == "selector":
            found.append(_selector(None, tok.matchers, expr))
        elif tok.kind == "ident" and tok.text.lower() not in _KEYWORDS:
            is_call = nxt is not None and (
                nxt.text == "(" or (nxt.kind == "ident" and nxt.text in ("by", "without"))
            )
            if not is_call:
                has_matchers = nxt is not None and nxt.kind == "selector"
                found.append(
                    _selector(tok.text, nxt.matchers if nxt and has_matchers else (), expr)
                )
                i += 2 if has_matchers else 1
                continue
        i += 1
    return found


def metric_names(expr: str) -> set[str]:
    """The metric names `expr` selects, exactly as written (`foo_bucket` stays so)."""
    return {s.name for s in selectors(expr) if s.name is not None}


def grafana_query_metric_names(query: str) -> set[str]:
    """Metric names in a Grafana Prometheus variable query or a plain PromQL expression.

    Handles `label_values(selector, label)`, `label_values(label)`, `label_names()`,
    `metrics(regex)` and `query_result(expr)`.
    """
    m = re.fullmatch(
        r"\s*(label_values|label_names|metrics|query_result)\s*\((.*)\)\s*", query, re.S
    )
    if m is None:
        return metric_names(query)
    func, args = m.groups()
    if func == "query_result":
        return metric_names(args)
    if func == "label_values" and "," in args:
        return metric_names(args.rsplit(",", 1)[0])
    return set()


def base_names(names: Iterable[str], histogram_names: Iterable[str]) -> set[str]:
    """Map `h_bucket`, `h_sum` and `h_count` to `h` where `h` is in `histogram_names`.

    Other names pass through unchanged, so `foo_count` stays `foo_count` unless `foo` is
    a known histogram.
    """
    histograms = set(histogram_names)
    out: set[str] = set()
    for name in names:
        for suffix in HISTOGRAM_SUFFIXES:
            if name.endswith(suffix) and name[: -len(suffix)] in histograms:
                name = name[: -len(suffix)]
                break
        out.add(name)
    return out
