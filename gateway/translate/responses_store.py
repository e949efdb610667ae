"""Stored responses (``store: true``), scoped to the tenant that created them, bounded.

Off unless the operator enables ``[responses] store``. A stored entry is the ``Response`` object
plus the input items that produced it (so ``previous_response_id`` can rebuild the
conversation). Bounds: at most ``max_items`` entries and ``max_bytes`` of JSON in total, each
kept ``ttl_s`` seconds; the oldest entries go first. One process's memory only: replicas do not
share it, and a restart forgets everything (documented for operators).

A lookup by another tenant behaves exactly like an unknown id (404), so ids leak nothing.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class Stored:
    """One stored response: owner tenant, the ``Response`` object, its input items, expiry
    (monotonic seconds) and size in bytes (JSON of response and input)."""

    tenant: str
    response: dict[str, Any]
    input_items: list[Any]
    expires_at: float
    size: int
    cancelled: bool = False


class ResponseStore:
    """Bounded in-memory store of responses keyed by response id.

    Args:
        max_items: most entries kept.
        max_bytes: most JSON bytes kept over all entries; an entry larger than this is not kept.
        ttl_s: seconds an entry lives.
        clock: monotonic clock in seconds.
    """

    def __init__(
        self, max_items: int, max_bytes: int, ttl_s: float, clock: Callable[[], float]
    ) -> None:
        self.max_items = max_items
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        self._items: OrderedDict[str, Stored] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def put(self, tenant: str, response: dict[str, Any], input_items: list[Any]) -> bool:
        """Store (or replace) ``response`` for ``tenant``; False when it alone exceeds the bound."""
        size = len(json.dumps(response, separators=(",", ":"))) + len(
            json.dumps(input_items, separators=(",", ":"))
        )
        self.delete(tenant, response["id"])
        if size > self.max_bytes:
            return False
        self._expire()
        while self._items and (
            len(self._items) >= self.max_items or self.bytes + size > self.max_bytes
        ):
            _, oldest = self._items.popitem(last=False)
            self.bytes -= oldest.size
        entry = Stored(tenant, response, input_items, self._clock() + self.ttl_s, size)
        self._items[response["id"]] = entry
        self.bytes += size
        return True

    def get(self, tenant: str, response_id: str) -> Stored | None:
        """The entry when it exists, has not expired and belongs to ``tenant``; else None."""
        self._expire()
        entry = self._items.get(response_id)
        if entry is None or entry.tenant != tenant:
            return None
        return entry

    def delete(self, tenant: str, response_id: str) -> bool:
        """Remove the tenant's entry; False when there is none (or it is another tenant's)."""
        entry = self._items.get(response_id)
        if entry is None or entry.tenant != tenant:
            return False
        del self._items[response_id]
        self.bytes -= entry.size
        return True

    def history(self, tenant: str, response_id: str) -> list[Any] | None:
        """Input and output items of the conversation ending at ``response_id``, oldest first
        (the chain of ``previous_response_id`` is already folded into each entry's input)."""
        entry = self.get(tenant, response_id)
        if entry is None:
            return None
        return [*entry.input_items, *entry.response.get("output", [])]

    def _expire(self) -> None:
        now = self._clock()
        while self._items:
            key, entry = next(iter(self._items.items()))
            if entry.expires_at > now:
                break
            del self._items[key]
            self.bytes -= entry.size
