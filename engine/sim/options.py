"""Simulator options: process settings, vLLM flags accepted, and the per-request behaviour.

`Behaviour` says how one request is answered (rate, length, text, faults). Each of its fields is
both a command-line flag (`--tokens-per-second`, `--split-writes`, ...: the process default) and
a key of the request body's `"sim"` object (`{"sim": {"split_writes": 3}}`: this request only).
`--request-control off` makes the simulator ignore that object, as vLLM ignores a field it does
not know.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

Framing = Literal["lf", "crlf", "cr"]
ReasoningField = Literal["reasoning", "reasoning_content", "both"]
Refusal = Literal["503", "close"]

# 1Cat-vLLM replaced upstream's `None` by this dict (commit e64d39aa7; vllm-protocol.md 1.3).
FORK_DEFAULT_CHAT_TEMPLATE_KWARGS: Mapping[str, Any] = MappingProxyType({"enable_thinking": False})
# DESIGN section 3 and DEPLOYMENT-NOTES: the context length served on the V100.
DEFAULT_MAX_MODEL_LEN = 254976
# DEPLOYMENT-NOTES: the FP8-E5M2 KV cache pool of the deployment, in tokens.
DEFAULT_KV_CACHE_TOKENS = 256484
# vLLM's default for VLLM_HTTP_TIMEOUT_KEEP_ALIVE (uvicorn idle keep-alive, seconds; section 1.4).
DEFAULT_KEEP_ALIVE_S = 5.0


MAX_SIM_NUMBER = 100_000_000
"""The largest count, rate or time a `Behaviour` field takes: a request's `sim` object comes
from any client of a gateway in front, and an answer of 10**400 tokens would only exhaust the
simulator's memory (NaN and infinities fail the same test)."""


def _opt(help_text: str, minimum: float | None = None) -> dict[str, Any]:
    return {"help": help_text, "min": minimum}


