"""Where the gateway's CPU goes under load: py-spy samples summarised by function and by module.

``py-spy record --format raw`` writes collapsed stacks, one line per distinct stack:
``frame;frame;...;frame COUNT`` with frames ``function (file:line)``. The summary charges each
sample to its innermost frame (self time) and to every file on its stack (inclusive time).
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_FRAME_RE = re.compile(r"^(?P<func>.*) \((?P<file>[^():]+)(?::\d+)?\)$")


def find_py_spy() -> str | None:
    """The py-spy binary on PATH (``pip install py-spy``), or None."""
    return shutil.which("py-spy")


@contextmanager
def recording(binary: str, pid: int, out: Path, rate: int = 250) -> Iterator[None]:
    """Sample ``pid`` with py-spy while the block runs; collapsed stacks go to ``out``.

    ``--nonblocking`` reads the target's memory without pausing it, so the load is not slowed
    by the sampler beyond the sampler's own CPU (one core at most, a few percent at 250 Hz).

    Raises:
        RuntimeError: py-spy exited early (not permitted to trace: needs root or ptrace rights).
    """
    proc = subprocess.Popen(
        [binary, "record", "--pid", str(pid), "--format", "raw", "--rate", str(rate),
         "--nonblocking", "--output", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        yield
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
    if not out.exists():
        raise RuntimeError(f"py-spy wrote nothing: {err.decode(errors='replace')[-1000:]}")


def _frames(stack: str) -> list[tuple[str, str]]:
    out = []
    for frame in stack.split(";"):
        match = _FRAME_RE.match(frame.strip())
        if match:
            out.append((match["func"], match["file"]))
        else:
            out.append((frame.strip(), "?"))
    return out


def _short(path: str) -> str:
    for marker in ("site-packages/", "/lib/python3", "/work/main/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


def summarise(raw: str, top: int = 25) -> str:
    """Text report of collapsed stacks: top functions by self time and files by inclusive time.

    Percentages are of all samples (idle samples included when py-spy recorded them: it skips
    idle threads by default, so samples are time on CPU).
    """
    self_time: Counter[str] = Counter()
    by_file: Counter[str] = Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        total += count
        frames = _frames(stack)
        func, file = frames[-1]
        self_time[f"{func} ({_short(file)})"] += count
        for name in {_short(f) for _, f in frames}:
            by_file[name] += count
    if not total:
        return "no samples"
    lines = [f"{total} samples", "", "self time, by function:"]
    lines += [f"  {100 * n / total:5.1f}%  {name}" for name, n in self_time.most_common(top)]
    lines += ["", "inclusive time, by file:"]
    lines += [f"  {100 * n / total:5.1f}%  {name}" for name, n in by_file.most_common(top)]
    return "\n".join(lines)
