"""Prometheus metrics under vLLM's names, so existing dashboards and routers work against kiln.

Gauges and engine counters are read from the engine's stats at scrape time (a collector, no background thread);
the server observes per-request latencies (TTFT, time per output token, inter-token latency, end to end) and
finish reasons. Each app owns its own CollectorRegistry: no process globals.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

# vLLM's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)  # fmt: skip
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class _EngineCollector(Collector):
    """Engine gauges and counters, read from `stats()` (an EngineStats) at every scrape."""

    def __init__(self, stats: Callable[[], Any], model_name: str) -> None:
        self._stats, self._model = stats, model_name

    def collect(self) -> Iterator[Any]:
        s = self._stats()
        get = lambda name: float(getattr(s, name, 0) or 0)
        for name, doc, value in [
            ("vllm:num_requests_running", "Number of requests in model execution batches.", get("num_running")),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", get("num_waiting")),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", get("kv_usage")),
            ("vllm:gpu_cache_usage_perc", "KV-cache usage (older name of kv_cache_usage_perc).", get("kv_usage")),
        ]:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric([self._model], value)
            yield g
        for name, doc, value in [
            ("vllm:prefix_cache_queries", "Prefix cache queries, in tokens.", get("prefix_cache_queries")),
            ("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.", get("prefix_cache_hits")),
            ("vllm:num_preemptions", "Cumulative number of preemptions.", get("num_preemptions")),
            ("vllm:prompt_tokens", "Number of prefill tokens processed.", get("prompt_tokens_total")),
            ("vllm:generation_tokens", "Number of generation tokens processed.", get("generation_tokens_total")),
        ]:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric([self._model], value)
            yield c


class Metrics:
    """The server's metrics. `request()` gives a RequestTimer per engine request; `render()` is the /metrics body."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str, stats: Callable[[], Any]) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.registry.register(_EngineCollector(stats, model_name))
        lab, reg = ["model_name"], self.registry
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token in seconds.", lab,
                              registry=reg, buckets=TTFT_BUCKETS).labels(model_name)  # fmt: skip
        self.tpot = Histogram("vllm:time_per_output_token_seconds", "Mean time per output token of a request.", lab,
                              registry=reg, buckets=TPOT_BUCKETS).labels(model_name)  # fmt: skip
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Inter-token latency in seconds.", lab,
                             registry=reg, buckets=TPOT_BUCKETS).labels(model_name)  # fmt: skip
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency in seconds.", lab,
                             registry=reg, buckets=E2E_BUCKETS).labels(model_name)  # fmt: skip
        self.prompt_len = Histogram("vllm:request_prompt_tokens", "Number of prefill tokens per request.", lab,
                                    registry=reg, buckets=TOKEN_BUCKETS).labels(model_name)  # fmt: skip
        self.gen_len = Histogram("vllm:request_generation_tokens", "Number of generation tokens per request.", lab,
                                 registry=reg, buckets=TOKEN_BUCKETS).labels(model_name)  # fmt: skip
        self.success = Counter("vllm:request_success", "Count of finished requests by finish reason.",
                               ["model_name", "finished_reason"], registry=reg)  # fmt: skip

    def request(self) -> RequestTimer:
        return RequestTimer(self)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Times one engine request: call `tokens(n)` whenever n new tokens arrive and `finish(...)` once at the end."""

    def __init__(self, metrics: Metrics) -> None:
        self.m = metrics
        self.start = self.last = time.perf_counter()
        self.first: float | None = None
        self.num_tokens = 0

    def tokens(self, n: int) -> None:
        if n <= 0:
            return
        now = time.perf_counter()
        if self.first is None:
            self.first = now
            self.m.ttft.observe(now - self.start)
        else:
            self.m.itl.observe(now - self.last)
        self.last, self.num_tokens = now, self.num_tokens + n

    def finish(self, finish_reason: str | None, prompt_tokens: int) -> None:
        self.m.e2e.observe(time.perf_counter() - self.start)
        if self.first is not None and self.num_tokens > 1:
            self.m.tpot.observe((self.last - self.first) / (self.num_tokens - 1))
        self.m.prompt_len.observe(prompt_tokens)
        self.m.gen_len.observe(self.num_tokens)
        self.m.success.labels(self.m.model_name, finish_reason or "abort").inc()

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.start
