"""Prometheus metrics under vLLM's V1 names, so existing dashboards and autoscalers work.

Every series carries `model_name`. The registry belongs to the app: no global state.
"""

from __future__ import annotations

import logging
import os

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, multiprocess

from engine import FinishedRequestStats, IterationStats, SchedulerStats
from server.cpu_metrics import EngineCpuCollector

request_logger = logging.getLogger("pagedserve.requests")

# Buckets span a fast GPU (milliseconds) and a small CPU box (tens of seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)  # fmt: skip
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
               0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
               30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000,
                 50000, 100000)  # fmt: skip
FINISH_REASONS = ("stop", "length", "abort")
# Why admission turned a request away: the limit (flag) it hit.
REJECTION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens", "tenant_concurrency")


# The /v1 routes, as `pagedserve:api_requests_total` names them; other paths are "other".
API_ROUTES = frozenset(
    {"/v1/completions", "/v1/chat/completions", "/v1/completions/render",
     "/v1/chat/completions/render", "/v1/embeddings", "/v1/responses", "/v1/models"}
)  # fmt: skip
_RESPONSE_ROUTES = ("cancel", "input_items")


def api_endpoint(method: str, path: str) -> str:
    """`POST /v1/responses`, `GET /v1/responses/{id}`, ...: a bounded set of label values."""
    if path.startswith("/v1/responses/"):
        _, _, tail = path.removeprefix("/v1/responses/").partition("/")
        path = "/v1/responses/{id}" + (f"/{tail}" if tail in _RESPONSE_ROUTES else "")
    elif path not in API_ROUTES:
        path = "other"
    return f"{method} {path}"


