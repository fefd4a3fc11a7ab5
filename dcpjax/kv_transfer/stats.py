"""What `/metrics` reads of the connector: transfers by outcome (sent, expired, released on a
producer; received, released, failed on a consumer), their bytes and seconds."""

from __future__ import annotations

import threading


class TransferStats:
    """Counted from several threads (the engine's, the transport's, the pulls')."""

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
