"""One server's KV connector (prefill/decode disaggregation, vLLM v1's KVConnectorBase_V1): its two
halves and the transport they share.

    scheduler side  `KVConnectorScheduler` (the scheduler's): remote KV, buffer bound, saves and loads
    worker side     `KVConnectorWorker` (the model runner's): gathers, pulls, scatters, reports
    transport       `transport.TRANSPORTS[kv_connector]`: a sender on a producer, a receiver on a consumer

A request says what it wants in `kv_transfer_params` (parsed once, `params.KVTransferParams`):
`{"do_remote_decode": true}` on a producer (prefill server), with max_tokens 1: the prompt runs, its
first token is sampled as usual, and when it finishes its KV is saved and the response carries the
handle. The handle on a consumer (decode server): the producer's first token becomes the sequence's
first output, the scheduler allocates the prompt's blocks, the runner pulls the KV into them, and the
first step decodes the first token. A first token that already ends the request pulls nothing and
releases the KV.

The first token travels (SGLang's choice, not vLLM's recompute of the prompt's last token): a hybrid
model's linear state then moves as the producer left it after the prompt, and a seeded request samples
every token as one engine would (the producer's seed travels too).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

from dcpjax.kv_transfer import transport
from dcpjax.kv_transfer.config import FAULT_KEYS, KVTransferConfig
from dcpjax.kv_transfer.device_io import KVMover
from dcpjax.kv_transfer.params import KVTransferParams
from dcpjax.kv_transfer.scheduler_side import KVConnectorScheduler, transfer_params
from dcpjax.kv_transfer.stats import TransferStats
from dcpjax.kv_transfer.worker_side import KVConnectorWorker
from dcpjax.runner.messages import SampledLogprobs
from dcpjax.sequence import Sequence

logger = logging.getLogger(__name__)

__all__ = ["KVConnector", "transfer_params"]


class KVConnector:
    """The two halves of one server's connector (see the module docstring); the runner owns the worker
    side (`runner.kv_connector`), the scheduler the scheduler side."""

    def __init__(self, config: KVTransferConfig, runner, max_model_len: int):
        config = config.on_platform(runner.mesh.devices.flat[0].platform)
        self.config, self.max_model_len = config, max_model_len
        self.stats = TransferStats()
        self.mover = KVMover(runner)
        sender_class, receiver_class = transport.TRANSPORTS[config.kv_connector]
        self.worker = KVConnectorWorker(self.mover, self.stats)
        sender = receiver = None
        device_transport = bool(sender_class.device_arrays)
        if config.is_producer:
            extra = config.kv_connector_extra_config
            fault = {k: int(extra[k]) for k in FAULT_KEYS if k in extra} or None
            options = {"transfer_port": int(extra.get("transfer_port", 0))} if device_transport else {}
            sender = sender_class(config.kv_ip, config.kv_port, max_bytes=int(config.kv_buffer_size),
                                  timeout_s=float(config.extra("abort_request_timeout", 120.0)),
                                  on_sent=self.worker.sent, on_released=self.worker.released,
                                  on_expired=self.worker.expired, fault=fault, **options)
            logger.info("KV transfer: producer (%s), pulls served at %s (held %.0f s at most, %.2g bytes)",
                        config.kv_connector, sender.address, float(config.extra("abort_request_timeout", 120.0)),
                        config.kv_buffer_size)
        if config.is_consumer:
            options = {"host": config.kv_ip} if device_transport else {}  # its transfer server's address
            receiver = receiver_class(timeout_s=float(config.extra("transfer_timeout", 30.0)),
                                      retries=int(config.extra("retries", 1)), **options)
            logger.info("KV transfer: consumer (%s)", config.kv_connector)
        self.worker.sender, self.worker.receiver = sender, receiver
        if receiver is not None:
            self.worker.start_pulls()
        runner.kv_connector = self.worker
        self.scheduler = KVConnectorScheduler(config, self.mover.layout, runner.cfg.vocab_size,
                                              address=self._advertised(sender),
                                              pads_wire=device_transport, release=self.worker.release)

    def _advertised(self, sender) -> dict | None:
        """The sender's address as decode servers reach it (a wildcard kv_ip: this host's name)."""
        return None if sender is None else {**sender.address, "host": self.config.advertised_host}

    @property
    def sender(self):
        return self.worker.sender

    def compile_jobs(self) -> list[tuple[Callable[[int], None], int]]:
        """What `runner.precompile` compiles for this role: every gather (producer) and scatter
        (consumer) bucket a prompt within max_model_len can take."""
        mover, most = self.mover, self.max_model_len
        jobs = [(mover.compile_gather, n) for n in mover.gather_buckets(most)] if self.config.is_producer else []
        return jobs + ([(mover.compile_scatter, n) for n in mover.scatter_buckets(most)]
                       if self.config.is_consumer else [])

    def close(self) -> None:
        self.worker.close()

    # -- a request ---------------------------------------------------------------------------------
    def request_problem(self, params: KVTransferParams, prompt_ids, max_tokens: int | None,
                        num_draws: int) -> str | None:
        """What this server cannot do of a request's kv_transfer_params (None: fine)."""
        return self.scheduler.request_problem(params, len(prompt_ids), max_tokens, num_draws, prompt_ids)

    def on_request(self, seq: Sequence, processor) -> None:
        """A new sequence (before it is queued): a decode request gets the producer's first token (and
        its seed) as its first output; one that token finished releases the KV, which nobody will pull."""
        params = transfer_params(seq)
        if params is None or not params.do_remote_prefill:
            return
        first = params.first_token
        if params.seed is not None:
            seq.seed = params.seed % 2**32  # as the request builder keeps it
        processor.append(seq, first.id, _sampled_logprobs(first, seq.params.logprobs))
        if seq.finished:
            self.worker.release(params)

    def release(self, params: KVTransferParams) -> None:
        """A handle this server will not load (it refused the request): the producer frees it now."""
        if params.do_remote_prefill and self.config.is_consumer:
            self.worker.release(params)

    @property
    def held_transfers(self) -> int:
        """Prompts whose KV this producer holds for a pull (0 on a consumer)."""
        return len(self.sender.keys()) if self.sender is not None else 0


def _sampled_logprobs(first, top: int | None) -> SampledLogprobs | None:
    """The first token's logprobs as a step would have returned them (top: the request's count)."""
    entries = first.logprobs
    if not entries:
        return None
    _, logprob, rank = entries[0]
    ranked = sorted((e for e in entries if e[2] <= (top or 0)), key=lambda e: e[2])
    return SampledLogprobs(np.array([logprob], np.float32), np.array([rank], np.int32),
                           np.array([[e[0] for e in ranked]], np.int32).reshape(1, len(ranked)),
                           np.array([[e[1] for e in ranked]], np.float32).reshape(1, len(ranked)))
