"""The router's Prometheus metrics, in a registry of its own (several apps in one process, as
in tests, must not collide in prometheus_client's global one).

`dcpjax_router_requests_total{outcome}` counts every completion request by how it ended, so a
dashboard tells "clients sent what a P/D pair cannot do" from "a backend is down";
`dcpjax_router_prefill_seconds` is the first hop's latency (the prompt's prefill plus the
router's round trip), the time a P/D request adds before its decode server starts.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

OUTCOMES = (
    "ok",  # the decode server answered 2xx (a stream: relayed to its end)
    "client_error",  # refused by the router itself: bad JSON, what a P/D pair cannot do, a body too large
    "prefill_unavailable",  # a prefill server gave no HTTP answer (refused, timed out, broke the connection)
    "prefill_error",  # a prefill server answered 4xx/5xx (relayed as is)
    "prefill_no_kv_transfer_params",  # a prefill server answered without a handle (not a kv_producer): 502
    "decode_unavailable",  # a decode server gave no HTTP answer
    "decode_error",  # a decode server answered 4xx/5xx (relayed as is)
    "decode_stream_broken",  # a decode server's stream broke after it began (the client's stream ended there)
    "client_disconnected",  # the client went away during the decode server's stream
)
PREFILL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class RouterMetrics:
    """The router's counters and histogram, and their text exposition for /metrics."""

    def __init__(self):
        self.registry = CollectorRegistry()
        self._requests = Counter("dcpjax_router_requests", "Completion requests through the router, by outcome.",
                                 ["outcome"], registry=self.registry)
        for outcome in OUTCOMES:  # every series from the start: a rate() of a series born late misses its first
            self._requests.labels(outcome=outcome)
        self.prefill_seconds = Histogram("dcpjax_router_prefill_seconds", "Seconds from sending a request to a "
                                         "prefill server to its answer.", buckets=PREFILL_BUCKETS,
                                         registry=self.registry)

    def count(self, outcome: str) -> None:
        """One more request that ended as `outcome` (one of OUTCOMES)."""
        self._requests.labels(outcome=outcome).inc()

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric."""
        return generate_latest(self.registry)
