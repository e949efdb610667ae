"""Engine simulator: 1Cat-vLLM's OpenAI wire protocol on a Unix socket, with injectable faults.

It answers like the engine (vllm-protocol.md): the same routes, JSON bodies, SSE chunks,
`reasoning` deltas only when thinking is on (off by default, like the fork), usage chunk only on
request, errors, `vllm:*` metrics, abort on disconnect. Text and token counts are deterministic
(rule in `engine.sim.tokens`); pacing, length, text and faults are set per process by flags and
per request by a `"sim"` object in the body (fields of `engine.sim.options.Behaviour`).

Public interface: `add_arguments(parser)`, `run(args)`, `main(argv)`, `build_app(options)`,
`SimOptions`, `Behaviour`.
"""

from engine.sim.app import build_app
from engine.sim.options import Behaviour, SimOptions, add_arguments
from engine.sim.server import main, run

__all__ = ["Behaviour", "SimOptions", "add_arguments", "build_app", "main", "run"]
