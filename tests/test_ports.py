"""The harness's port picker: the ports one process asks for never collide with each other."""

from __future__ import annotations

import socket

import pytest

from tests.conftest import free_port

pytestmark = pytest.mark.fast


def test_free_ports_are_distinct_and_bindable() -> None:
    """A gateway gets a server and a metrics port from two calls; the kernel hands out a closed
    ephemeral port again soon, so without memory 2,000 draws repeat one (birthday bound on ~28k)."""
    ports = [free_port() for _ in range(2_000)]
    assert len(set(ports)) == len(ports)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", ports[-1]))
