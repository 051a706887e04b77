"""tests/deploy/promql.py: metric names from PromQL and Grafana queries."""

from __future__ import annotations

import pytest

from .promql import Matcher, base_names, grafana_query_metric_names, metric_names, selectors


def test_plain_and_colon_names() -> None:
    assert metric_names("up") == {"up"}
    assert metric_names("vllm:num_requests_running") == {"vllm:num_requests_running"}
    assert metric_names(":weird:name_") == {":weird:name_"}


def test_label_matchers_are_kept_and_not_taken_for_names() -> None:
    (sel,) = selectors('vllm:kv_cache_usage_perc{model_name=~"$model_name", job!="x, y}"}')
    assert sel.name == "vllm:kv_cache_usage_perc"
    assert sel.matchers == (
        Matcher("model_name", "=~", "$model_name"),
        Matcher("job", "!=", "x, y}"),
    )
    assert sel.matcher("instance") is None


def test_functions_aggregations_and_label_lists_are_not_names() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (model_name, le) (rate(vllm:ttft_bucket{a="b"}'
        "[$__rate_interval])))"
    )
    assert metric_names(expr) == {"vllm:ttft_bucket"}
    assert metric_names("sum(rate(a_total[5m])) without (instance, pod)") == {"a_total"}
    assert metric_names("max without(le) (b)") == {"b"}


def test_binary_operators_and_vector_matching() -> None:
    expr = "a / on(x) group_left(y, z) b * ignoring(w) c > bool 1 and d or e unless f"
    assert metric_names(expr) == {"a", "b", "c", "d", "e", "f"}
    assert metric_names("a * on() group_right g") == {"a", "g"}


def test_literals_durations_and_modifiers_are_skipped() -> None:
    expr = (
        'label_replace(a, "dst", "$1", "src", "(.*)") + count_values("v", b) '
        "+ topk(5, c offset 1h30m) + d @ start() + e[5m:1m] + 0x1F + 1.5e3 + Inf - NaN"
    )
    assert metric_names(expr) == {"a", "b", "c", "d", "e"}


def test_template_variables_are_skipped() -> None:
    expr = "topk($n, a) + topk(${k}, b[${__range}]) + c[[[interval]]] + [[q]] * d"
    assert metric_names(expr) == {"a", "b", "c", "d"}


def test_name_given_by_matcher_and_comments() -> None:
    assert metric_names('{__name__="a", job="j"}\n# b is commented out\n+ {"c.d"}') == {
        "a",
        "c.d",
    }
    (sel,) = selectors('{__name__="a", job="j"}')
    assert sel.matchers == (Matcher("job", "=", "j"),)
    assert selectors('{job="j"}')[0].name is None


@pytest.mark.parametrize(
    "bad",
    [
        "sum(rate(a[5m])",  # unbalanced
        "rate(a[5m]))",
        'a{job="x"',  # unclosed matcher list
        "a{job=x}",  # unquoted value
        'a{job=~"x" "y"}',
        "a ; b",
        '{__name__=~"vllm:.*"}',  # a name we cannot resolve
        '{__name__="a"} + b{__name__="c"}',
    ],
)
def test_malformed_or_unresolvable_input_raises(bad: str) -> None:
    with pytest.raises(ValueError):
        selectors(bad)


def test_grafana_variable_queries() -> None:
    assert grafana_query_metric_names('label_values(vllm:x{model_name=~"m"}, model_name)') == {
        "vllm:x"
    }
    assert grafana_query_metric_names("label_values(model_name)") == set()
    assert grafana_query_metric_names("label_names()") == set()
    assert grafana_query_metric_names("query_result(topk(1, a))") == {"a"}
    assert grafana_query_metric_names("sum(b)") == {"b"}


def test_base_names_strip_only_known_histograms() -> None:
    names = {
        "h_bucket",
        "h_sum",
        "h_count",
        "it_total_bucket",
        "c_count",
        "g",
        "h",
    }
    assert base_names(names, {"h", "it_total"}) == {"h", "it_total", "c_count", "g"}
    assert base_names(["h_bucket"], []) == {"h_bucket"}
