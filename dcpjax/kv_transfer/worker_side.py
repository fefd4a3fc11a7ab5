"""The connector's worker-side half (vLLM v1's `KVConnectorBase_V1` worker role), owned by the model
runner: it saves finished prompts' KV for a decode server, loads a handle's KV into blocks the
scheduler allocated, and reports what finished (`step`, on the engine thread, at the start of each
engine step and after one that finished sequences).

Saves: the blocks are gathered on the devices (`KVMover.gather`, enqueued before anything can write
them again) and offered to the transport under the save's key; the scheduler may free the blocks at
once. Loads: the pull runs on a worker thread (network I/O never blocks a step), which also re-shards
it on the host into this cache's local orders (`resharding.for_receiver`) and places it on the
devices, each receiving only its part (`KVMover.place`); the next `step` scatters it into the blocks
(`KVMover.scatter`, in order with the model's calls).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time

from dcpjax.kv_transfer.device_io import KVMover
from dcpjax.kv_transfer.layout import KVLayout, is_state, rank_of
from dcpjax.kv_transfer.metadata import KVConnectorMetadata, KVConnectorOutput, LoadSpec
from dcpjax.kv_transfer.params import KVTransferParams
from dcpjax.kv_transfer.resharding import for_receiver
from dcpjax.kv_transfer.stats import TransferStats

logger = logging.getLogger(__name__)


class KVConnectorWorker:
    """See the module docstring. sender / receiver: the transport's halves (None where the role has none)."""

    def __init__(self, mover: KVMover, stats: TransferStats):
        self.mover, self.layout, self.stats = mover, mover.layout, stats
        self.sender = self.receiver = None  # the transport's halves, by role (`KVConnector` sets them)
        self._lock = threading.Lock()
        self._ended_keys: list[str] = []  # keys the sender stopped holding since the last step
        self.changed = threading.Event()  # set when a pull or a held transfer ends (the engine may be idle)
        self._pulls: dict[str, tuple[LoadSpec, concurrent.futures.Future]] = {}
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._copies: concurrent.futures.ThreadPoolExecutor | None = None

    def start_pulls(self, threads: int = 4) -> None:
        """A consumer's pull threads (loads run `threads` at a time; the rest wait their turn)."""
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="dcpjax-kv-pull")

    # -- the sender's callbacks (its threads) ------------------------------------------------------
    def sent(self, key: str, nbytes: int, seconds: float) -> None:
        self.stats.count("sent", nbytes, seconds)
        self._ended(key)

    def released(self, key: str) -> None:
        self.stats.count("released")
        self._ended(key)

    def expired(self, keys: list[str]) -> None:
        for key in keys:
            self.stats.count("expired")
            logger.warning("KV transfer %s: no decode server pulled it in time; freed", key)
            self._ended(key)

    def _ended(self, key: str) -> None:
        with self._lock:
            self._ended_keys.append(key)
        self.changed.set()

    # -- one engine step ---------------------------------------------------------------------------
    def step(self, meta: KVConnectorMetadata) -> KVConnectorOutput:
        """Start this step's saves and loads; report what finished since the last step."""
        for save in meta.saves:
            self._save(save)
        for load in meta.loads:
            self._pulls[load.request_id] = (load, self._pool.submit(self._pull, load.params))
        loaded, failed = [], []
        for request_id, (load, pull) in list(self._pulls.items()):
            if not pull.done():
                continue
            del self._pulls[request_id]
            try:
                self._place(load, *pull.result())
                loaded.append(request_id)
            except Exception as err:  # noqa: BLE001 (the transfer failed (after its retries), or its data was not usable
                self.stats.count("failed")
                logger.warning("KV transfer for %s failed (%s): its prompt is computed here instead", request_id, err)
                self._release_quietly(load.params)  # a pull cut twice leaves the key held on the producer
                failed.append(request_id)
        with self._lock:
            ended, self._ended_keys = tuple(self._ended_keys), []
        self.changed.clear()
        return KVConnectorOutput(saved=tuple(s.request_id for s in meta.saves), finished_sending=ended,
                                 finished_recving=tuple(loaded), failed_recving=tuple(failed))

    def wait(self, timeout_s: float) -> None:
        """Block until a pull or a held transfer ends, or timeout_s (an engine with nothing to run)."""
        self.changed.wait(timeout_s)

    def reset(self) -> None:
        """Forget the loads under way (the engine failed a step and frees every block): what they pull
        is never written."""
        self._pulls.clear()

    # -- save --------------------------------------------------------------------------------------
    def _save(self, save) -> None:
        """Gather a finished prompt's blocks (enqueued now, before they can be written again) and offer
        them under its key. The scheduler kept the buffer's bound, so the sender's own check agrees; if it
        does not, the key is reported ended (its handle's pull will be refused: the decode server then
        computes the prompt itself), and the engine goes on."""
        try:
            arrays = self.mover.gather(save.block_ids, save.slot)
            if not self.sender.reserve(save.key, save.nbytes):
                raise RuntimeError(f"the sender holds {self.sender.held_bytes:,} bytes, no room for {save.nbytes:,}")
            self.sender.offer(save.key, self._wire_arrays(arrays, save.num_tokens))
        except Exception as err:  # noqa: BLE001 (a transport's error must not fail the engine's step)
            logger.error("KV transfer %s not offered: %s", save.key, err)
            self.sender.withdraw(save.key)
            self.stats.count("failed")
            self._ended(save.key)

    def _wire_arrays(self, arrays: dict, num_tokens: int):
        """What the sender holds: the device arrays as gathered (a device transport, padded), or a
        Future of host copies trimmed to each rank's tokens (a host transport)."""
        if self.sender.device_arrays:
            return arrays
        lengths = self.layout.rank_lengths(num_tokens)
        for leaf in arrays.values():
            leaf.copy_to_host_async()

        def host_copies():
            out = {}
            for name, a in arrays.items():
                host = a.__array__()
                if not is_state(name):  # a pool of one rank: [1, layers, heads, tokens, ...]
                    host = host[0, :, :, : lengths[rank_of(name)]]
                out[name] = host
            return out

        if self._copies is None:
            self._copies = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dcpjax-kv-export")
        return self._copies.submit(host_copies)

    # -- load --------------------------------------------------------------------------------------
    def _pull(self, params: KVTransferParams):
        """On a pull thread: the handle's arrays, as the transport brings them."""
        sender = KVLayout.from_dict(params.kv_layout)
        padded = params.wire_tokens is not None
        if padded and params.wire_tokens != sender.padded_tokens(params.num_tokens):
            raise ValueError(f"the handle's wire_tokens {params.wire_tokens} is not its layout's "
                             f"{sender.padded_tokens(params.num_tokens)}")
        specs = sender.wire_specs(params.num_tokens, padded)
        started = time.perf_counter()
        try:
            result = self.receiver.pull(params.remote_address, params.remote_request_id, specs)
            arrays = result.arrays
            if padded:
                arrays = {k: (a if is_state(k) else a[0]) for k, a in arrays.items()}
            # off the engine thread: this cache's local orders on the host, then onto the devices
            updates, states, lengths = for_receiver(arrays, sender, self.layout, params.num_tokens,
                                                    params.wire_tokens)
            return self.mover.place(updates, states), lengths, result.nbytes, started
        finally:
            self.changed.set()

    def _place(self, load: LoadSpec, placed: tuple, lengths: list[int], nbytes: int, started: float) -> None:
        """On the engine thread: the arrived KV into the load's blocks and slot."""
        self.mover.scatter(placed, lengths, load.block_ids, load.slot)
        self.stats.count("received", nbytes, time.perf_counter() - started)

    def _release_quietly(self, params: KVTransferParams) -> None:
        threading.Thread(target=self.receiver.release, args=(params.remote_address, params.remote_request_id),
                         name="dcpjax-kv-release", daemon=True).start()

    def release(self, params: KVTransferParams) -> None:
        """Tell the producer to free a handle's KV now (a request it ended, or this server refused):
        best effort, in the background (the producer's timeout frees it otherwise)."""
        if self.receiver is None:
            return
        self.stats.count("released")
        self._release_quietly(params)

    def close(self) -> None:
        for pool in (self._pool, self._copies):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        for end in (self.sender, self.receiver):
            if end is not None:
                end.close()
