"""Retries of the official SDKs attach to one generation: the real gateway, the simulator and the
``openai`` and ``anthropic`` SDKs with their own timeouts and retries (about 1 minute)."""

from __future__ import annotations

import sqlite3
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.conftest import ALIAS, KEY_A, Gateway, Sim, wait_until

PACED = ("--tokens-per-second", "10", "--completion-tokens", "140")
"""140 tokens at 10/s: a 14 s answer, longer than two SDK timeouts of 5 s."""


@pytest.fixture
def gw(sim_factory: Callable[..., Sim], gateway_factory: Callable[..., Gateway]) -> Gateway:
    """A simulator answering 140 tokens at 10 tokens/s behind a gateway."""
    return gateway_factory(sim_factory(*PACED))


def shared_rows(route: str) -> tuple[list[tuple[Any, ...]], ...]:
    """The one ledger row of a 140-token answer shared by two retries: both attached while it
    ran, or the second got it replayed after its end."""
    return ([(route, 200, 140, 2)], [(route, 200, 140, 1)])


def ledger_rows(gw: Gateway) -> list[tuple[Any, ...]]:
    """``(endpoint, status, completion_tokens, attaches)`` of every ledger record so far."""
    path = Path(gw.config_path).parent / "gw-usage.sqlite3"
    with sqlite3.connect(path) as conn:
        query = "SELECT endpoint, status, completion_tokens, attaches FROM usage ORDER BY rowid"
        return list(conn.execute(query))


def model_requests(gw: Gateway) -> int:
    """Generations the simulator ran (model requests it received)."""
    assert gw.sim is not None
    return len(gw.sim.model_records())


def test_openai_sdk_timeouts_and_retries_share_one_generation(gw: Gateway) -> None:
    """``openai`` with timeout 5 s and 2 retries against a 14 s answer: it gets the answer from
    one generation, charged once in one ledger row noting the two attached retries."""
    client = openai.OpenAI(base_url=gw.url("/v1"), api_key=KEY_A, timeout=5.0, max_retries=2)
    started = time.monotonic()
    answer = client.chat.completions.create(
        model=ALIAS,
        messages=[{"role": "user", "content": f"retry me {uuid.uuid4().hex}"}],
        max_tokens=140,
    )
    elapsed = time.monotonic() - started
    assert answer.usage is not None and answer.usage.completion_tokens == 140
    assert 10 < elapsed < 30
    assert model_requests(gw) == 1
    assert wait_until(lambda: len(ledger_rows(gw)) == 1, 5)
    assert ledger_rows(gw) in shared_rows("/v1/chat/completions")
    # Both retries attached (or, on a machine slow enough that the answer ended between the
    # second retry leaving and the third try arriving, the last one got it replayed).
    assert gw.metric("gateway_retries_total", match="sdk_retry") == 2
    assert gw.metric("gateway_tokens_total", type="completion") == 140


def test_anthropic_sdk_timeouts_and_retries_share_one_generation(gw: Gateway) -> None:
    """``anthropic`` with timeout 5 s and 2 retries against a 14 s answer: one generation, the
    SDK gets the message, one ledger row."""
    client = anthropic.Anthropic(base_url=gw.base_url, api_key=KEY_A, timeout=5.0, max_retries=2)
    message = client.messages.create(
        model=ALIAS,
        max_tokens=140,
        messages=[{"role": "user", "content": f"retry me {uuid.uuid4().hex}"}],
    )
    assert message.usage.output_tokens == 140
    assert model_requests(gw) == 1
    assert wait_until(lambda: len(ledger_rows(gw)) == 1, 5)
    assert ledger_rows(gw) in shared_rows("/v1/messages")
    assert gw.metric("gateway_retries_total", match="sdk_retry") == 2


