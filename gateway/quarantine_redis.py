"""The quarantine shared by a fleet of gateways, in Redis (``[fleet] redis_url``).

One hash, ``<fleet.key_prefix>:quarantine``: field the fingerprint, value the JSON record of
`gateway.quarantine.Record` (``{"deaths": [unix s], "until": unix s or 0, "since": unix s}``).
A death is added by a Lua script that applies the same rule as the local file
(`gateway.quarantine.Quarantine`, ``quarantine.deaths`` within ``quarantine.window_s``), so the
deaths a poison request causes on different hosts add up: it is quarantined everywhere after the
second death, whichever engines died. Every gateway re-reads the hash every
``fleet.sync_interval_s``; ``qwen38-gateway quarantine list|clear`` reads and edits the same hash
when ``fleet.redis_url`` is set. Fingerprints are HMACs under ``QWEN38_CACHE_SALT_SECRET``, so the
gateways of a fleet share that secret (the keys file is the same on every host).
"""

from __future__ import annotations

import json
from typing import Any

from gateway.config import QuarantineSettings
from gateway.quarantine import Record

ADD_SCRIPT = """
-- Adds one death to each fingerprint in ARGV[5:]; returns the ones it quarantined.
local now = tonumber(ARGV[1])
local window = tonumber(ARGV[2])
local needed = tonumber(ARGV[3])
local duration = tonumber(ARGV[4])
local added = {}
for i = 5, #ARGV do
  local fp = ARGV[i]
  local raw = redis.call('HGET', KEYS[1], fp)
  local rec = {deaths = {}, ['until'] = 0, since = 0}
  if raw then rec = cjson.decode(raw) end
  local deaths = {}
  if type(rec.deaths) == 'table' then
    for _, t in ipairs(rec.deaths) do
      if now - t <= window then deaths[#deaths + 1] = t end
    end
  end
  deaths[#deaths + 1] = now
  local till = tonumber(rec['until']) or 0
  local since = tonumber(rec.since) or 0
  if till <= now then till = 0 end
  if #deaths >= needed and till <= now then
    till = now + duration
    since = now
    added[#added + 1] = fp
  end
  local parts = {}
  for j, t in ipairs(deaths) do parts[j] = string.format('%.6f', t) end
  redis.call('HSET', KEYS[1], fp, '{"deaths":[' .. table.concat(parts, ',') .. '],"until":'
    .. string.format('%.6f', till) .. ',"since":' .. string.format('%.6f', since) .. '}')
end
return added
"""

PRUNE_SCRIPT = """
-- Drops records with no death in the window and no quarantine running.
local now = tonumber(ARGV[1])
local window = tonumber(ARGV[2])
local all = redis.call('HGETALL', KEYS[1])
local dropped = 0
for i = 1, #all, 2 do
  local ok, rec = pcall(cjson.decode, all[i + 1])
  local keep = false
  if ok and type(rec) == 'table' then
    if (tonumber(rec['until']) or 0) > now then keep = true end
    if type(rec.deaths) == 'table' then
      for _, t in ipairs(rec.deaths) do
        if now - t <= window then keep = true end
      end
    end
  end
  if not keep then
    redis.call('HDEL', KEYS[1], all[i])
    dropped = dropped + 1
  end
end
return dropped
"""


def hash_key(prefix: str) -> str:
    """The Redis hash of the shared quarantine."""
    return f"{prefix}:quarantine"


def parse_records(raw: dict[Any, Any]) -> dict[str, Record]:
    """The hash's fields as `Record`s; malformed values are skipped."""
    out: dict[str, Record] = {}
    for field, value in raw.items():
        fp = field.decode() if isinstance(field, bytes) else str(field)
        try:
            doc = json.loads(value)
        except ValueError:
            continue
        if not isinstance(doc, dict):
            continue
        deaths = doc.get("deaths")
        out[fp] = Record(
            [float(t) for t in deaths if isinstance(t, (int, float))]
            if isinstance(deaths, list)
            else [],
            float(doc.get("until") or 0),
            float(doc.get("since") or 0),
        )
    return out


def add_args(settings: QuarantineSettings, fingerprints: list[str], now: float) -> list[Any]:
    """The ARGV of the add script."""
    return [now, settings.window_s, settings.deaths, settings.duration_s, *fingerprints]
