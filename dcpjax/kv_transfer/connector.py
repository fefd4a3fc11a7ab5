"""The engine's side of prefill/decode disaggregation (vLLM's KV connector, one class per server).

A request says what it wants in `SamplingParams.extra_args["kv_transfer_params"]` (the
OpenAI body's `kv_transfer_params`, as vLLM takes it):

- `{"do_remote_decode": true}` on a producer (prefill server), with max_tokens 1: the prompt runs
  and samples its first token as usual; when the sequence finishes (`on_finish`, before its blocks
  go back to the pool) its KV is gathered on the devices, copied to the host in a worker thread,
  and held under a fresh key for a decode server to pull (`server.TransferServer`; freed after the
  pull's acknowledgement, or after `abort_request_timeout`). The blocks are freed at once and stay
  in the prefix cache. The request's output carries the handle: `RequestOutput.kv_transfer_params`.
- that handle on a consumer (decode server): `receive` appends the producer's first token (its
  logprobs too) as the sequence's first output, pulls the KV (one retry if a pull fails mid-way),
  checks it comes from the same model and prompt and puts it in position order in this cache's
  dtype (`resharding`); at admission the scheduler gives it blocks for the prompt and the first
  token, `place` scatters the KV there, and the first step decodes the first token. A first token
  that already ends the request (EOS, a stop, max_tokens 1) pulls nothing and releases the KV.

The first token travels (SGLang's choice, not vLLM's recompute of the prompt's last token): a
hybrid model's linear state then moves as the producer left it after the prompt, the consumer
computes nothing before its first decode step, and a seeded request samples every token as one
engine would (the producer's seed travels too).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import logging
import threading
import time
import uuid
from collections.abc import Callable

import numpy as np

from dcpjax.kv_transfer import client, resharding
from dcpjax.kv_transfer.config import KVTransferConfig
from dcpjax.kv_transfer.server import TransferServer
from dcpjax.kv_transfer.store import HeldTransfers
from dcpjax.kv_transfer.wire import TransferError
from dcpjax.runner.kv_io import KVMover
from dcpjax.runner.messages import SampledLogprobs
from dcpjax.sequence import Sequence
from dcpjax.sharding import layout

logger = logging.getLogger(__name__)
HANDLE_KEYS = ("remote_host", "remote_port", "remote_request_id", "num_tokens", "first_token")


def transfer_params(seq: Sequence) -> dict | None:
    """The request's kv_transfer_params (None: an ordinary request)."""
    return (seq.params.extra_args or {}).get("kv_transfer_params")


def wants_remote_decode(seq: Sequence) -> bool:
    return bool((transfer_params(seq) or {}).get("do_remote_decode"))


def wants_remote_prefill(seq: Sequence) -> bool:
    return bool((transfer_params(seq) or {}).get("do_remote_prefill"))


@dataclasses.dataclass
class ArrivedKV:
    """A prompt's KV on the consumer's host, in position order and this cache's dtype (`place` writes it)."""

    num_tokens: int
    arrays: dict[str, np.ndarray]
    nbytes: int  # as it travelled
    seconds: float
    attempts: int


