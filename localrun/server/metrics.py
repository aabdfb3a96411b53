"""Prometheus metrics (``GET /metrics``), one registry per app so tests can run several."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("localrun_requests", "HTTP requests answered",
                                ["endpoint", "model", "status"], registry=r)
        self.prompt_tokens = Counter("localrun_prompt_tokens", "Prompt tokens processed",
                                     ["model"], registry=r)
        self.completion_tokens = Counter("localrun_completion_tokens", "Tokens generated",
                                         ["model"], registry=r)
        self.queue_depth = Gauge("localrun_queue_depth", "Requests waiting for the model",
                                 ["model"], registry=r)
        self.running = Gauge("localrun_requests_running", "Requests generating now",
                             ["model"], registry=r)
        self.rejected = Counter("localrun_requests_rejected",
                                "Requests refused before running (queue full)",
                                ["model", "reason"], registry=r)
        self.ttft = Histogram("localrun_time_to_first_token_seconds",
                              "From the request's arrival to its first token (queue included)",
                              ["model"], buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("localrun_time_per_output_token_seconds",
                              "Decode time per generated token after the first", ["model"],
                              buckets=TPOT_BUCKETS, registry=r)
        self.duration = Histogram("localrun_request_duration_seconds",
                                  "From arrival to the last byte", ["endpoint"],
                                  buckets=DURATION_BUCKETS, registry=r)
        self.models_loaded = Gauge("localrun_models_loaded", "Models in memory", registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
