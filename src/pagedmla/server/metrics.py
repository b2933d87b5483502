"""The server's Prometheus metrics (`/metrics`), in a registry of their own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pagedmla.engine.online import OnlineEngine

# Seconds: from a millisecond (an inter-token gap on a GPU) to minutes (a queued prompt).
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
                    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)


class ServerMetrics:
    """Gauges read from the engine when scraped; counters and latency histograms fed by
    the request handlers."""

    def __init__(self, engine: OnlineEngine) -> None:
        self.registry = registry = CollectorRegistry()
        Gauge("pagedmla_num_requests_running", "Sequences in the running batch",
              registry=registry).set_function(lambda: engine.num_requests[0])
        Gauge("pagedmla_num_requests_waiting", "Sequences waiting to be scheduled",
              registry=registry).set_function(lambda: engine.num_requests[1])
        Gauge("pagedmla_kv_cache_usage_perc", "Fraction of the KV cache's blocks in use",
              registry=registry).set_function(lambda: engine.kv_cache_usage)
        self._prompt = Counter("pagedmla_prompt_tokens", "Prompt tokens of finished HTTP "
                               "requests", registry=registry)
        self._generated = Counter("pagedmla_generation_tokens", "Generated tokens",
                                  registry=registry)
        self._finished = Counter("pagedmla_request_success", "Finished completions, by "
                                 "finish reason", ["finished_reason"], registry=registry)
        self._ttft = Histogram("pagedmla_time_to_first_token_seconds", "From a request's "
                               "arrival to its first token", buckets=_LATENCY_BUCKETS,
                               registry=registry)
        self._itl = Histogram("pagedmla_inter_token_latency_seconds", "Between a "
                              "completion's successive tokens", buckets=_LATENCY_BUCKETS,
                              registry=registry)
        self._e2e = Histogram("pagedmla_e2e_request_latency_seconds", "From a request's "
                              "arrival to a completion's end", buckets=_LATENCY_BUCKETS,
                              registry=registry)

    def tokens(self, count: int, waited: float, first: bool) -> None:
        """`count` new tokens of a completion, `waited` seconds after its previous ones
        (after the request's arrival when `first`); a gap spanning several tokens counts
        as that many equal gaps."""
        self._generated.inc(count)
        if first:
            self._ttft.observe(waited)
            return
        for _ in range(count):
            self._itl.observe(waited / count)

    def finished(self, reason: str, seconds: float) -> None:
        self._finished.labels(finished_reason=reason).inc()
        self._e2e.observe(seconds)

    def prompt_tokens(self, count: int) -> None:
        self._prompt.inc(count)
