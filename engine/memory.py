"""Will the configuration fit? GPU memory per card, from measured and published figures.

The reference deployment measured two points on one V100-SXM2-32GB, whose CUDA-visible memory is
31.74 GiB (32,768 MiB as nvidia-smi reports it, less what the driver reserves):

- the target (QUASAR-QAT Qwen3.8-27B NVFP4, about 23 GB of checkpoint with FP16 embeddings and
  lm_head) loaded with ``max_model_len`` 254,976 and ``gpu_memory_utilization`` 0.90 takes
  28.77 GiB, its FP8 KV pool holding 256,484 tokens;
- adding the DFlash2 draft model puts the card about 4 GiB over its 31.74 GiB, i.e. the draft
  needs about 31.74 + 4 - 28.77 = 6.97 GiB, of which its BF16 lm_head alone is 2.37 GiB
  (248,320-token vocabulary x 5,120 hidden x 2 bytes = 2.54e9 bytes, Qwen3.6-27B model card).

The KV cache part scales with the context: Qwen3.6-27B (model card) has 16 full-attention layers
with 4 KV heads of dimension 256, so one token takes 16 x 4 x 256 x 2 (K and V) = 32,768 elements,
32 KiB in FP8-E5M2 (``kv_cache_dtype``, 1 byte) or 64 KiB in FP16. The Gated DeltaNet layers keep
a fixed-size state per sequence instead, counted in the fixed part. So, per card, with ``tp``
tensor-parallel ranks (vLLM shards weights, vocabulary and KV heads across ranks):

    need = (fixed + kv(max_model_len) + draft) / tp + tp_overhead
    fixed = 28.77 - 256,484 x 32 KiB (7.83 GiB) = 20.94 GiB
    tp_overhead = 0.5 GiB per card when tp > 1 (an assumption: NCCL buffers and a second CUDA
                  context; vLLM does not publish a figure)

compared with the card's CUDA-visible memory (nvidia-smi's total scaled by 31.74 / 32). With the
reference settings: one card, target alone 28.72 GiB (fits, 3.0 GiB spare); one card with the
draft 35.69 GiB (3.95 GiB over, as measured); two cards with the draft 18.35 GiB each.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1 << 30
TARGET_MEASURED_GIB = 28.77
REFERENCE_KV_POOL_TOKENS = 256_484
CARD_LIMIT_GIB = 31.74
CARD_NOMINAL_MIB = 32_768
DRAFT_GIB = CARD_LIMIT_GIB + 4.0 - TARGET_MEASURED_GIB
DRAFT_LM_HEAD_GIB = 248_320 * 5_120 * 2 / GIB
KV_ELEMENTS_PER_TOKEN = 16 * 4 * 256 * 2
TP_OVERHEAD_GIB = 0.5
# Bytes per KV element for vLLM's --kv-cache-dtype values ("auto" is the model's FP16 on Volta).
KV_DTYPE_BYTES = {"fp8": 1, "fp8_e5m2": 1, "fp8_e4m3": 1, "auto": 2, "float16": 2, "bfloat16": 2}


def kv_gib(tokens: int, kv_cache_dtype: str) -> float:
    """GiB of KV cache for ``tokens`` tokens of one sequence (all ranks together)."""
    return tokens * KV_ELEMENTS_PER_TOKEN * KV_DTYPE_BYTES.get(kv_cache_dtype, 2) / GIB


FIXED_GIB = TARGET_MEASURED_GIB - kv_gib(REFERENCE_KV_POOL_TOKENS, "fp8_e5m2")


@dataclass(frozen=True)
class Fit:
    """The per-card estimate for one configuration; GiB throughout.

    Attributes:
        tp: tensor-parallel ranks (cards).
        fixed: the target's weights, activations and recurrent state (all ranks).
        kv: the KV cache for one full ``max_model_len`` context (all ranks).
        draft: the draft model's addition, 0 without speculative decoding (all ranks).
        overhead: per-card tensor-parallel overhead.
        limit: the smallest card's CUDA-visible memory.
    """

    tp: int
    fixed: float
    kv: float
    draft: float
    overhead: float
    limit: float

    @property
    def need(self) -> float:
        """Per-card need."""
        return (self.fixed + self.kv + self.draft) / self.tp + self.overhead

    @property
    def fits(self) -> bool:
        """The need is within the card."""
        return self.need <= self.limit

    def arithmetic(self) -> str:
        """The computation as one line, e.g. ``(20.94 + 7.78 + 6.97) / 2 + 0.50 = 18.35 GiB``."""
        parts = f"{self.fixed:.2f} target + {self.kv:.2f} KV"
        if self.draft:
            parts += f" + {self.draft:.2f} draft"
        text = f"({parts}) / {self.tp}" if self.tp > 1 else parts
        if self.overhead:
            text += f" + {self.overhead:.2f} TP overhead"
        verdict = "spare" if self.fits else "over"
        margin = abs(self.limit - self.need)
        return (
            f"{text} = {self.need:.2f} GiB per card of {self.limit:.2f} GiB "
            f"({margin:.2f} GiB {verdict})"
        )


def estimate(
    *, tp: int, max_model_len: int, kv_cache_dtype: str, draft: bool, card_total_mib: int
) -> Fit:
    """The per-card `Fit` for ``tp`` cards of ``card_total_mib`` MiB (nvidia-smi's total)."""
    return Fit(
        tp=tp,
        fixed=FIXED_GIB,
        kv=kv_gib(max_model_len, kv_cache_dtype),
        draft=DRAFT_GIB if draft else 0.0,
        overhead=TP_OVERHEAD_GIB if tp > 1 else 0.0,
        limit=card_total_mib * CARD_LIMIT_GIB / CARD_NOMINAL_MIB,
    )