@dataclass(frozen=True)
class Behaviour:
    """How the simulator answers one request: pacing, generated text and injected faults.

    Token counts are in simulator tokens (see `engine.sim.tokens`); times in the unit of the
    field name. A fault that needs a count (`drop_after`, `error_after`) fires after that many
    generated tokens, or after the last token when the answer is shorter.
    """

    completion_tokens: int = field(
        default=64,
        metadata=_opt("natural answer length in tokens, end-of-sequence included", 1),
    )
    tokens_per_second: float = field(
        default=30.0,
        metadata=_opt("decode rate (DEPLOYMENT-NOTES: about 30/s on one V100); 0 = no pacing", 0),
    )
    prefill_ms: float = field(
        default=0.0, metadata=_opt("delay before the first output (the role chunk)", 0)
    )
    text: str | None = field(
        default=None, metadata=_opt("answer text to stream instead of the generated one")
    )
    reasoning_text: str | None = field(
        default=None, metadata=_opt("reasoning text to stream when thinking is on")
    )
    token_bytes: int = field(
        default=0, metadata=_opt("pad every text token with '~' to at least this many bytes", 0)
    )
    tool_calls: bool = field(
        default=False,
        metadata=_opt(
            "answer with two parallel tool calls (finish_reason tool_calls), tools or not"
        ),
    )
    tokens_per_event: int = field(
        default=1,
        metadata=_opt(
            "tokens merged into each SSE event, as vLLM's API server merges them when it lags "
            "(merging also happens by itself whenever the reader is behind)",
            1,
        ),
    )
    tool_call: str | None = field(
        default=None,
        metadata=_opt(
            "answer with one call 'NAME {JSON arguments}' unless the last message is a tool "
            "result (then the text answer): one tool round trip for real coding clients"
        ),
    )
    reasoning_field: ReasoningField = field(
        default="reasoning",
        metadata=_opt("name of the reasoning field: vLLM >= 0.16 sends `reasoning` only"),
    )
    framing: Framing = field(default="lf", metadata=_opt("SSE line ending: lf (vLLM), crlf or cr"))
    split_writes: int = field(
        default=1, metadata=_opt("cut every write into this many pieces of equal size", 1)
    )
    split_utf8: bool = field(
        default=False, metadata=_opt("cut every write inside each multi-byte UTF-8 character")
    )
    split_crlf: bool = field(
        default=False, metadata=_opt("cut every write between the \\r and \\n of a CRLF")
    )
    byte_writes: bool = field(default=False, metadata=_opt("write one byte at a time"))
    write_gap_ms: float = field(
        default=1.0, metadata=_opt("pause between the pieces of a cut write", 0)
    )
    coalesce: int = field(default=1, metadata=_opt("send this many events in one write", 1))
    keepalive: bool = field(
        default=False, metadata=_opt("send ': keepalive' comments before and between events")
    )
    junk_events: bool = field(
        default=False,
        metadata=_opt(
            "send data events that are not JSON objects (data:, data: null, data: hello, "
            "data: [1,2]) before every event, as some upstreams do"
        ),
    )
    drop_after: int | None = field(
        default=None, metadata=_opt("close the connection after this many tokens", 0)
    )
    error_after: int | None = field(
        default=None,
        metadata=_opt("after this many tokens send vLLM's in-stream error event (500)", 0),
    )
    no_done: bool = field(
        default=False, metadata=_opt("end the stream normally but without data: [DONE]")
    )
    drop_after_done: bool = field(
        default=False,
        metadata=_opt(
            "close the connection right after data: [DONE], without the body's end (the "
            "0-size chunk): an engine that died just after its answer"
        ),
    )
    hold_after_done_s: float = field(
        default=0.0,
        metadata=_opt(
            "after data: [DONE], keep the body open this long before its end (the 0-size "
            "chunk): an engine or proxy that is slow to end a finished answer",
            0,
        ),
    )
    stall_after: int | None = field(
        default=None,
        metadata=_opt(
            "after this many tokens stop generating but keep the request running and the "
            "connection open (/health stays 200) until the client leaves",
            0,
        ),
    )
    hang: bool = field(default=False, metadata=_opt("accept the request and never answer it"))
    headers_delay_s: float = field(
        default=0.0, metadata=_opt("delay before anything is sent, headers included", 0)
    )
    silence_s: float = field(
        default=0.0, metadata=_opt("silence after the headers, before the first output", 0)
    )
    refuse: Refusal | None = field(
        default=None,
        metadata=_opt("503: answer 503 at once; close: close the connection at once"),
    )
    exit_after: int | None = field(
        default=None,
        metadata=_opt(
            "exit the whole process (status 70, no cleanup: an engine crash) after this many "
            "tokens; 0: on arrival (after headers_delay_s), before any byte of the answer",
            0,
        ),
    )

    def with_request(self, raw: object) -> Behaviour:
        """Overlay the request body's `"sim"` object on this behaviour.

        Raises ValueError naming the key when `raw` is not an object, a key is unknown, or a
        value has the wrong type, is not one of the choices, or is below the minimum.
        """
        if raw is None:
            return self
        if not isinstance(raw, dict):
            raise ValueError("`sim` must be an object")
        changes: dict[str, Any] = {}
        for key, value in raw.items():
            spec = _SPECS.get(key)
            if spec is None:
                raise ValueError(f"unknown `sim` key {key!r}; known: {', '.join(sorted(_SPECS))}")
            changes[key] = spec.check(value)
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class _Spec:
    """Type information of one `Behaviour` field, for argparse and for request checking."""

    name: str
    kind: type
    choices: tuple[str, ...] | None
    optional: bool
    minimum: float | None
    help: str

    def parse(self, text: str) -> object:
        """Convert and check a command-line value (argparse `type`)."""
        try:
            return self.check(self.kind(text))
        except ValueError as exc:
            flag = "--" + self.name.replace("_", "-")
            raise argparse.ArgumentTypeError(str(exc).replace(f"sim.{self.name}", flag)) from None

    def check(self, value: object) -> object:
        if value is None and self.optional:
            return None
        ok = isinstance(value, self.kind) and not (
            self.kind is not bool and isinstance(value, bool)
        )
        if self.kind is float and isinstance(value, int) and not isinstance(value, bool):
            ok = abs(value) <= MAX_SIM_NUMBER
            value = float(value) if ok else value
        if not ok:
            shown = repr(value)
            shown = shown if len(shown) <= 40 else shown[:40] + "..."
            raise ValueError(f"`sim.{self.name}` must be {self.kind.__name__}, got {shown}")
        if self.kind in (int, float) and not abs(typing.cast(float, value)) <= MAX_SIM_NUMBER:
            raise ValueError(f"`sim.{self.name}` must be at most {MAX_SIM_NUMBER:g}")
        if self.choices is not None and value not in self.choices:
            raise ValueError(f"`sim.{self.name}` must be one of {', '.join(self.choices)}")
        if self.minimum is not None and typing.cast(float, value) < self.minimum:
            raise ValueError(f"`sim.{self.name}` must be >= {self.minimum:g}")
        return value


def _specs() -> dict[str, _Spec]:
    hints = typing.get_type_hints(Behaviour)
    specs: dict[str, _Spec] = {}
    for f in dataclasses.fields(Behaviour):
        hint = hints[f.name]
        optional = False
        if typing.get_origin(hint) in (typing.Union, types.UnionType):
            optional = True
            hint = next(a for a in typing.get_args(hint) if a is not type(None))
        choices: tuple[str, ...] | None = None
        if typing.get_origin(hint) is Literal:
            choices, hint = typing.get_args(hint), str
        specs[f.name] = _Spec(
            f.name, hint, choices, optional, f.metadata["min"], f.metadata["help"]
        )
    return specs


