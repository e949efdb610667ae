"""Checkpoint directories on disk: the target model's and the speculative draft's."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from engine.probes import CheckResult


def safetensors_problem(path: Path) -> str | None:
    """Why ``path`` is not a complete safetensors file, or None.

    Format (huggingface/safetensors): 8-byte little-endian header length, JSON header whose
    tensors carry ``data_offsets`` relative to the end of the header.
    """
    try:
        size = path.stat().st_size
        with path.open("rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                return "truncated (no header)"
            (length,) = struct.unpack("<Q", prefix)
            if length > size - 8 or length > 100_000_000:
                return "truncated header"
            header = json.loads(handle.read(length))
    except FileNotFoundError:
        return "missing"
    except (OSError, ValueError) as exc:
        return f"unreadable ({exc})"
    if not isinstance(header, dict):
        return "not a safetensors file"
    ends = [
        item["data_offsets"][1]
        for key, item in header.items()
        if key != "__metadata__" and isinstance(item, dict) and "data_offsets" in item
    ]
    needed = 8 + length + max(ends, default=0)
    if size < needed:
        return f"truncated ({size} of {needed} bytes)"
    return None


def checkpoint_check(model_path: str) -> CheckResult:
    """``checkpoint``: config, tokenizer and complete safetensors shards in ``model_path``."""
    root = Path(model_path)
    fix = (
        "download the complete checkpoint (QUASAR-QAT/Qwen3.8-27B-QUASAR-NVFP4) into "
        "engine.model_path again"
    )
    if not root.is_dir():
        return CheckResult("FAIL", "checkpoint", f"{root} is not a directory", fix)
    problems: list[str] = []
    if not (root / "config.json").is_file():
        problems.append("config.json missing")
    has_fast = (root / "tokenizer.json").is_file()
    has_bpe = (root / "vocab.json").is_file() and (root / "merges.txt").is_file()
    if not (root / "tokenizer_config.json").is_file():
        problems.append("tokenizer_config.json missing")
    if not (has_fast or has_bpe):
        problems.append("tokenizer.json (or vocab.json + merges.txt) missing")
    index_path = root / "model.safetensors.index.json"
    shards: list[str]
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            problems.append(f"model.safetensors.index.json unreadable ({exc})")
            shards = []
    elif (root / "model.safetensors").is_file():
        shards = ["model.safetensors"]
    else:
        problems.append("no model.safetensors.index.json and no model.safetensors")
        shards = []
    total = 0
    for shard in shards:
        problem = safetensors_problem(root / shard)
        if problem is not None:
            problems.append(f"{shard} {problem}")
        else:
            total += (root / shard).stat().st_size
    if problems:
        shown = "; ".join(problems[:5]) + (
            f"; {len(problems) - 5} more" if len(problems) > 5 else ""
        )
        return CheckResult("FAIL", "checkpoint", f"{root} incomplete: {shown}", fix)
    return CheckResult(
        "PASS",
        "checkpoint",
        f"{root}: config, tokenizer, {len(shards)} safetensors shard(s), {total / 2**30:.1f} GiB",
    )


def draft_check(model_path: str) -> CheckResult:
    """``draft``: the speculative-decoding draft model's directory holds a config and complete
    safetensors shards (a draft shares the target's tokenizer, so none is required)."""
    root = Path(model_path)
    fix = (
        "download the complete draft model (e.g. the DFlash2 draft) into [engine.speculative] model"
    )
    if not root.is_dir():
        return CheckResult("FAIL", "draft", f"{root} is not a directory", fix)
    shards = sorted(p.name for p in root.glob("*.safetensors"))
    problems = [] if (root / "config.json").is_file() else ["config.json missing"]
    if not shards:
        problems.append("no .safetensors file")
    problems += [f"{name} {p}" for name in shards if (p := safetensors_problem(root / name))]
    if problems:
        return CheckResult("FAIL", "draft", f"{root} incomplete: {'; '.join(problems[:5])}", fix)
    size = sum((root / name).stat().st_size for name in shards)
    return CheckResult(
        "PASS",
        "draft",
        f"{root}: config, {len(shards)} safetensors shard(s), {size / 2**30:.1f} GiB",
    )