class TransferStats:
    """What `/metrics` reads: transfers by outcome (sent, expired on a producer; received, released,
    failed on a consumer), their bytes and seconds. Counted from several threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.outcomes: dict[str, int] = {}
        self.bytes = 0
        self._seconds: list[float] = []

    def count(self, outcome: str, nbytes: int = 0, seconds: float | None = None) -> None:
        with self._lock:
            self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
            self.bytes += nbytes
            if seconds is not None:
                self._seconds.append(seconds)

    def take(self) -> tuple[dict[str, int], int, list[float]]:
        """One consistent reading: counts by outcome and bytes so far, and the transfer times counted
        since the last call (each observed once)."""
        with self._lock:
            taken, self._seconds = self._seconds, []
            return dict(self.outcomes), self.bytes, taken


class KVConnector:
    """One server's connector: a producer's store and transfer server, a consumer's pulls, or both."""

    def __init__(self, config: KVTransferConfig, runner, max_model_len: int):
        self.config, self.runner, self.max_model_len = config, runner, max_model_len
        self.mover = KVMover(runner)
        self.layout = resharding.describe(runner)
        self.state_bytes = self.mover.state_row_bytes
        self.stats = TransferStats()
        self.store = self.server = self.executor = None
        if config.is_producer:
            self.store = HeldTransfers(config.extra("abort_request_timeout", 120.0), int(config.kv_buffer_size))
            fault = {k: int(config.kv_connector_extra_config[k]) for k in ("fail_after_bytes", "fail_count")
                     if k in config.kv_connector_extra_config} or None
            self.server = TransferServer(self.store, config.kv_ip, config.kv_port, fault=fault,
                                         on_sent=self._sent, on_expired=self._expired, on_released=self._released)
            self.server.start()
            self.executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dcpjax-kv-export")
            logger.info("KV transfer: producer, pulls served on %s:%d (held %.0f s at most, %.2g bytes)",
                        config.kv_ip, self.server.port, self.store.timeout_s, config.kv_buffer_size)
        if config.is_consumer:
            logger.info("KV transfer: consumer (pull timeout %.0f s, %d retry)", self.pull_timeout, self.retries)

    pull_timeout = property(lambda self: float(self.config.extra("transfer_timeout", 30.0)))
    retries = property(lambda self: int(self.config.extra("retries", 1)))

    def compile_jobs(self) -> list[tuple[Callable[[int], None], int]]:
        """What `runner.precompile` compiles for this role: every gather (producer) and scatter
        (consumer) bucket a prompt within max_model_len can take."""
        mover, most = self.mover, self.max_model_len
        jobs = [(mover.compile_gather, n) for n in mover.gather_buckets(most)] if self.config.is_producer else []
        return jobs + ([(mover.compile_scatter, n) for n in mover.scatter_buckets(most)]
                       if self.config.is_consumer else [])

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.executor.shutdown(wait=False, cancel_futures=True)

    # -- checks, before a request is accepted ------------------------------------------------------
    @property
    def buffer_full(self) -> bool:
        """A prefill server holding kv_buffer_size bytes for pulls already (a new handoff: retry later)."""
        return self.store is not None and not self.store.can_hold(0)

    def request_problem(self, params: dict | None, max_tokens: int | None, num_draws: int) -> str | None:
        """What this server cannot do of a request's kv_transfer_params (None: fine)."""
        if params is None:
            return None
        if not isinstance(params, dict):
            return "kv_transfer_params must be an object"
        if params.get("do_remote_decode"):
            if not self.config.is_producer:
                return (f"kv_transfer_params.do_remote_decode needs a prefill server (kv_role kv_producer); this one "
                        f"is {self.config.kv_role}")
            if max_tokens != 1 or num_draws != 1:
                return "kv_transfer_params.do_remote_decode needs max_tokens 1 and n 1 (the decode server goes on)"
        if params.get("do_remote_prefill"):
            if not self.config.is_consumer:
                return (f"kv_transfer_params.do_remote_prefill needs a decode server (kv_role kv_consumer); this one "
                        f"is {self.config.kv_role}")
            if missing := [k for k in HANDLE_KEYS if k not in params]:
                return (f"kv_transfer_params lacks {missing}: send what the prefill server returned in its "
                        "response's kv_transfer_params")
            if num_draws != 1:
                return "kv_transfer_params.do_remote_prefill needs n 1 (one sequence per transferred prompt)"
            return _handle_problem(params, self.runner.cfg.vocab_size)
        return None

    # -- producer ----------------------------------------------------------------------------------
    def on_finish(self, seq: Sequence) -> None:
        """A finished sequence (engine thread, its blocks still held): hold its prompt's KV for a pull."""
        if self.store is None or seq.finish_reason == "abort" or not wants_remote_decode(seq):
            return
        num_tokens = seq.num_prompt_tokens
        needed = layout.blocks_needed(num_tokens, self.runner.kv_layout.block_size, self.runner.pc.dcp)
        blocks = seq.blocks[:needed]
        if seq.slot is None or len(blocks) < needed:
            # preempted with its token in flight (the scheduler spares such sequences; kept as a guard)
            logger.warning("KV transfer %s: its KV was freed before it finished; no handle", seq.request_id)
            return
        gathered = self.mover.gather(blocks, seq.slot)  # enqueued before the blocks can be written again
        key = f"{seq.request_id}-{uuid.uuid4().hex[:12]}"
        nbytes = resharding.kv_bytes(self.layout, num_tokens, self.state_bytes)
        header = {"layout": self.layout, "num_tokens": num_tokens, "prompt_sha256": prompt_digest(seq.prompt_ids)}
        self.store.put(key, self.executor.submit(lambda: (header, self.mover.wire_arrays(gathered, num_tokens))),
                       nbytes)
        seq.kv_transfer_params = {
            "do_remote_prefill": True, "do_remote_decode": False, "remote_host": self.config.advertised_host,
            "remote_port": self.server.port, "remote_request_id": key, "num_tokens": num_tokens,
            "transfer_bytes": nbytes, "seed": seq.seed, "first_token": _first_token(seq)}

    def _sent(self, key: str, nbytes: int, seconds: float) -> None:
        """A pull acknowledged: counted by its KV and state bytes (as held; the message adds a header)."""
        self.stats.count("sent", nbytes, seconds)

    def _released(self, key: str) -> None:
        """Freed unpulled at a decode server's word (the first token ended its request)."""
        self.stats.count("released")

    def _expired(self, keys: list[str]) -> None:
        for key in keys:
            self.stats.count("expired")
            logger.warning("KV transfer %s: no decode server pulled it within %.0f s; freed", key,
                           self.store.timeout_s)

    # -- consumer ----------------------------------------------------------------------------------
    def receive(self, seq: Sequence, processor) -> None:
        """Before the sequence is queued (blocking I/O: a server calls it off its event loop): its
        first token from the producer, then its prompt's KV (`seq.transferred_kv`), unless that
        token finished it. TransferError (503) when the pull fails; ValueError when the KV is not
        this model's or this prompt's."""
        params = transfer_params(seq)
        first = params["first_token"]
        seq.seed = params.get("seed", seq.seed) % 2**32  # as the request builder keeps it
        processor.append(seq, int(first["id"]), _sampled_logprobs(first, seq.params.logprobs))
        host, port, key = params["remote_host"], int(params["remote_port"]), params["remote_request_id"]
        if seq.finished:
            client.release(host, port, key)
            self.stats.count("released")
            return
        try:
            result = client.pull(host, port, key, timeout_s=self.pull_timeout, retries=self.retries)
        except TransferError:
            self.stats.count("failed")
            raise
        header = result.header
        if problems := resharding.compatibility_problems(header["layout"], self.layout):
            raise ValueError(f"the prefill server at {host}:{port} runs another model: {'; '.join(problems)}")
        if header.get("prompt_sha256") != prompt_digest(seq.prompt_ids):
            raise ValueError(f"the KV pulled from {host}:{port} is of another prompt ({header['num_tokens']} tokens, "
                             f"this request has {len(seq.prompt_ids)}): send the prefill server the same prompt")
        started = time.perf_counter()
        arrays = resharding.position_order(result.arrays, header["layout"], header["num_tokens"],
                                           self.runner.kv_layout.dtype)
        payload = sum(a.nbytes for a in result.arrays.values())  # the KV and state, not the message's header
        seq.transferred_kv = ArrivedKV(header["num_tokens"], arrays, payload,
                                       result.seconds + time.perf_counter() - started, result.attempts)
        self.stats.count("received", payload, seq.transferred_kv.seconds)

    def place(self, seq: Sequence) -> None:
        """At the sequence's admission (engine thread): its arrived KV into its blocks and slot."""
        arrived, seq.transferred_kv = seq.transferred_kv, None
        self.mover.scatter(arrived.arrays, arrived.num_tokens, seq.blocks, seq.slot)


