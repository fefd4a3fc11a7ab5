"""KV transports by `kv_connector` name (vLLM-style names): each a producer's sender and a consumer's
receiver behind one interface (`base.KVSender`, `base.KVReceiver`).

    JaxTransferConnector  `jax.experimental.transfer`, device to device: the producer's arrays stay on
                          its devices until a pull; the consumer pulls each onto one of its devices.
                          A small TCP control channel (the socket transport's server) carries the
                          request, the arrays' names/shapes/dtypes and the acknowledgement.
    SocketConnector       TCP: the producer holds host copies; one message of raw bytes per pull.

`TRANSPORTS[name]` is (sender class, receiver class); a name not there raises a ValueError (and
KeyError) naming those that are. A transport's module is imported on first use (the socket one needs
no JAX).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping

from .base import KVReceiver, KVSender, PullResult

# name -> (module, sender class, receiver class, what it is: for error messages and --help)
_TRANSPORTS = {
    "JaxTransferConnector": ("jax_transfer", "JaxTransferSender", "JaxTransferReceiver",
                             "jax.experimental.transfer, device to device (a TCP control channel)"),
    "SocketConnector": ("socket", "SocketSender", "SocketReceiver", "TCP, host copies"),
}
NAMES = tuple(_TRANSPORTS)


class UnknownConnector(KeyError, ValueError):
    """A kv_connector name no transport has (a ValueError for a user's config, a KeyError for a mapping)."""

    def __str__(self) -> str:
        return str(self.args[0])


def describe() -> str:
    return "; ".join(f"{name} ({entry[3]})" for name, entry in _TRANSPORTS.items())


class _Registry(Mapping):
    def __getitem__(self, name: str) -> tuple[type[KVSender], type[KVReceiver]]:
        entry = _TRANSPORTS.get(name) if isinstance(name, str) else None
        if entry is None:
            raise UnknownConnector(f"kv_connector {name!r} is not a dcpjax transport; there are: {describe()}")
        module = importlib.import_module(f"{__name__}.{entry[0]}")
        return getattr(module, entry[1]), getattr(module, entry[2])

    def __iter__(self) -> Iterator[str]:
        return iter(_TRANSPORTS)

    def __len__(self) -> int:
        return len(_TRANSPORTS)

    def __contains__(self, name) -> bool:
        return name in _TRANSPORTS


TRANSPORTS: Mapping[str, tuple[type[KVSender], type[KVReceiver]]] = _Registry()


__all__ = ["NAMES", "TRANSPORTS", "KVReceiver", "KVSender", "PullResult", "UnknownConnector", "describe"]