def test_stream_with_key_attached_midway_gets_the_whole_stream(gw: Gateway) -> None:
    """Two ``openai`` streams with one Idempotency-Key, the second started mid-stream: the
    second gets every chunk from the first one on, same ids, from one generation."""
    client = openai.OpenAI(base_url=gw.url("/v1"), api_key=KEY_A, max_retries=0)
    key = {"Idempotency-Key": uuid.uuid4().hex}
    body: dict[str, Any] = {
        "model": ALIAS,
        "messages": [{"role": "user", "content": "stream once"}],
        "max_tokens": 30,
        "stream": True,
        "extra_body": {"sim": {"completion_tokens": 30, "tokens_per_second": 15}},
        "extra_headers": key,
    }
    first = client.chat.completions.create(**body)
    chunks_first = []
    for chunk in first:
        chunks_first.append(chunk)
        if len(chunks_first) == 5:
            break
    got: list[Any] = []
    second = threading.Thread(target=lambda: got.extend(client.chat.completions.create(**body)))
    second.start()
    chunks_first.extend(first)
    second.join(30)
    assert not second.is_alive()
    assert [c.model_dump() for c in got] == [c.model_dump() for c in chunks_first]
    assert len({c.id for c in got}) == 1
    assert model_requests(gw) == 1
    assert gw.metric("gateway_retries_total", match="key", outcome="attach") == 1


def test_reused_key_is_409_once_without_sdk_retries(gw: Gateway) -> None:
    """A key reused with another body: the SDK raises ConflictError and does not retry it
    (``x-should-retry: false``), although it retries other 409s."""
    client = openai.OpenAI(base_url=gw.url("/v1"), api_key=KEY_A, max_retries=2)
    key = {"Idempotency-Key": uuid.uuid4().hex}
    fast = {"sim": {"tokens_per_second": 0, "completion_tokens": 2}}
    messages: list[Any] = [{"role": "user", "content": "a"}]
    client.chat.completions.create(
        model=ALIAS, messages=messages, max_tokens=2, extra_headers=key, extra_body=fast
    )
    with pytest.raises(openai.ConflictError) as caught:
        client.chat.completions.create(
            model=ALIAS, messages=messages, max_tokens=3, extra_headers=key, extra_body=fast
        )
    assert caught.value.code == "idempotency_key_reused"
    assert gw.metric("gateway_retries_total", match="key", outcome="conflict") == 1
    assert model_requests(gw) == 1


def rss_kib(pid: int) -> int:
    """``VmRSS`` of ``/proc/<pid>/status`` in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS line")


def test_kept_answers_stay_within_max_bytes_in_rss(
    sim_factory: Callable[..., Sim], gateway_factory: Callable[..., Gateway]
) -> None:
    """8 streams with keys, 16 MiB of events each, under retries.max_bytes = 16 MiB: the
    gateway's RSS grows by less than twice the bound plus the streams' own buffers, not by the
    128 MiB an unbounded record would hold."""
    mib = 1024 * 1024
    gw = gateway_factory(
        sim_factory("--tokens-per-second", "100"),
        {
            "retries": {"max_bytes": 16 * mib, "buffer_bytes": 64 * mib},
            "engine": {"max_concurrency": 8},
        },
    )
    body = {
        "model": ALIAS,
        "messages": [{"role": "user", "content": "long"}],
        "max_tokens": 256,
        "stream": True,
        "sim": {"completion_tokens": 256, "token_bytes": 64 * 1024},
    }
    before = rss_kib(gw.proc.pid)
    peak = [0]
    received = [0] * 8
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss_kib(gw.proc.pid) - before)
            time.sleep(0.02)

    def read(index: int) -> None:
        headers = {"Authorization": f"Bearer {KEY_A}", "Idempotency-Key": f"big-{index}"}
        with httpx.stream(
            "POST", gw.url("/v1/chat/completions"), json=body, headers=headers, timeout=60
        ) as reply:
            for data in reply.iter_bytes():
                received[index] += len(data)

    watcher = threading.Thread(target=watch)
    watcher.start()
    readers = [threading.Thread(target=read, args=(i,)) for i in range(8)]
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join(120)
    done.set()
    watcher.join()
    print(f"RSS growth peak {peak[0]} KiB for {sum(received)} bytes relayed")
    assert all(size > 15 * mib for size in received)
    assert gw.metric("gateway_retry_buffer_bytes") <= 16 * mib
    assert peak[0] < (2 * 16 + 8 + 12) * 1024, f"RSS grew {peak[0]} KiB"
