"""Run a module (the simulator, the gateway) under another garbage-collector policy.

Usage: ``python -m tests.perf.gcpolicy POLICY MODULE [ARGS...]``, e.g.
``python -m tests.perf.gcpolicy off engine.sim --socket ...``. Policies:

- ``off``: `gc.disable`; for the simulator in the slow-streams rows, whose full collections with
  2,000 open streams pause every stream for about 120 ms and would hide the gateway's own stalls;
- ``tuned``: ``gc.set_threshold(20_000, 50, 100)``: young collections every 20,000 net
  allocations instead of 700 and full ones 50 x 100 times rarer, the policy the benchmark
  compares with CPython's default (700, 10, 10) for the gateway.
"""

from __future__ import annotations

import gc
import runpy
import sys

TUNED_THRESHOLDS = (20_000, 50, 100)


def main() -> int:
    """Apply the policy named by ``argv[1]``, then run ``argv[2]`` as ``__main__``."""
    if len(sys.argv) < 3 or sys.argv[1] not in ("off", "tuned"):
        print(__doc__, file=sys.stderr)
        return 2
    policy, module = sys.argv[1], sys.argv[2]
    if policy == "off":
        gc.disable()
    else:
        gc.set_threshold(*TUNED_THRESHOLDS)
    sys.argv = [module, *sys.argv[3:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
