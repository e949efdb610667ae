"""Engine simulator: 1Cat-vLLM's OpenAI wire protocol on a Unix socket, with injectable faults.

It answers like the engine (vllm-protocol.md, and real vLLM observed on a CPU build): the same
routes, JSON bodies, SSE chunks (several tokens in one event when the reader lags), headers,
`reasoning` deltas only when thinking is on (off by default, like the fork), tool calls when the
request has tools, usage chunk only on request, vLLM's 400s for wrong field types and ranges,
`vllm:*` metrics counted per token, `n` choices as engine sequences, abort on disconnect. Where
1Cat-vLLM and newer upstream vLLM differ (thinking default, request id length, validation error
`param`, `finish_reason="abort"` counted, no `ec_transfer_params`), it keeps the fork's
behaviour. Text and token counts are deterministic (rule in `engine.sim.tokens`); pacing,
length, text and faults are set per process by flags and per request by a `"sim"` object in the
body (fields of `engine.sim.options.Behaviour`; ignored under `--request-control off`). The
manual is engine/sim/README.md.

Public interface: `add_arguments(parser)`, `run(args)`, `main(argv)`, `build_app(options)`,
`SimOptions`, `Behaviour`.
"""

from engine.sim.app import build_app
from engine.sim.options import Behaviour, SimOptions, add_arguments
from engine.sim.server import main, run

__all__ = ["Behaviour", "SimOptions", "add_arguments", "build_app", "main", "run"]