class ServerMetrics:
    def __init__(
        self,
        model_name: str,
        registry: CollectorRegistry | None = None,
        log_requests: bool = True,
        tenant_metrics: bool = False,
        engine_stats: bool = True,
        engine_pid: int | None = None,
    ) -> None:
        """`engine_stats`: this process publishes the engine's gauges and counters (with
        several frontends, only frontend 0 does, so that they count once). `engine_pid`:
        the process that steps the engine, whose CPU waits are read at each scrape
        (server.cpu_metrics)."""
        # vLLM exposes no `_created` series; neither do we (a prometheus_client switch).
        prometheus_client.disable_created_metrics()
        self.registry = registry or CollectorRegistry()
        self.engine_stats = engine_stats
        self.model_name = model_name
        self.log_requests = log_requests
        gauge, counter, hist = self._gauge, self._counter, self._histogram
        self.running = gauge("vllm:num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge(
            "vllm:kv_cache_usage_perc", "Fraction of KV cache blocks held by requests (0-1)."
        )
        self.beside_decodes = gauge(
            "pagedserve:prefill_tokens_beside_decodes",
            "Most prompt tokens the next step may carry beside decodes "
            "(--prefill-time-beside-decodes; 0: no cap but the step budget).",
        )
        self.cache_config = Gauge(
            "vllm:cache_config_info",
            "KV cache configuration (value is always 1).",
            ["model_name", "block_size", "num_gpu_blocks", "enable_prefix_caching"],
            registry=self.registry,
            multiprocess_mode="livemax",
        )
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prompt tokens served from the cache.")
        self.preemptions = counter("vllm:num_preemptions", "Requests preempted.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Generation tokens produced.")
        self.success = counter(
            "vllm:request_success", "Finished requests by finish reason.", "finished_reason"
        )
        self.errors = counter(
            "pagedserve:request_errors", "HTTP requests answered with an error status.", "code"
        )
        self.api_requests = Counter(
            "pagedserve:api_requests",
            "OpenAI API requests answered, by endpoint (method and route) and status code.",
            ["model_name", "endpoint", "code"],
            registry=self.registry,
        )
        self.rejected = counter(
            "pagedserve:requests_rejected",
            "Requests turned away by admission control (503) or a tenant's limit (429).",
            "reason",
        )
        self.tenants = TenantCounters(self.registry, model_name) if tenant_metrics else None
        self.cpu = None if engine_pid is None else EngineCpuCollector(engine_pid, model_name)
        if self.cpu is not None:
            self.registry.register(self.cpu)
        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Time between tokens.", ITL_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Request latency.", E2E_BUCKETS)
        self.queue_time = hist(
            "vllm:request_queue_time_seconds", "Time queued before first scheduled.", E2E_BUCKETS
        )
        self.iteration_tokens = hist(
            "vllm:iteration_tokens_total", "Tokens scheduled per engine step.", TOKEN_BUCKETS
        )
        # Speculative decoding (--speculative-config), under vLLM's names.
        self.spec_drafts = counter(
            "vllm:spec_decode_num_drafts", "Requests that verified drafts, summed over steps."
        )
        self.spec_draft_tokens = counter(
            "vllm:spec_decode_num_draft_tokens", "Draft tokens verified."
        )
        self.spec_accepted = counter(
            "vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted."
        )
        self.spec_accepted_per_pos = counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by their position among a step's drafts (0: the first).",
            "position",
        )
        self.lora_info: Gauge | None = None  # set_lora
        self.request_prompt_tokens = hist(
            "vllm:request_prompt_tokens", "Prompt length per request.", TOKEN_BUCKETS
        )
        self.request_generation_tokens = hist(
            "vllm:request_generation_tokens", "Generated tokens per request.", TOKEN_BUCKETS
        )
        for reason in FINISH_REASONS:
            self.success.labels(model_name, reason)
        for reason in REJECTION_REASONS:
            self.rejected.labels(model_name, reason)
        # The series record() updates after every step, looked up once (each labels() call
        # takes a lock and hashes its labels).
        self._step_series = tuple(
            metric.labels(model_name)
            for metric in (
                self.running,
                self.waiting,
                self.kv_usage,
                self.prefix_queries,
                self.prefix_hits,
                self.preemptions,
                self.iteration_tokens,
                self.generation_tokens,
                self.ttft,
                self.itl,
                self.queue_time,
                self.beside_decodes,
            )
        )

    def _gauge(self, name: str, doc: str) -> Gauge:
        # With several frontends (multiprocess mode) only frontend 0 sets the engine's
        # gauges; the others hold 0, and every value is at least 0: the maximum is its.
        metric = Gauge(
            name, doc, ["model_name"], registry=self.registry, multiprocess_mode="livemax"
        )
        metric.labels(self.model_name)
        return metric

    def _counter(self, name: str, doc: str, extra_label: str | None = None) -> Counter:
        labels = ["model_name"] + ([extra_label] if extra_label else [])
        metric = Counter(name, doc, labels, registry=self.registry)
        if extra_label is None:
            metric.labels(self.model_name)
        return metric

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        metric = Histogram(name, doc, ["model_name"], buckets=buckets, registry=self.registry)
        metric.labels(self.model_name)
        return metric

    def set_cache_config(self, block_size: int, num_blocks: int, prefix_caching: bool) -> None:
        labels = (self.model_name, str(block_size), str(num_blocks), str(prefix_caching).lower())
        self.cache_config.labels(*labels).set(1)

    def set_lora(self, max_loras: int) -> None:
        """With --enable-lora: vllm:lora_requests_info, as GIE's model-server protocol reads
        it (its LoRA affinity scorer): labels max_lora and the running and waiting adapters
        (comma-separated names), value the time of the last update; only the latest label
        set is kept."""
        self.lora_info = Gauge(
            "vllm:lora_requests_info",
            "LoRA adapters of the running and waiting requests (value: when last updated).",
            ["model_name", "max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            registry=self.registry,
            multiprocess_mode="livemax",
        )
        self._lora_labels = (self.model_name, str(max_loras), "", "")
        self.lora_info.labels(*self._lora_labels).set_to_current_time()

    def _record_loras(self, stats: SchedulerStats) -> None:
        labels = (
            self.model_name,
            self._lora_labels[1],
            ",".join(stats.waiting_loras),
            ",".join(stats.running_loras),
        )
        if labels != self._lora_labels:
            self.lora_info.remove(*self._lora_labels)
            self._lora_labels = labels
        self.lora_info.labels(*labels).set_to_current_time()

    def record(self, stats: SchedulerStats, iteration: IterationStats) -> None:
        """The engine's stats listener: runs on the event loop after every step."""
        running, waiting, kv_usage, queries, hits, preemptions, *rest = self._step_series
        iteration_tokens, generation_tokens, ttft, itl, queue_time, beside_decodes = rest
        if self.engine_stats:
            running.set(stats.num_running)
            beside_decodes.set(stats.prefill_tokens_beside_decodes)
            waiting.set(stats.num_waiting)
            kv_usage.set(stats.kv_cache_usage)
            if stats.prefix_cache_queries:
                queries.inc(stats.prefix_cache_queries)
                hits.inc(stats.prefix_cache_hits)
            if stats.num_preemptions:
                preemptions.inc(stats.num_preemptions)
            if stats.num_scheduled_tokens:
                iteration_tokens.observe(stats.num_scheduled_tokens)
            if stats.spec_num_drafts:
                self._record_drafts(stats)
            if self.lora_info is not None:
                self._record_loras(stats)
        if iteration.num_generation_tokens:
            generation_tokens.inc(iteration.num_generation_tokens)
        for value in iteration.time_to_first_tokens:
            ttft.observe(value)
        for value in iteration.inter_token_latencies:
            itl.observe(value)
        for value in iteration.queue_times:
            queue_time.observe(value)
        for finished in iteration.finished:
            self._record_finished(finished)

    def set_speculative(self, num_speculative_tokens: int) -> None:
        """With speculation on, every draft position's series exists from the start."""
        for position in range(num_speculative_tokens):
            self.spec_accepted_per_pos.labels(self.model_name, str(position))

    def _record_drafts(self, stats: SchedulerStats) -> None:
        name = self.model_name
        self.spec_drafts.labels(name).inc(stats.spec_num_drafts)
        self.spec_draft_tokens.labels(name).inc(stats.spec_num_draft_tokens)
        self.spec_accepted.labels(name).inc(stats.spec_num_accepted_tokens)
        for position, count in enumerate(stats.spec_accepted_per_pos):
            self.spec_accepted_per_pos.labels(name, str(position)).inc(count)

    def _record_finished(self, finished: FinishedRequestStats) -> None:
        name = self.model_name
        self.e2e.labels(name).observe(finished.e2e_latency)
        self.success.labels(name, finished.finish_reason).inc()
        self.request_generation_tokens.labels(name).observe(finished.num_generation_tokens)
        # Usage counts a prompt once, however many choices it has.
        if finished.first_of_prompt:
            self.prompt_tokens.labels(name).inc(finished.num_prompt_tokens)
            self.request_prompt_tokens.labels(name).observe(finished.num_prompt_tokens)
        if self.tenants is not None:
            self.tenants.record(finished)
        if self.log_requests:
            log_request(finished)

    def exposition(self) -> bytes:
        """The text format of every series: this process's, or, in prometheus-client's
        multiprocess mode (several frontends), every live frontend's, summed."""
        if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
            return prometheus_client.generate_latest(self.registry)
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        if self.cpu is not None:
            registry.register(self.cpu)  # read here, by whichever frontend is scraped
        return prometheus_client.generate_latest(registry)

    def count_api_request(self, method: str, path: str, status: int) -> None:
        """An answered request under /v1/ (the route, not the path: one series per route)."""
        self.api_requests.labels(self.model_name, api_endpoint(method, path), str(status)).inc()

    def count_error(self, status: int) -> None:
        self.errors.labels(self.model_name, str(status)).inc()

    def count_rejection(self, reason: str) -> None:
        self.rejected.labels(self.model_name, reason).inc()


class TenantCounters:
    """Per-tenant series, only when --tenant-metrics asks for them: one series per tenant
    and label value, so their number grows with the keys file."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.model_name = model_name
        labels = ["model_name", "tenant"]
        self.requests = Counter(
            "pagedserve:tenant_requests",
            "Finished engine requests (choices) per tenant.",
            [*labels, "finished_reason"],
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "pagedserve:tenant_prompt_tokens",
            "Prompt tokens per tenant.",
            labels,
            registry=registry,
        )
        self.generation_tokens = Counter(
            "pagedserve:tenant_generation_tokens",
            "Generated tokens per tenant.",
            labels,
            registry=registry,
        )

    def record(self, finished: FinishedRequestStats) -> None:
        tenant = finished.labels.get("tenant", "")
        self.requests.labels(self.model_name, tenant, finished.finish_reason).inc()
        if finished.first_of_prompt:
            self.prompt_tokens.labels(self.model_name, tenant).inc(finished.num_prompt_tokens)
        self.generation_tokens.labels(self.model_name, tenant).inc(finished.num_generation_tokens)


def log_request(finished: FinishedRequestStats) -> None:
    """One line per engine request (one choice); never the prompt or completion text."""
    request_logger.info(
        "request finished",
        extra={
            "request_id": finished.request_id,
            "tenant": finished.labels.get("tenant"),
            "user": finished.labels.get("user"),
            "prompt_tokens": finished.num_prompt_tokens,
            "cached_tokens": finished.num_cached_tokens,
            "output_tokens": finished.num_generation_tokens,
            "ttft_s": None if finished.ttft is None else round(finished.ttft, 4),
            "total_s": round(finished.e2e_latency, 4),
            "finish_reason": finished.finish_reason,
        },
    )
