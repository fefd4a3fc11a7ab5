"""Prometheus metrics, vLLM's names under the `dcpjax:` prefix."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from dcpjax.runner.compile_watch import compile_watch


class Metrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}

        def gauge(name, doc):
            return Gauge(f"dcpjax:{name}", doc, list(labels), registry=self.registry).labels(**labels)

        def counter(name, doc):
            return Counter(f"dcpjax:{name}", doc, list(labels), registry=self.registry).labels(**labels)

        def histogram(name, doc, buckets):
            return Histogram(f"dcpjax:{name}", doc, list(labels), buckets=buckets,
                             registry=self.registry).labels(**labels)

        latency = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).")
        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.time_to_first_token = histogram("time_to_first_token_seconds", "Arrival to first token.", latency)
        self.time_per_output_token = histogram("time_per_output_token_seconds", "Mean time per output token "
                                               "after the first, per request.", latency)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens received.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.preemptions = counter("num_preemptions", "Sequences preempted (recomputed later).")
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.cached_blocks = gauge("prefix_cache_blocks", "KV blocks (block_size x DCP tokens each) holding a "
                                   "cached prefix, in use or evictable.")
        self._counted = (0, 0)  # prefix cache queries and hits already added to the counters
        # speculative decoding (vLLM's names; exposed with _total)
        self.spec_drafts = counter("spec_decode_num_drafts", "Verify rows that carried drafts.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.spec_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self._spec_per_position = Counter("dcpjax:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted "
                                          "at each position of the drafts (0 = first).", [*labels, "position"],
                                          registry=self.registry)
        self._labels = labels
        self.compilations = counter("compilations", "XLA compilations in this process (persistent-cache loads "
                                    "not counted).")
        self.compilations_after_ready = counter("step_compilations_after_ready", "Steps XLA compiled after the "
                                                "server was ready: requests waited for each (until every step "
                                                "shape is precompiled, each shape's first use).")
        self._compiles_counted = (0, 0)
        self._spec_counted: dict[str, int] = {}
        # prefill/decode disaggregation (a server with --kv-transfer-config)
        self._transfers = Counter("dcpjax:kv_transfers", "Prompt KV transfers by outcome: sent, expired (never "
                                  "pulled) on a prefill server; received, released (first token ended it), failed on "
                                  "a decode server.", [*labels, "outcome"], registry=self.registry)
        self.transfer_bytes = counter("kv_transfer_bytes", "Bytes of prompt KV (and linear state) sent or received.")
        self.transfer_seconds = histogram("kv_transfer_seconds", "One transfer: the pull and the re-sharding on a "
                                          "decode server, the send until acknowledged on a prefill server.", latency)
        self.transfers_held = gauge("kv_transfer_held_requests", "Prompts whose KV a prefill server holds for a "
                                    "pull.")
        self._transfers_counted: dict[str, int] = {}
        self._transfer_bytes_counted = 0

    def exposition(self) -> str:
        """The metrics in Prometheus' text format (what /metrics returns)."""
        return generate_latest(self.registry).decode()

    def update(self, engine) -> None:
        """Read the engine's counters (`Engine.stats()`) into the metrics."""
        stats = engine.stats()
        self.kv_cache_usage.set(stats.kv_usage)
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        prefix = stats.prefix_cache
        self.prefix_cache_queries.inc(prefix.queries - self._counted[0])
        self.prefix_cache_hits.inc(prefix.hits - self._counted[1])
        self._counted = (prefix.queries, prefix.hits)
        self.cached_blocks.set(stats.num_cached_blocks)
        compiled, after_ready = compile_watch().compiled, stats.steps_compiled_after_ready
        self.compilations.inc(compiled - self._compiles_counted[0])  # never decreases (CompileWatch.compiled)
        self.compilations_after_ready.inc(after_ready - self._compiles_counted[1])
        self._compiles_counted = (compiled, after_ready)
        if getattr(engine, "kv_connector", None) is not None:
            self._update_transfers(engine.kv_connector)
        spec = stats.spec_decode
        if spec is not None:
            counts = {"drafts": spec.num_drafts, "draft_tokens": spec.num_draft_tokens,
                      "accepted_tokens": spec.num_accepted_tokens}
            counts |= {f"position {j}": n for j, n in enumerate(spec.accepted_per_position)}
            for name, value in counts.items():
                delta = value - self._spec_counted.get(name, 0)
                if name.startswith("position"):
                    self._spec_per_position.labels(**self._labels, position=name.split()[1]).inc(delta)
                else:
                    getattr(self, f"spec_{name}").inc(delta)
                self._spec_counted[name] = value

    def _update_transfers(self, connector) -> None:
        """The connector's transfer counts (`kv_transfer.connector.TransferStats`) into the metrics."""
        outcomes, nbytes, seconds = connector.stats.take()
        for outcome, value in outcomes.items():
            self._transfers.labels(**self._labels, outcome=outcome).inc(value - self._transfers_counted.get(outcome, 0))
            self._transfers_counted[outcome] = value
        self.transfer_bytes.inc(nbytes - self._transfer_bytes_counted)
        self._transfer_bytes_counted = nbytes
        for s in seconds:
            self.transfer_seconds.observe(s)
        if connector.config.is_producer:
            self.transfers_held.set(connector.held_transfers)
