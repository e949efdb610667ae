"""The one fake clock of the tests: a monotonic clock in seconds that moves only when told."""

from __future__ import annotations


class FakeClock:
    """Callable like `time.monotonic`; moves only by `advance` (or by setting ``now``).

    Args:
        now: the starting reading in seconds (any value: only differences matter).
    """

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        """Move the clock forward by ``seconds``."""
        self.now += seconds
