"""Stored responses (``store: true``), scoped to the tenant that created them, bounded.

Off unless the operator enables ``[responses] store``. A stored entry is the ``Response`` object
plus the input items that produced it (so ``previous_response_id`` can rebuild the
conversation), kept as compact JSON bytes and decoded on read: the bytes the bound counts are the
bytes the process holds (a decoded ``dict`` of the same answer takes about 8 times its JSON),
plus `ENTRY_OVERHEAD_BYTES` per entry for its id, its record and the index slots.

Bounds: at most ``max_items`` entries and ``max_bytes`` in total, each kept ``ttl_s`` seconds.
When a new entry needs room, the tenant holding the most (bytes, or entries for the item bound)
gives up its oldest entry, so a tenant within its share (the bound divided by the tenants with
entries) keeps its responses while another stores many. One process's memory only: replicas
do not share it, and a restart forgets everything (documented for operators).

A lookup by another tenant behaves exactly like an unknown id (404), so ids leak nothing.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

ENTRY_OVERHEAD_BYTES = 512
"""Memory one entry costs beyond its JSON bytes (its record, id string, two index slots),
measured with ``sys.getsizeof`` on CPython 3.11 and rounded up."""


def compact(value: Any) -> bytes:
    """``value`` as compact UTF-8 JSON, the form entries are kept in."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


@dataclass(frozen=True)
class Stored:
    """One stored response: owner tenant, the ``Response`` object and its input items as
    compact JSON bytes, expiry (monotonic seconds) and the bytes it is counted for."""

    tenant: str
    response_json: bytes
    input_json: bytes
    expires_at: float
    size: int

    @property
    def response(self) -> dict[str, Any]:
        """The ``Response`` object, decoded."""
        value: dict[str, Any] = json.loads(self.response_json)
        return value

    @property
    def input_items(self) -> list[Any]:
        """The input items that produced the response, decoded."""
        value: list[Any] = json.loads(self.input_json)
        return value


class _Tenant:
    __slots__ = ("bytes", "ids")

    def __init__(self) -> None:
        self.ids: OrderedDict[str, None] = OrderedDict()
        self.bytes = 0


class ResponseStore:
    """Bounded in-memory store of responses keyed by response id, fair between tenants.

    Args:
        max_items: most entries kept.
        max_bytes: most bytes kept over all entries (JSON plus `ENTRY_OVERHEAD_BYTES` each);
            an entry larger than this is not kept.
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
        self._items: OrderedDict[str, Stored] = OrderedDict()  # oldest first (expiry order)
        self._tenants: dict[str, _Tenant] = {}
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def tenant_bytes(self, tenant: str) -> int:
        """Bytes counted for ``tenant``'s entries."""
        state = self._tenants.get(tenant)
        return state.bytes if state is not None else 0

    def put(self, tenant: str, response: dict[str, Any], input_items: list[Any]) -> bool:
        """Store (or replace) ``response`` for ``tenant``; False when it alone exceeds the bound.

        Room is made by `_evict_one` (the tenant holding the most gives up its oldest entry).
        """
        return self.put_json(tenant, response["id"], compact(response), compact(input_items))

    def put_json(
        self, tenant: str, response_id: str, response_json: bytes, input_json: bytes
    ) -> bool:
        """`put` of a response and its input items already encoded (`compact`)."""
        size = len(response_json) + len(input_json) + ENTRY_OVERHEAD_BYTES
        self.delete(tenant, response_id)
        if size > self.max_bytes or self.max_items < 1:
            return False
        self._expire()
        while self._items and (
            len(self._items) >= self.max_items or self.bytes + size > self.max_bytes
        ):
            self._evict_one(tenant, size)
        entry = Stored(tenant, response_json, input_json, self._clock() + self.ttl_s, size)
        self._items[response_id] = entry
        state = self._tenants.setdefault(tenant, _Tenant())
        state.ids[response_id] = None
        state.bytes += size
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
        self._remove(response_id, entry)
        return True

    def history(self, tenant: str, response_id: str) -> list[Any] | None:
        """Input and output items of the conversation ending at ``response_id``, oldest first
        (the chain of ``previous_response_id`` is already folded into each entry's input)."""
        entry = self.get(tenant, response_id)
        if entry is None:
            return None
        return [*entry.input_items, *entry.response.get("output", [])]

    def _evict_one(self, newcomer: str, size: int) -> None:
        """Drop the oldest entry of the tenant holding the most: entries when the item bound is
        reached, else bytes (the newcomer's ``size`` counted as its own)."""
        by_items = len(self._items) >= self.max_items

        def held(name: str) -> int:
            state = self._tenants[name]
            if by_items:
                return len(state.ids) + (1 if name == newcomer else 0)
            return state.bytes + (size if name == newcomer else 0)

        victim = max(self._tenants, key=held)
        oldest = next(iter(self._tenants[victim].ids))
        self._remove(oldest, self._items[oldest])

    def _remove(self, response_id: str, entry: Stored) -> None:
        del self._items[response_id]
        self.bytes -= entry.size
        state = self._tenants[entry.tenant]
        del state.ids[response_id]
        state.bytes -= entry.size
        if not state.ids:
            del self._tenants[entry.tenant]

    def _expire(self) -> None:
        now = self._clock()
        while self._items:
            key, entry = next(iter(self._items.items()))
            if entry.expires_at > now:
                break
            self._remove(key, entry)
