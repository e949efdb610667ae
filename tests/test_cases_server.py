"""Cases C21 and C25 and TLS: the listeners' own behaviour (drain, error pages, certificates)."""

from __future__ import annotations

import json
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import openai
import pytest

from tests.conftest import ALIAS, KEY_A, REPO, Gateway, free_port, to_toml, wait_until, write_keys
from tests.tls_certs import make_ca

AUTH = {"Authorization": f"Bearer {KEY_A}"}
METRICS_TOKEN = "metrics-token-0123456789abcdef"


def chat(sim: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    """A chat body, with the simulator's per-request ``sim`` object when given."""
    out: dict[str, Any] = {"model": ALIAS, "messages": [{"role": "user", "content": "hi"}]}
    if sim:
        out["sim"] = sim
    out.update(extra)
    return out


# ----------------------------------------------------------------------------------------- C25


def raw_exchange(url: str, request: bytes) -> bytes:
    """Send raw bytes to the listener of ``url``; everything it answers until it closes."""
    parsed = urlparse(url)
    with socket.create_connection((parsed.hostname, parsed.port), timeout=5) as sock:
        sock.sendall(request)
        chunks = []
        while True:
            try:
                data = sock.recv(65536)
            except (ConnectionResetError, TimeoutError):
                break
            if not data:
                break
            chunks.append(data)
    return b"".join(chunks)


def bad_requests(secret: str) -> dict[str, bytes]:
    """Malformed requests that each carry ``secret`` in a header and in the request line."""
    auth = f"Authorization: Bearer {secret}\r\n".encode()
    return {
        "request_line": b"GET /metrics?" + secret.encode() + b" HTTP/1.1 junk\r\n" + auth + b"\r\n",
        "bad_header_char": b"GET /metrics HTTP/1.1\r\nHost: x\r\n"
        + auth
        + b"X-Bad\x01Name: "
        + secret.encode()
        + b"\r\n\r\n",
        "huge_header": b"GET /metrics HTTP/1.1\r\nHost: x\r\n"
        + f"Authorization: Bearer {secret}{'A' * 70_000}\r\n\r\n".encode(),
        "bad_header_value": b"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
        + secret.encode()
        + b"\x00\x7f\r\n\r\n",
    }


@pytest.mark.parametrize("port", ["metrics", "public"])
def test_c25_listener_error_pages_echo_nothing(
    gateway_factory: Any, sim_factory: Any, workdir: Path, port: str
) -> None:
    """C25: malformed requests on the metrics (and public) port get a short body echoing no header, token or request line."""
    write_keys(
        workdir / "gw-keys.env",
        {"KEY_A": ("acme", KEY_A)},
        f"QWEN38_METRICS_TOKEN={METRICS_TOKEN}\n",
    )
    gw = gateway_factory(sim_factory())
    url = gw.metrics_url if port == "metrics" else gw.base_url
    for secret in (METRICS_TOKEN, KEY_A):
        for name, request in bad_requests(secret).items():
            answer = raw_exchange(url, request)
            assert answer[:9] in (b"HTTP/1.0 ", b"HTTP/1.1 "), (name, answer[:80])
            assert answer[9:10] == b"4", (name, answer[:80])
            _, _, body = answer.partition(b"\r\n\r\n")
            assert len(body) < 300, name
            for fragment in (secret, secret[7:19], "junk", "X-Bad"):
                assert fragment.encode() not in answer, (name, fragment)
    assert METRICS_TOKEN not in gw.log_path.read_text()
    assert KEY_A not in gw.log_path.read_text()
    assert gw.proc.poll() is None


# ----------------------------------------------------------------------------------------- TLS


def tls_gateway(
    gateway_factory: Any, sim_factory: Any, workdir: Path, **server: Any
) -> tuple[Gateway, Any]:
    """A gateway serving TLS with a certificate from a CA made here; returns it and the CA."""
    ca = make_ca(workdir)
    cert, key = workdir / "cert.pem", workdir / "key.pem"
    ca.issue(cert, key, "first")
    gw = gateway_factory(
        sim_factory(),
        {"server": {"tls_cert_file": str(cert), "tls_key_file": str(key), **server}},
    )
    gw.extra.update(ca=ca, cert=cert, key=key)
    return gw, ca


def peer_common_name(gw: Gateway, ca_bundle: Path) -> str:
    """The common name of the certificate the listener presents to a new connection."""
    parsed = urlparse(gw.base_url)
    context = ssl.create_default_context(cafile=str(ca_bundle))
    with (
        socket.create_connection((parsed.hostname, parsed.port), timeout=5) as raw,
        context.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
    ):
        cert = tls.getpeercert()
        assert tls.version() in ("TLSv1.2", "TLSv1.3")
    subject = dict(item[0] for item in cert["subject"])
    return str(subject["commonName"])


def test_tls_openai_sdk_with_a_ca_bundle(
    gateway_factory: Any, sim_factory: Any, workdir: Path
) -> None:
    """TLS: the openai SDK, trusting only a CA made in the test, streams and completes over HTTPS; plain HTTP is refused."""
    gw, ca = tls_gateway(gateway_factory, sim_factory, workdir)
    assert gw.base_url.startswith("https://")
    with httpx.Client(
        verify=ssl.create_default_context(cafile=str(ca.bundle)), timeout=30
    ) as http_client:
        client = openai.OpenAI(
            base_url=gw.url("/v1"), api_key=KEY_A, http_client=http_client, max_retries=0
        )
        answer = client.chat.completions.create(
            model=ALIAS, messages=[{"role": "user", "content": "hi"}]
        )
        assert answer.choices[0].message.content
        text = "".join(
            chunk.choices[0].delta.content or ""
            for chunk in client.chat.completions.create(
                model=ALIAS, messages=[{"role": "user", "content": "hi"}], stream=True
            )
            if chunk.choices
        )
        assert text
    with pytest.raises(httpx.HTTPError):
        httpx.get(gw.base_url.replace("https://", "http://") + "/health", timeout=3)
    with pytest.raises(httpx.ConnectError):  # an unknown CA is refused by the client
        httpx.get(gw.url("/health"), timeout=3)
    # TLS 1.1 and older are refused by the server.
    old = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    old.load_verify_locations(str(ca.bundle))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        old.maximum_version = ssl.TLSVersion.TLSv1_1
        old.minimum_version = ssl.TLSVersion.TLSv1
    parsed = urlparse(gw.base_url)
    with (
        socket.create_connection((parsed.hostname, parsed.port), timeout=5) as raw,
        pytest.raises(ssl.SSLError),
    ):
        old.wrap_socket(raw, server_hostname="127.0.0.1").close()


def test_tls_certificate_renewed_without_restart_or_cut(
    gateway_factory: Any, sim_factory: Any, workdir: Path
) -> None:
    """TLS: a renewed certificate is used for new connections after a change or SIGHUP; an open stream is not cut."""
    gw, ca = tls_gateway(gateway_factory, sim_factory, workdir)
    assert peer_common_name(gw, ca.bundle) == "first"
    result: dict[str, Any] = {}
    started = threading.Event()

    def stream() -> None:
        payload = chat({"tokens_per_second": 10, "completion_tokens": 30}, stream=True)
        with (
            httpx.Client(
                verify=ssl.create_default_context(cafile=str(ca.bundle)), timeout=30
            ) as client,
            client.stream("POST", gw.url("/v1/chat/completions"), json=payload, headers=AUTH) as r,
        ):
            raw = b""
            for data in r.iter_raw():
                raw += data
                started.set()
            result["raw"] = raw

    worker = threading.Thread(target=stream)
    worker.start()
    assert started.wait(10)
    ca.issue(gw.extra["cert"], gw.extra["key"], "second")  # renewal by rename, on change
    assert wait_until(lambda: peer_common_name(gw, ca.bundle) == "second", 5)
    ca.issue(gw.extra["cert"], gw.extra["key"], "third")
    gw.proc.send_signal(signal.SIGHUP)
    assert wait_until(lambda: peer_common_name(gw, ca.bundle) == "third", 5)
    worker.join(30)
    assert result["raw"].endswith(b"data: [DONE]\n\n"), "the open stream was cut"
    # A new certificate whose key was not written yet keeps the pair in force (a failed load
    # must not leave the new certificate with the old key in the live context).
    spare = workdir / "spare"
    spare.mkdir()
    ca.issue(spare / "cert.pem", spare / "key.pem", "fourth")
    gw.extra["cert"].write_bytes((spare / "cert.pem").read_bytes())
    gw.proc.send_signal(signal.SIGHUP)
    assert wait_until(lambda: sum(e.get("event") == "tls_reload_failed" for e in gw.logs()) >= 1, 5)
    assert peer_common_name(gw, ca.bundle) == "third"
    # A broken pair keeps the one in force.
    gw.extra["key"].write_text("not a key\n")
    gw.proc.send_signal(signal.SIGHUP)
    assert wait_until(lambda: any(e.get("event") == "tls_reload_failed" for e in gw.logs()), 5)
    assert peer_common_name(gw, ca.bundle) == "third"


def _serve_once(config: dict[str, Any], workdir: Path) -> subprocess.CompletedProcess[str]:
    path = workdir / "plain.toml"
    path.write_text(to_toml(config))
    return subprocess.run(
        [sys.executable, "-m", "gateway", "serve", "--config", str(path)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=30,
        check=False,
    )


def test_tls_plain_http_off_loopback_needs_an_explicit_choice(workdir: Path) -> None:
    """TLS: plain HTTP on a non-loopback address without server.plain_http refuses to start, naming the settings."""
    keys = workdir / "keys.env"
    write_keys(keys, {"KEY_A": ("acme", KEY_A)})
    config = {
        "server": {"host": "0.0.0.0", "port": free_port()},
        "metrics": {"enabled": False},
        "auth": {"keys_file": str(keys)},
    }
    result = _serve_once(config, workdir)
    assert result.returncode == 1
    assert "server.plain_http" in result.stderr and "tls_cert_file" in result.stderr
    config["server"]["tls_cert_file"] = str(workdir / "missing.pem")
    result = _serve_once(config, workdir)
    assert result.returncode == 1 and "tls_key_file" in result.stderr


# ----------------------------------------------------------------------------------------- C21


def in_flight(gw: Gateway) -> int:
    """Requests holding an engine slot, from /ready."""
    return int(httpx.get(gw.url("/ready"), timeout=5).json()["in_flight"])


def queue_depth(gw: Gateway) -> int:
    """Requests waiting in the admission queue, from /ready."""
    return int(httpx.get(gw.url("/ready"), timeout=5).json()["queue_depth"])


def test_c21_drain_refuses_the_queue_at_once_and_exits_within_grace(
    gateway_factory: Any, sim_factory: Any
) -> None:
    """C21: on SIGTERM a queued request gets 503 with Retry-After at once, new connections are refused, exit within grace + 2 s."""
    grace = 3.0
    gw = gateway_factory(
        sim_factory(),
        {"server": {"shutdown_grace_s": grace}, "engine": {"max_concurrency": 1}},
    )
    slow = chat({"tokens_per_second": 4, "completion_tokens": 200})
    results: dict[str, Any] = {}

    def post(name: str, payload: dict[str, Any]) -> None:
        try:
            r = httpx.post(gw.url("/v1/chat/completions"), json=payload, headers=AUTH, timeout=30)
            results[name] = (r.status_code, dict(r.headers), r.content, time.monotonic())
        except httpx.HTTPError as exc:
            results[name] = (None, {}, repr(exc).encode(), time.monotonic())

    running = threading.Thread(target=post, args=("running", slow))
    running.start()
    assert wait_until(lambda: in_flight(gw) == 1, 10)
    queued = threading.Thread(target=post, args=("queued", chat()))
    queued.start()
    assert wait_until(lambda: queue_depth(gw) == 1, 10)
    signalled = time.monotonic()
    gw.proc.send_signal(signal.SIGTERM)
    queued.join(5)
    status, headers, content, at = results["queued"]
    assert status == 503 and at - signalled < 1.0
    assert int(headers["retry-after"]) >= 1
    assert json.loads(content)["error"]["code"] == "shutting_down"
    assert wait_until(lambda: _refused(gw), 2), "still accepting new connections"
    gw.proc.wait(grace + 5)
    assert time.monotonic() - signalled < grace + 2.0
    running.join(10)
    assert len(gw.sim.model_records()) == 1 if gw.sim else True, "the queued request was started"


def test_c21_a_generation_no_client_reads_ends_when_the_drain_begins(
    gateway_factory: Any, sim_factory: Any
) -> None:
    """C21: a stream with an ``Idempotency-Key`` whose client left is kept running for a retry
    to attach (``retries.orphan_grace_s``); once SIGTERM closes the listeners none can come, so
    it is aborted at once instead of generating for nobody until the grace: the gateway exits
    well before the grace, the engine's record says aborted, the access line says the client
    left."""
    grace = 8.0
    gw = gateway_factory(
        sim_factory(),
        {"server": {"shutdown_grace_s": grace}, "retries": {"orphan_grace_s": 30.0}},
    )
    slow = chat({"tokens_per_second": 10, "completion_tokens": 300}, stream=True)
    headers = {**AUTH, "Idempotency-Key": "orphan-at-drain"}
    with httpx.stream(
        "POST", gw.url("/v1/chat/completions"), json=slow, headers=headers, timeout=30
    ) as r:
        assert r.status_code == 200
        next(r.iter_raw())  # the first event: the generation runs; then the client leaves
    assert wait_until(lambda: in_flight(gw) == 1, 5)
    time.sleep(0.5)
    assert in_flight(gw) == 1, "the generation was not kept for a retry"
    signalled = time.monotonic()
    gw.proc.send_signal(signal.SIGTERM)
    assert gw.proc.wait(grace + 5) == 0
    assert time.monotonic() - signalled < grace / 2, "the orphan held the drain"
    assert gw.sim is not None
    (record,) = gw.sim.model_records()
    assert record.get("outcome") == "aborted", record
    (line,) = [e for e in gw.access_logs() if e.get("route") == "/v1/chat/completions"]
    assert line.get("reason") != "shutdown" and not line.get("error_status"), line
    drained = [e for e in gw.logs() if e.get("event") == "gateway_drained"]
    assert drained and drained[-1]["orphans_ended"] == 1, drained


def test_c21_a_body_still_arriving_when_the_drain_begins_is_refused_at_once(
    gateway_factory: Any, sim_factory: Any
) -> None:
    """C21: once SIGTERM closes the listeners nothing more is read from any connection, so a
    request whose body is still arriving can never be served: it is answered 503
    ``shutting_down`` (``Connection: close``) at once, not when the grace ends, and the gateway
    exits well before the grace; nothing reached the engine."""
    grace = 8.0
    gw = gateway_factory(sim_factory(), {"server": {"shutdown_grace_s": grace}})
    body = json.dumps(chat()).encode()
    port = urlparse(gw.base_url).port
    assert port is not None
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY_A}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        sock.sendall(head.encode() + body[:20])
        time.sleep(1.0)  # the handler is reading the body
        signalled = time.monotonic()
        gw.proc.send_signal(signal.SIGTERM)
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
        answered = time.monotonic() - signalled
    head_text, _, payload = answer.partition(b"\r\n\r\n")
    assert head_text.startswith(b"HTTP/1.1 503"), answer[:300]
    assert b"connection: close" in head_text.lower()
    assert json.loads(payload)["error"]["code"] == "shutting_down"
    assert answered < 2.0, answered
    assert gw.proc.wait(grace + 5) == 0
    assert time.monotonic() - signalled < grace / 2, "the upload held the drain"
    assert gw.sim is not None and gw.sim.model_records() == []
    drained = [e for e in gw.logs() if e.get("event") == "gateway_drained"]
    assert drained and drained[-1]["uploads_refused"] == 1, drained


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/messages"])
def test_c21_a_keyed_stream_and_its_follower_end_with_the_drain_event_at_the_grace(
    gateway_factory: Any, sim_factory: Any, route: str
) -> None:
    """C21 with retries: a stream with an ``Idempotency-Key`` and a retry attached to it are
    both still open at the grace; each ends with the dialect's ``shutting_down`` error event
    inside its one well-formed answer (the drain ends the generation's task, not the two
    connections' handlers, which would answer again on a stream under way), and both access
    lines say 200 with ``error_status`` 503."""
    grace = 3.0
    sim = sim_factory("--tokens-per-second", "5", "--completion-tokens", "400")
    gw = gateway_factory(sim, {"server": {"shutdown_grace_s": grace}})
    body = chat(stream=True, max_tokens=400)
    headers = {**AUTH, "Idempotency-Key": f"drain-{route}"}
    raws: dict[str, bytes] = {}
    started = {name: threading.Event() for name in ("leader", "follower")}

    def stream(name: str) -> None:
        raw = b""
        try:
            with httpx.stream("POST", gw.url(route), json=body, headers=headers, timeout=30) as r:
                for data in r.iter_raw():
                    raw += data
                    started[name].set()
        except httpx.HTTPError as exc:
            raw += b"\nCLIENT-ERROR " + repr(exc).encode()
        raws[name] = raw

    leader = threading.Thread(target=stream, args=("leader",))
    leader.start()
    assert started["leader"].wait(10)
    follower = threading.Thread(target=stream, args=("follower",))
    follower.start()
    assert started["follower"].wait(10)
    gw.proc.send_signal(signal.SIGTERM)
    leader.join(grace + 10)
    follower.join(grace + 10)
    assert gw.proc.wait(grace + 5) == 0
    for name, raw in raws.items():
        assert b"CLIENT-ERROR" not in raw and b"HTTP/1.1" not in raw, (name, raw[-400:])
        last = raw.rstrip().rsplit(b"\n\n", 1)[-1]  # the drain's event, in the dialect's shape
        assert b"is shutting down" in last and b"error" in last, (name, raw[-400:])
    lines = [e for e in gw.access_logs() if e.get("route") == route]
    assert len(lines) == 2, lines
    assert all((e["status"], e.get("error_status")) == (200, 503) for e in lines), lines
    assert not [e for e in lines if e.get("reason") == "client_disconnect"], lines


def _refused(gw: Gateway) -> bool:
    try:
        r = httpx.get(gw.url("/health"), timeout=1)
    except httpx.HTTPError:
        return True
    return r.status_code == 503


def test_c21_open_streams_end_with_an_error_event_at_the_grace(
    gateway_factory: Any, sim_factory: Any
) -> None:
    """C21: two open streams run through the grace then get an SSE error event, logged as shutdown; a kept-alive connection gets 503 or is closed; exit within grace + 2 s."""
    grace = 3.0
    gw = gateway_factory(
        sim_factory(),
        {"server": {"shutdown_grace_s": grace}, "engine": {"max_concurrency": 2}},
    )
    slow = chat({"tokens_per_second": 4, "completion_tokens": 400}, stream=True)
    raws: dict[int, bytes] = {}
    started = [threading.Event(), threading.Event()]

    def stream(index: int) -> None:
        raw = b""
        try:
            with httpx.stream(
                "POST", gw.url("/v1/chat/completions"), json=slow, headers=AUTH, timeout=30
            ) as r:
                for data in r.iter_raw():
                    raw += data
                    started[index].set()
        except httpx.HTTPError as exc:
            raw += b"\nCLIENT-ERROR " + type(exc).__name__.encode()
        raws[index] = raw

    workers = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    for worker in workers:
        worker.start()
    assert all(event.wait(10) for event in started)
    kept = httpx.Client(timeout=10)
    assert kept.get(gw.url("/health")).status_code == 200  # a kept-alive connection
    signalled = time.monotonic()
    gw.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    try:
        again = kept.post(gw.url("/v1/chat/completions"), json=chat(), headers=AUTH)
        assert again.status_code == 503 and again.json()["error"]["code"] == "shutting_down"
    except httpx.HTTPError:
        pass  # the idle kept-alive connection was closed: also a refusal
    kept.close()
    assert _refused(gw)
    for worker in workers:
        worker.join(grace + 5)
    gw.proc.wait(grace + 5)
    assert time.monotonic() - signalled < grace + 2.0
    for raw in raws.values():
        payloads = [line[6:] for line in raw.split(b"\n") if line.startswith(b"data: ")]
        assert len(payloads) > 5, "the stream did not run during the grace"
        assert json.loads(payloads[-1])["error"]["code"] == "shutting_down", raw[-300:]
        assert b"[DONE]" not in raw
    lines = [e for e in gw.access_logs() if e.get("route") == "/v1/chat/completions"]
    cut = [e for e in lines if e.get("reason") == "shutdown"]
    assert len(cut) >= 2, lines
    assert not [e for e in lines if e.get("reason") == "client_disconnect"]
    # Requests, not tasks: each stream also runs a retry leader's task of its own.
    (drained,) = [e for e in gw.logs() if e.get("event") == "gateway_drained"]
    assert drained["cut_by_shutdown"] == 2, drained


def test_c21_a_second_signal_exits_at_once_and_logs_the_cut_streams_as_shutdown(
    gateway_factory: Any, sim_factory: Any
) -> None:
    """C21: a second SIGTERM during the drain exits at once (no grace); the stream still open
    and the request still queued are logged ``reason="shutdown"``, not as clients that left;
    the forced exit is logged."""
    grace = 30.0
    gw = gateway_factory(
        sim_factory(),
        {
            "server": {"shutdown_grace_s": grace, "drain_delay_s": 5.0},
            "engine": {"max_concurrency": 1},
        },
    )
    slow = chat({"tokens_per_second": 4, "completion_tokens": 400}, stream=True)
    started = threading.Event()
    ended = threading.Event()

    def stream(payload: dict[str, Any], seen: threading.Event | None) -> None:
        try:
            with httpx.stream(
                "POST", gw.url("/v1/chat/completions"), json=payload, headers=AUTH, timeout=30
            ) as r:
                for _ in r.iter_raw():
                    if seen is not None:
                        seen.set()
        except httpx.HTTPError:
            pass
        ended.set()

    running = threading.Thread(target=stream, args=(slow, started))
    running.start()
    assert started.wait(10) and wait_until(lambda: in_flight(gw) == 1, 10)
    queued = threading.Thread(target=stream, args=(chat(stream=True), None))
    queued.start()
    assert wait_until(lambda: queue_depth(gw) == 1, 10)
    gw.proc.send_signal(signal.SIGTERM)  # the drain's announced delay: both still served
    time.sleep(0.5)
    signalled = time.monotonic()
    gw.proc.send_signal(signal.SIGTERM)
    gw.proc.wait(5)
    assert time.monotonic() - signalled < 3.0, "the second signal did not exit at once"
    running.join(10)
    queued.join(10)
    lines = [e for e in gw.access_logs() if e.get("route") == "/v1/chat/completions"]
    assert len(lines) == 2, lines
    assert [e.get("reason") for e in lines] == ["shutdown", "shutdown"], lines
    (forced,) = [e for e in gw.logs() if e.get("event") == "gateway_forced_exit"]
    assert forced["open_requests"] == 2, forced  # the stream and the queued request


# ---------------------------------------------------------------------------- 100 Continue


def expect_exchange(gw: Gateway, key: str | None, length: int, body: bytes = b"") -> bytes:
    """Send headers with ``Expect: 100-continue``; upload ``body`` only if 100 Continue comes."""
    parsed = urlparse(gw.base_url)
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\nExpect: 100-continue\r\n"
    )
    if key is not None:
        head += f"Authorization: Bearer {key}\r\n"
    with socket.create_connection((parsed.hostname, parsed.port), timeout=10) as sock:
        sock.sendall(head.encode() + b"\r\n")
        first = sock.recv(65536)
        if first.startswith(b"HTTP/1.1 100 Continue\r\n\r\n") and body:
            sock.sendall(body)
            rest = b""
            while b"\r\n\r\n" not in rest or not rest.rstrip().endswith(b"}"):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                rest += chunk
            return first + rest
        return first