_SPECS = _specs()


@dataclass(frozen=True)
class SimOptions:
    """Process-wide settings of the simulator, built once from the command line.

    `served_model_names` holds at least one name; the first is echoed in responses and used as
    the `model_name` metrics label (vllm-protocol.md section 1.3). `api_keys` empty means no key
    is required. `default_chat_template_kwargs` is the fork's `{"enable_thinking": false}` unless
    `--default-chat-template-kwargs` replaced it (section 9.2). `request_control` False: the
    request body's `"sim"` object is ignored (no 400, no change of behaviour), as vLLM ignores
    a field it does not know; every request then gets the process-wide `behaviour`.
    """

    socket: str
    model: str = "qwen3.8-27b"
    served_model_names: tuple[str, ...] = ("qwen3.8-27b",)
    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    default_chat_template_kwargs: Mapping[str, Any] = field(
        default_factory=lambda: FORK_DEFAULT_CHAT_TEMPLATE_KWARGS
    )
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    trust_request_chat_template: bool = False
    enable_force_include_usage: bool = False
    enable_request_id_headers: bool = False
    max_num_seqs: int = 256
    kv_cache_tokens: int = DEFAULT_KV_CACHE_TOKENS
    load_s: float = 0.0
    keep_alive_s: float = DEFAULT_KEEP_ALIVE_S
    health_delay_busy_s: float = 0.0
    metrics_delay_s: float = 0.0
    record: str | None = None
    request_control: bool = True
    behaviour: Behaviour = Behaviour()

    @property
    def served_name(self) -> str:
        """The first served model name."""
        return self.served_model_names[0]

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> SimOptions:
        """Build the options from a namespace parsed by a parser given `add_arguments`.

        The API keys come from `--api-key`, else from env `VLLM_API_KEY` (vLLM's own fallback,
        section 1.3); prefer the environment, argv is visible to every local user.
        """
        env_key = os.environ.get("VLLM_API_KEY")
        keys = tuple(args.api_key) if args.api_key else ((env_key,) if env_key else ())
        names = tuple(args.served_model_name) if args.served_model_name else (args.model,)
        kwargs = args.default_chat_template_kwargs
        keep_alive = float(os.environ.get("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", DEFAULT_KEEP_ALIVE_S))
        return cls(
            socket=args.socket,
            model=args.model,
            served_model_names=names,
            max_model_len=args.max_model_len,
            api_keys=keys,
            default_chat_template_kwargs=(
                FORK_DEFAULT_CHAT_TEMPLATE_KWARGS if kwargs is None else MappingProxyType(kwargs)
            ),
            enable_auto_tool_choice=args.enable_auto_tool_choice,
            tool_call_parser=args.tool_call_parser,
            trust_request_chat_template=args.trust_request_chat_template,
            enable_force_include_usage=args.enable_force_include_usage,
            enable_request_id_headers=args.enable_request_id_headers,
            max_num_seqs=args.max_num_seqs,
            kv_cache_tokens=args.kv_cache_tokens,
            load_s=args.load_s,
            keep_alive_s=keep_alive,
            health_delay_busy_s=args.health_delay_busy_s,
            metrics_delay_s=args.metrics_delay_s,
            record=args.record,
            request_control=args.request_control == "on",
            behaviour=Behaviour(**{name: getattr(args, name) for name in _SPECS}),
        )


def _json_object(text: str) -> dict[str, Any]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


