"""`--kv-transfer-config`: vLLM's `KVTransferConfig` fields, checked, for dcpjax's connector.

    {"kv_connector": "SocketConnector", "kv_role": "kv_producer", "kv_ip": "127.0.0.1", "kv_port": 14579,
     "kv_buffer_size": 4e9, "kv_connector_extra_config": {"abort_request_timeout": 120}}

kv_connector names the transport (`transport.TRANSPORTS`): JaxTransferConnector
(`jax.experimental.transfer`, device to device) or SocketConnector (TCP through host memory); left
out, the platform's default (`default_connector`). Both servers of a pair must use the same one.

kv_producer: a prefill server; a request with `kv_transfer_params: {"do_remote_decode": true}`
runs its prompt, and its KV (and a hybrid model's linear state) is held for a decode server to
pull (on its devices with JaxTransferConnector, on its host with SocketConnector). kv_consumer: a
decode server; a request with the producer's
`kv_transfer_params` pulls that KV, re-shards it into its own cache and decodes. kv_both: either.
"""

from __future__ import annotations

import dataclasses
import json
import socket

from dcpjax.kv_transfer import transport

ROLES = ("kv_producer", "kv_consumer", "kv_both")
CONNECTORS = transport.NAMES
# vLLM's connectors, named in the error when a vLLM command line is reused as is
VLLM_CONNECTORS = ("NixlConnector", "P2pNcclConnector", "MooncakeConnector", "LMCacheConnectorV1",
                   "SharedStorageConnector", "MultiConnector", "OffloadingConnector")
EXTRA_KEYS = {
    "abort_request_timeout": "seconds a producer holds a prompt's KV for a decode server to pull (then frees it)",
    "transfer_timeout": "seconds a consumer waits for progress of one pull (then the attempt fails)",
    "retries": "pulls a consumer tries again after one fails mid-way (then it computes the prompt itself)",
    "transfer_port": "JaxTransferConnector: the port of the producer's jax transfer server (0: any free one)",
    "fail_after_bytes": "test hook: a producer's first fail_count pulls stop after this many bytes",
    "fail_count": "test hook: how many pulls fail_after_bytes cuts",
    "stall_after_bytes": "test hook: every pull of a producer sends this many bytes, then hangs",
}
FAULT_KEYS = ("fail_after_bytes", "fail_count", "stall_after_bytes")


@dataclasses.dataclass(frozen=True)
class KVTransferConfig:
    """One server's part in prefill/decode disaggregation (vLLM's field names).

    kv_ip / kv_port: where a producer's transfer server listens (port 0: one the system picks),
    advertised in each response's kv_transfer_params: across hosts, an address the decode servers
    reach (a wildcard 0.0.0.0 or :: advertises this host's name). kv_buffer_size: the most bytes of
    KV a producer holds for pulls at once, never passed: a prompt starts once its KV fits beside the
    transfers not yet pulled (`scheduler_side.KVConnectorScheduler.can_admit`).
    """

    kv_role: str
    kv_connector: str | None = None  # None: `default_connector(platform)`
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579
    kv_buffer_size: float = 4e9
    kv_connector_extra_config: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kv_role not in ROLES:
            raise ValueError(f"kv_transfer_config.kv_role must be one of {list(ROLES)}, got {self.kv_role!r}")
        if self.kv_connector is not None and self.kv_connector not in CONNECTORS:
            vllm = f" ({self.kv_connector} is vLLM's)" if self.kv_connector in VLLM_CONNECTORS else ""
            raise ValueError(f"kv_transfer_config.kv_connector: dcpjax has {transport.describe()}; got "
                             f"{self.kv_connector!r}{vllm} — leave it out for the platform's default")
        if not isinstance(self.kv_port, int) or not 0 <= self.kv_port < 65536:
            raise ValueError(f"kv_transfer_config.kv_port must be a port in [0, 65535], got {self.kv_port!r}")
        if not isinstance(self.kv_buffer_size, (int, float)) or self.kv_buffer_size <= 0:
            raise ValueError(f"kv_transfer_config.kv_buffer_size must be bytes > 0, got {self.kv_buffer_size!r}")
        if unknown := sorted(set(self.kv_connector_extra_config) - set(EXTRA_KEYS)):
            raise ValueError(f"kv_transfer_config.kv_connector_extra_config has unknown keys {unknown}; known: "
                             + "; ".join(f"{k}: {v}" for k, v in EXTRA_KEYS.items()))
        for key, value in self.kv_connector_extra_config.items():
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise ValueError(f"kv_transfer_config.kv_connector_extra_config.{key} must be a number >= 0, "
                                 f"got {value!r}")

    @classmethod
    def from_value(cls, value: dict | str | KVTransferConfig | None) -> KVTransferConfig | None:
        """A config from `LLM(kv_transfer_config=...)`: a dict, its JSON, or a config (None: off)."""
        if value is None or isinstance(value, KVTransferConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as err:
                raise ValueError(f"kv_transfer_config is not JSON ({err}): pass an object such as "
                                 "'{\"kv_role\": \"kv_producer\"}'") from None
        if not isinstance(value, dict):  # a user's value: ValueError, as every check here
            raise ValueError(f"kv_transfer_config must be a JSON object, got {value!r}")  # noqa: TRY004
        known = {f.name for f in dataclasses.fields(cls)}
        if unknown := sorted(set(value) - known):
            raise ValueError(f"kv_transfer_config has unknown fields {unknown}; known: {sorted(known)}")
        if "kv_role" not in value:
            raise ValueError(f"kv_transfer_config needs kv_role, one of {list(ROLES)}")
        return cls(**value)

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def advertised_host(self) -> str:
        """The host a decode server pulls from: kv_ip, or this host's name when kv_ip binds every interface."""
        return socket.gethostname() if self.kv_ip in ("0.0.0.0", "::", "") else self.kv_ip

    def on_platform(self, platform: str) -> KVTransferConfig:
        """This config with kv_connector resolved (left out: `default_connector(platform)`)."""
        if self.kv_connector is not None:
            return self
        return dataclasses.replace(self, kv_connector=default_connector(platform))

    def extra(self, key: str, default: float) -> float:
        return self.kv_connector_extra_config.get(key, default)


def default_connector(platform: str) -> str:
    """The transport a pair uses when kv_connector is left out: device to device on GPU and TPU
    (the producer makes no host copy and the bytes cross once, from its devices); TCP on CPU, where it
    measured about 2x faster (benchmarks/RESULTS.md, `benchmarks/kv_transport.py`) and a device is
    host memory anyway. Not yet measured on a GPU (see docs/serving.md)."""
    return "SocketConnector" if platform == "cpu" else "JaxTransferConnector"