def test_expect_100_continue_only_for_requests_that_will_be_accepted(stack: Gateway) -> None:
    """Validation before 100 Continue: a bad or missing key or an oversized body is refused before the upload; a good one gets 100 then 200."""
    body = json.dumps(chat(max_tokens=2)).encode()
    for key in ("sk-q38-not-a-real-key-0000000000000", None):
        answer = expect_exchange(stack, key, len(body))
        assert answer.startswith(b"HTTP/1.1 401"), answer[:60]
        assert b"100 Continue" not in answer
    answer = expect_exchange(stack, KEY_A, 64 * 1024 * 1024)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:60]
    answer = expect_exchange(stack, KEY_A, len(body), body)
    assert answer.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200"), answer[:80]


def test_c21_shipped_stop_timeouts_outlast_the_grace() -> None:
    """C21: the unit's docker stop timeouts and TimeoutStopSec exceed the shipped shutdown_grace_s plus the 2 s the drain may take."""
    import re

    from gateway.config import load_settings

    deploy = REPO / "deploy"
    grace = load_settings(deploy / "etc" / "gateway.toml").server.shutdown_grace_s
    unit = (deploy / "systemd" / "qwen38-gateway.service").read_text()
    docker_run = [int(v) for v in re.findall(r"--stop-timeout (\d+)", unit)]
    docker_stop = [int(v) for v in re.findall(r"docker stop -t (\d+)", unit)]
    systemd = [int(v) for v in re.findall(r"^TimeoutStopSec=(\d+)", unit, re.M)]
    assert docker_run and docker_stop and systemd
    for seconds in docker_run + docker_stop:
        assert seconds > grace + 2
    assert systemd[0] > max(docker_stop) > grace + 2