def prompt_digest(ids) -> str:
    """What the payload's header carries of the prompt, for the consumer's check: a hash, not the ids
    (a million-token prompt's ids would be megabytes of JSON)."""
    return hashlib.sha256(np.asarray(ids, np.int64).tobytes()).hexdigest()


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _handle_problem(params: dict, vocab_size: int) -> str | None:
    """A handle's values of the wrong kind or range (None: usable): what a client edited or made up.
    Exact JSON types: what `receive` reads must not fail later."""
    first, fix = params["first_token"], "send the prefill server's kv_transfer_params unchanged"
    entries = first.get("logprobs") if isinstance(first, dict) else None
    well_formed = (
        isinstance(first, dict) and _is_int(first.get("id")) and _is_int(params["remote_port"])
        and _is_int(params["num_tokens"]) and _is_int(params.get("seed", 0))
        and isinstance(params["remote_host"], str) and isinstance(params["remote_request_id"], str)
        and (entries is None or isinstance(entries, list) and all(
            isinstance(e, list) and len(e) == 3 and _is_int(e[0]) and isinstance(e[1], int | float)
            and _is_int(e[2]) for e in entries)))
    if not well_formed:
        return f"kv_transfer_params is not a handle a prefill server returned: {fix}"
    port, token = params["remote_port"], first["id"]
    if not 0 < port < 65536 or not 0 <= token < vocab_size:
        return (f"kv_transfer_params: remote_port {port} or first_token.id {token} is out of range (a port; a token "
                f"of this model's {vocab_size}): {fix}")
    return None


def _first_token(seq: Sequence) -> dict:
    """The producer's sampled token with its logprob entries ([id, logprob, rank], the sampled one
    first), as the consumer appends it."""
    token = seq.output_ids[0]
    entries = None
    if seq.logprobs:
        entries = [[tid, lp.logprob, lp.rank] for tid, lp in seq.logprobs[0].items()]
    return {"id": token, "logprobs": entries, "cumulative_logprob": seq.cumulative_logprob}


def _sampled_logprobs(first: dict, top: int | None) -> SampledLogprobs | None:
    """The first token's logprobs as a step would have returned them (top: the request's count)."""
    entries = first.get("logprobs")
    if not entries:
        return None
    _, logprob, rank = entries[0]
    ranked = sorted((e for e in entries if e[2] <= (top or 0)), key=lambda e: e[2])
    return SampledLogprobs(np.array([logprob], np.float32), np.array([rank], np.int32),
                           np.array([[e[0] for e in ranked]], np.int32).reshape(1, len(ranked)),
                           np.array([[e[1] for e in ranked]], np.float32).reshape(1, len(ranked)))