# vLLM flags a launcher may pass that change nothing in the simulator: (flag, argparse kwargs).
_IGNORED_VALUE_FLAGS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("--host", {}),
    ("--port", {"type": int}),
    ("--kv-cache-dtype", {}),
    ("--reasoning-parser", {}),
    ("--attention-backend", {}),
    ("--gpu-memory-utilization", {"type": float}),
    ("--limit-mm-per-prompt", {}),
    ("--generation-config", {}),
    ("--tensor-parallel-size", {"type": int}),
    ("--pipeline-parallel-size", {"type": int}),
    ("--dtype", {}),
    ("--quantization", {}),
    ("--tokenizer", {}),
    ("--download-dir", {}),
    ("--load-format", {}),
    ("--seed", {"type": int}),
    ("--max-num-batched-tokens", {"type": int}),
    ("--block-size", {"type": int}),
    ("--swap-space", {"type": float}),
    ("--speculative-config", {}),
    ("--chat-template", {}),
    ("--fingerprint-mode", {}),
    ("--uvicorn-log-level", {}),
    ("--allowed-local-media-path", {}),
    ("--allowed-media-domains", {"nargs": "+"}),
    ("--hf-overrides", {}),
    ("--compilation-config", {}),
)
_IGNORED_SWITCHES = (
    "--disable-fastapi-docs",
    "--language-model-only",
    "--enable-prompt-tokens-details",
    "--trust-remote-code",
    "--enforce-eager",
    "--disable-log-requests",
    "--disable-log-stats",
    "--enable-log-requests",
    "--disable-uvicorn-access-log",
    "--enable-server-load-tracking",
    "--enable-tokenizer-info-endpoint",
)
_IGNORED_BOOLEAN_OPTIONAL = ("--enable-prefix-caching", "--enable-chunked-prefill")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the simulator's options to `parser`: socket, vLLM flags, behaviour defaults, record.

    `--socket` (alias `--uds`, vLLM's name) is required. Every `Behaviour` field becomes a flag
    of the same name with dashes. vLLM flags that only matter on a GPU are accepted and ignored.
    """
    parser.add_argument(
        "--socket",
        "--uds",
        dest="socket",
        required=True,
        metavar="PATH",
        help="Unix socket to listen on (created at start, removed at exit; must not exist)",
    )
    parser.add_argument(
        "--record",
        metavar="FILE",
        help="append one JSON line per request received (method, path, headers, body, outcome)",
    )
    served = parser.add_argument_group("vLLM server flags honoured")
    served.add_argument("--model", default="qwen3.8-27b", help="reported as `root` in /v1/models")
    served.add_argument(
        "--served-model-name",
        nargs="+",
        metavar="NAME",
        help="accepted model names; the first is echoed (default: --model)",
    )
    served.add_argument("--max-model-len", type=int, default=DEFAULT_MAX_MODEL_LEN)
    served.add_argument(
        "--api-key",
        nargs="+",
        metavar="KEY",
        help="required Bearer key(s) on /v1, /v2, /inference; prefer env VLLM_API_KEY",
    )
    served.add_argument(
        "--default-chat-template-kwargs",
        type=_json_object,
        metavar="JSON",
        help='replaces the fork default {"enable_thinking": false}',
    )
    served.add_argument("--enable-auto-tool-choice", action="store_true")
    served.add_argument(
        "--tool-call-parser",
        help="with it, </think> yields no chunk and the \\n\\n after it joins the first content",
    )
    served.add_argument("--trust-request-chat-template", action="store_true")
    served.add_argument("--enable-force-include-usage", action="store_true")
    served.add_argument("--enable-request-id-headers", action="store_true")
    served.add_argument(
        "--max-num-seqs",
        type=int,
        default=256,
        help="requests generating at once; more wait (vllm:num_requests_waiting)",
    )
    sim = parser.add_argument_group("simulator")
    sim.add_argument(
        "--kv-cache-tokens",
        type=int,
        default=DEFAULT_KV_CACHE_TOKENS,
        help="KV cache pool size for vllm:kv_cache_usage_perc",
    )
    sim.add_argument(
        "--metrics-delay-s",
        type=float,
        default=0.0,
        help="seconds /metrics waits before answering, like a loaded engine host",
    )
    sim.add_argument(
        "--health-delay-busy-s",
        type=float,
        default=0.0,
        help="seconds /health and /ping wait before answering while a request is generating, "
        "like a loaded engine host",
    )
    sim.add_argument(
        "--load-s",
        type=float,
        default=0.0,
        help="seconds the socket is bound but refuses connections, like a model load",
    )
    sim.add_argument(
        "--request-control",
        choices=("on", "off"),
        default="on",
        help="on: a request body's \"sim\" object sets that request's behaviour; off: the "
        "object is ignored, as vLLM ignores a field it does not know (for a simulator any "
        "client can reach)",
    )
    for spec in _SPECS.values():
        flag = "--" + spec.name.replace("_", "-")
        default = getattr(Behaviour(), spec.name)
        if spec.kind is bool:
            sim.add_argument(flag, action="store_true", help=spec.help)
        else:
            sim.add_argument(
                flag, type=spec.parse, choices=spec.choices, default=default, help=spec.help
            )
    ignored = parser.add_argument_group("vLLM flags accepted and ignored")
    for flag, kwargs in _IGNORED_VALUE_FLAGS:
        ignored.add_argument(flag, **kwargs)
    for flag in _IGNORED_SWITCHES:
        ignored.add_argument(flag, action="store_true")
    for flag in _IGNORED_BOOLEAN_OPTIONAL:
        ignored.add_argument(flag, action=argparse.BooleanOptionalAction)