def test_tls_on_the_metrics_listener(gateway_factory: Any, sim_factory: Any, workdir: Path) -> None:
    """TLS: the metrics listener takes the same settings; a scrape over HTTPS with the test CA works, plain HTTP does not."""
    ca = make_ca(workdir)
    cert, key = workdir / "m-cert.pem", workdir / "m-key.pem"
    ca.issue(cert, key, "metrics")
    gw = gateway_factory(
        sim_factory(), {"metrics": {"tls_cert_file": str(cert), "tls_key_file": str(key)}}
    )
    secure = gw.metrics_url.replace("http://", "https://")
    context = ssl.create_default_context(cafile=str(ca.bundle))
    r = httpx.get(secure, verify=context, timeout=10)
    assert r.status_code == 200 and "gateway_requests_total" in r.text
    with pytest.raises(httpx.HTTPError):
        httpx.get(gw.metrics_url, timeout=3)


def test_a_reload_applies_the_engine_read_timeout_and_names_the_connection_settings(
    gateway_factory: Any, sim_factory: Any
) -> None:
    """``engine.read_timeout_s`` changed by a reload applies to the next streamed request (it
    was kept from the start for streams while non-streamed requests took the new one); a change
    to the engine connections' settings is logged ``reload_needs_restart`` by key name."""
    sim = sim_factory()
    gw = gateway_factory(sim, {"engine": {"read_timeout_s": 1.0, "connect_timeout_s": 2.0}})
    body = {
        "model": ALIAS,
        "stream": True,
        "max_tokens": 3,
        "messages": [{"role": "user", "content": "hi"}],
        "sim": {"headers_delay_s": 2.0},
    }
    auth = {"Authorization": f"Bearer {KEY_A}"}
    r = httpx.post(gw.url("/v1/chat/completions"), json=body, headers=auth, timeout=30)
    assert r.status_code == 504, r.text[:300]
    text = gw.config_path.read_text()
    text = text.replace("read_timeout_s = 1.0", "read_timeout_s = 5.0")
    gw.config_path.write_text(text.replace("connect_timeout_s = 2.0", "connect_timeout_s = 3.0"))
    gw.proc.send_signal(signal.SIGHUP)
    assert wait_until(lambda: any(e.get("event") == "reload_ok" for e in gw.logs()), 10)
    r = httpx.post(gw.url("/v1/chat/completions"), json=body, headers=auth, timeout=30)
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text[:300]
    restart = [e["key"] for e in gw.logs() if e.get("event") == "reload_needs_restart"]
    assert restart == ["engine.connect_timeout_s"]


def test_c21_sigterm_as_soon_as_the_port_answers_drains_and_exits_0(
    gateway_factory: Any, sim_factory: Any
) -> None:
    """C21: a SIGTERM the moment the public port first accepts a connection (a supervisor that
    stops a gateway it has just started) drains and exits 0: the handlers are in place before
    the first listener opens, so the signal never falls on Python's default action."""
    gw = gateway_factory(sim_factory())
    gw.proc.send_signal(signal.SIGTERM)
    assert gw.proc.wait(15) == 0
    port = urlparse(gw.base_url).port
    assert port is not None
    for attempt in range(3):
        log_path = gw.log_path.with_name(f"early-sigterm-{attempt}.log")
        with open(log_path, "wb") as log_file:
            proc = subprocess.Popen(
                [sys.executable, "-m", "gateway", "serve", "--config", str(gw.config_path)],
                stdout=log_file,
                stderr=subprocess.STDOUT,
                cwd=REPO,
            )
        try:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                except OSError:
                    time.sleep(0.0005)
                    continue
                proc.send_signal(signal.SIGTERM)
                break
            code = proc.wait(15)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
        log = log_path.read_text()
        assert code == 0, log[-2000:]
        assert "gateway_stopped" in log
