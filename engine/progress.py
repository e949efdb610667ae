"""The progress watchdog: is the engine moving while it holds a request?

vLLM's ``GET /health`` only asks the API server whether the engine core has reported an error; an
engine core that is stuck (a deadlocked collective, a GPU kernel that never returns, a stopped
worker process) leaves it answering 200. The engine's own Prometheus counters do show it: while
``vllm:num_requests_running`` is above zero, ``vllm:generation_tokens_total`` rises with every
decoded token. `StallWatch` compares two readings of ``/metrics`` and calls the engine hung when
a request has been running for ``stall_after_s`` seconds with none of these counters moving:

- ``vllm:generation_tokens_total`` (decoded tokens),
- ``vllm:prompt_tokens_total`` (prompt tokens),
- ``vllm:request_success_total`` summed over ``finished_reason`` (a request ended, so the one now
  running may have just started its prefill).

Why the default ``stall_after_s`` is long (1800 s): the prompt counter does not move during a
prefill. vLLM's v1 metrics add a request's prompt tokens to ``vllm:prompt_tokens_total`` when its
first output token arrives, i.e. once the whole prefill is done, not per chunk of a chunked
prefill (vLLM ``vllm/v1/metrics/stats.py``: ``IterationStats.update_from_output`` counts prompt
tokens only ``if is_prefilling`` for an output carrying new tokens, and the scheduler emits an
output for a request only when it has new tokens, ``vllm/v1/core/sched/scheduler.py``). So for the
whole prefill of one long prompt no counter moves, and the threshold must exceed the longest
legitimate prefill. For a 250,000-token prompt on one V100 (arithmetic, public figures):

- Model (Qwen3.6-27B model card, Hugging Face): 27 B parameters; 64 layers, of which 16 are full
  (gated) attention with 24 query heads of dimension 256 and 48 are Gated DeltaNet (linear).
- Weight matmuls: 2 FLOP per parameter per token: 2 x 27e9 x 250,000 = 1.35e16 FLOP.
- Causal attention in the 16 full-attention layers: QK^T and AV each take 2 x (T^2 / 2) x
  (24 x 256) FLOP per layer: 2 x 250,000^2 x 6,144 x 16 = 1.23e16 FLOP. (The DeltaNet layers are
  linear in T and small next to these.) Total about 2.6e16 FLOP.
- V100-SXM2 (NVIDIA V100 datasheet): 125 TFLOPS FP16 tensor-core peak. Volta has no FP4/FP8
  tensor cores and no FlashAttention-2, so the NVFP4 weights are dequantised to FP16 and the
  attention kernel is a Volta port: assume 15-40 % of peak, i.e. 19-50 TFLOPS effective.
- Prefill time: 2.6e16 / 50e12 = 520 s to 2.6e16 / 19e12 = 1,370 s.

1800 s clears the slow end with a third to spare (it corresponds to 14 TFLOPS, 11 % of peak) and
equals ``start_timeout_s``. The cost is detection time: a hang is found 30 minutes after the last
counter moved (plus one probe) instead of never. Operators who have measured their engine should
lower it to about twice the largest ``vllm:request_prefill_time_seconds`` they see.

Only a successful ``/metrics`` read counts as evidence: failed reads neither reset the clock nor
declare a hang, so an engine whose metrics cannot be read is left to the ``/health`` watch.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

RUNNING = "vllm:num_requests_running"
GENERATION_TOKENS = "vllm:generation_tokens_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
FINISHED = "vllm:request_success_total"


@dataclass(frozen=True)
class Progress:
    """One reading of the engine's counters, each summed over its label sets (engines, reasons).

    Attributes:
        running: requests in the engine's running batch (gauge).
        generation_tokens: decoded tokens since the engine started (counter).
        prompt_tokens: prompt tokens of requests whose prefill completed (counter).
        finished: requests that ended, any finished_reason (counter).
    """

    running: float
    generation_tokens: float
    prompt_tokens: float
    finished: float

    @property
    def counters(self) -> tuple[float, float, float]:
        """The three counters whose movement is progress."""
        return (self.generation_tokens, self.prompt_tokens, self.finished)


def parse_progress(text: str) -> Progress | None:
    """`Progress` from a Prometheus text exposition, None without ``vllm:num_requests_running``.

    Counters absent from the text count as 0 (vLLM creates them at start; a missing one never
    moves). Raises nothing: unparsable text gives None.
    """
    sums = {RUNNING: 0.0, GENERATION_TOKENS: 0.0, PROMPT_TOKENS: 0.0, FINISHED: 0.0}
    seen_running = False
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in sums:
                    sums[sample.name] += float(sample.value)
                    seen_running = seen_running or sample.name == RUNNING
    except (ValueError, TypeError, IndexError):
        return None
    if not seen_running:
        return None
    return Progress(sums[RUNNING], sums[GENERATION_TOKENS], sums[PROMPT_TOKENS], sums[FINISHED])


@dataclass(frozen=True)
class Verdict:
    """What `StallWatch.observe` concluded.

    Attributes:
        stalled_s: seconds a request has been running with no counter moving (0 when idle or
            moving); measured between successful readings only.
        hung: ``stalled_s`` reached ``stall_after_s``.
        progress: the reading used, None when this probe could not read the counters.
    """

    stalled_s: float
    hung: bool
    progress: Progress | None


class StallWatch:
    """Tracks readings over time; feed it one `Progress` (or None) per probe.

    Args:
        stall_after_s: seconds with a request running and no counter moving that mean hung;
            0 disables the verdict (``stalled_s`` is still reported).
    """

    def __init__(self, stall_after_s: float) -> None:
        self._limit = stall_after_s
        self._reference: tuple[float, float, float] | None = None
        self._since = 0.0
        self._stalled_s = 0.0
        self._running = False

    def observe(self, now: float, progress: Progress | None) -> Verdict:
        """Take the reading made at ``now`` (seconds, monotonic); None for a failed read."""
        if progress is None:
            return Verdict(self._stalled_s, False, None)
        counters = progress.counters
        running = progress.running > 0
        # The clock starts at the first reading that shows a request running (it began some
        # time after the previous reading) and again at every reading whose counters moved.
        if not running or not self._running or counters != self._reference:
            self._reference = counters
            self._since = now
        self._running = running
        self._stalled_s = now - self._since if running else 0.0
        hung = self._limit > 0 and self._stalled_s >= self._limit
        return Verdict(self._stalled_s, hung, progress)

    def describe(self, verdict: Verdict) -> str:
        """One sentence for logs and status: running count, frozen counters, for how long."""
        progress = verdict.progress
        if progress is None:
            return "engine metrics unreadable"
        return (
            f"{progress.running:g} request(s) running and no progress for "
            f"{verdict.stalled_s:.1f} s (stall_after_s {self._limit:g}): "
            f"generation_tokens_total {progress.generation_tokens:g}, prompt_tokens_total "
            f"{progress.prompt_tokens:g}, request_success_total {progress.finished:g} unchanged"
        )
