"""GPUs: how engine.toml names them (index, UUID, PCI bus id) and what nvidia-smi says of them."""

from __future__ import annotations

import csv
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from engine.probes import PreflightError, Probes, dotted, first_line

GPU_QUERY: tuple[str, ...] = (
    "nvidia-smi",
    "--query-gpu=index,uuid,pci.bus_id,name,compute_cap,memory.total,memory.free,driver_version",
    "--format=csv,noheader,nounits",
)
SMI_HEADER: tuple[str, ...] = ("nvidia-smi",)

REQUIRED_COMPUTE_CAP = "7.0"  # the wheel's kernels are SM70 (V100) only
# NVIDIA CUDA Compatibility guide, "Minor Version Compatibility": CUDA 12.x user space runs on
# Linux drivers >= 525.60.13.
MIN_DRIVER = (525, 60, 13)
CUDA_TOOLKIT = (12, 8)  # the wheel is built with CUDA 12.8 (vllm-protocol.md section 1.1)

GpuKind = Literal["index", "uuid", "pci"]
_GPU_INDEX_RE = re.compile(r"^[0-9]{1,3}$")
_GPU_UUID_RE = re.compile(r"^GPU-[0-9a-fA-F]{8}(?:-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}$")
# nvidia-smi prints 00000000:00:1E.0 (8-digit domain); lspci prints 0000:00:1e.0 or 00:1e.0.
_GPU_PCI_RE = re.compile(
    r"^(?:(?P<domain>[0-9a-fA-F]{4,8}):)?(?P<bus>[0-9a-fA-F]{2}):(?P<dev>[0-9a-fA-F]{2})\.(?P<fn>[0-7])$"
)


def gpu_kind(selector: str) -> GpuKind:
    """Classify a GPU selector as ``index``, ``uuid`` or ``pci``.

    Raises:
        ValueError: it is none of them.
    """
    if _GPU_INDEX_RE.match(selector):
        return "index"
    if _GPU_UUID_RE.match(selector):
        return "uuid"
    if _GPU_PCI_RE.match(selector):
        return "pci"
    raise ValueError(selector)


def normalize_bus_id(bus_id: str) -> tuple[int, int, int, int] | None:
    """(domain, bus, device, function) of a PCI bus id in nvidia-smi or lspci form, else None."""
    match = _GPU_PCI_RE.match(bus_id.strip())
    if match is None:
        return None
    return (
        int(match["domain"] or "0", 16),
        int(match["bus"], 16),
        int(match["dev"], 16),
        int(match["fn"]),
    )


@dataclass(frozen=True)
class GpuInfo:
    """One row of `GPU_QUERY`; memory in MiB, ``bus_id`` as nvidia-smi prints it."""

    index: int
    uuid: str
    bus_id: str
    name: str
    compute_cap: str
    memory_total_mib: int
    memory_free_mib: int
    driver_version: str

    def describe(self) -> str:
        """``0 Tesla V100-SXM2-32GB (GPU-..., 00000000:00:1E.0)``."""
        return f"{self.index} {self.name} ({self.uuid}, {self.bus_id})"


def parse_gpu_query(text: str) -> list[GpuInfo]:
    """Parse the output of `GPU_QUERY` (CSV, no header, no units).

    Raises:
        ValueError: a row does not have the eight fields or a number does not parse (``[N/A]``).
    """
    gpus = []
    for row in csv.reader(text.splitlines(), skipinitialspace=True):
        if not row:
            continue
        if len(row) != 8:
            raise ValueError(f"unexpected nvidia-smi row: {', '.join(row)}")
        index, uuid, bus_id, name, cap, total, free, driver = (item.strip() for item in row)
        gpus.append(
            GpuInfo(
                index=int(index),
                uuid=uuid,
                bus_id=bus_id,
                name=name,
                compute_cap=cap,
                memory_total_mib=int(total),
                memory_free_mib=int(free),
                driver_version=driver,
            )
        )
    return gpus


def find_gpu(gpus: Sequence[GpuInfo], selector: str) -> GpuInfo | None:
    """The GPU ``selector`` (index, UUID or PCI bus id, as in ``engine.gpu``) names, if visible.

    Indices are nvidia-smi's, which follow PCI bus order like CUDA's with
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID``.
    """
    kind = gpu_kind(selector)
    for gpu in gpus:
        if kind == "index" and gpu.index == int(selector):
            return gpu
        if kind == "uuid" and gpu.uuid.lower() == selector.lower():
            return gpu
        if kind == "pci" and normalize_bus_id(gpu.bus_id) == normalize_bus_id(selector):
            return gpu
    return None


_NO_SMI_FIX = (
    "install the NVIDIA driver on the host and start the container with the NVIDIA Container "
    "Toolkit (docker run --gpus ...)"
)


def query_gpus(probes: Probes) -> list[GpuInfo]:
    """The GPUs nvidia-smi lists.

    Raises:
        PreflightError: nvidia-smi is missing, fails, or prints something unparsable.
    """
    output = probes.run(GPU_QUERY, timeout_s=30.0)
    if output is None:
        raise PreflightError("nvidia-smi not found: no NVIDIA driver is visible here", _NO_SMI_FIX)
    if output.returncode != 0:
        message = first_line(output.stdout) or first_line(output.stderr) or "no output"
        raise PreflightError(
            f"nvidia-smi failed (exit {output.returncode}): {message}",
            "make nvidia-smi work on the host (driver loaded, GPU listed), then restart the "
            "container",
        )
    try:
        gpus = parse_gpu_query(output.stdout)
    except ValueError as exc:
        raise PreflightError(
            f"cannot read nvidia-smi's GPU list: {exc}",
            f"upgrade the NVIDIA driver to {dotted(MIN_DRIVER)} or newer",
        ) from exc
    if not gpus:
        raise PreflightError("nvidia-smi lists no GPU", _NO_SMI_FIX)
    return gpus


def resolve_devices(selectors: Sequence[str], probes: Probes) -> tuple[str, ...]:
    """``CUDA_VISIBLE_DEVICES`` entries for ``selectors``: indices and UUIDs as they are, PCI
    bus ids replaced by the GPU's UUID (CUDA does not accept bus ids there); nvidia-smi is asked
    only when a bus id is present.

    Raises:
        PreflightError: nvidia-smi fails, or no GPU has a listed bus id.
    """
    if all(gpu_kind(selector) != "pci" for selector in selectors):
        return tuple(selectors)
    gpus = query_gpus(probes)
    devices = []
    for selector in selectors:
        if gpu_kind(selector) != "pci":
            devices.append(selector)
            continue
        gpu = find_gpu(gpus, selector)
        if gpu is None:
            raise PreflightError(
                f"no GPU has PCI bus id {selector}", "list bus ids that nvidia-smi shows"
            )
        devices.append(gpu.uuid)
    return tuple(devices)
