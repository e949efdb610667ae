"""``python -m tests.deploy_prepare``: build what the live deployment tests need, ahead of them.

Docker 26, the Ubuntu 24.04 and Debian 12 root filesystems (side by side), ``ubuntu:24.04``
imported into the private dockerd and the image built with the stand-ins, so the tests find
everything cached (tests/deploylive.py, tests/dockerhost.py). ``.ci/steps/deploy-live.sh`` runs
it before the tests (CI's background step); a second run finds the cache and takes seconds.

Exit status: 0 when built, or when this host cannot run the tests at all or they are switched
off (``QWEN38_DEPLOY_LIVE=0``; it says why in one line, the tests skip with the same line); 1 when a step failed, with what is missing and how to
install it.
"""

from __future__ import annotations

import concurrent.futures
import signal
import sys
import tempfile
import time
from pathlib import Path

from tests.deploylive import (
    Missing,
    bookworm_rootfs,
    docker_root,
    host_problem,
    noble_rootfs,
    say,
    switched_off,
)
from tests.dockerhost import (
    build_image,
    import_ubuntu,
    private_dockerd,
    standin_build_args,
    standin_server,
)


def prepare() -> None:
    """Build every cached artefact and the image; raises Missing or RuntimeError on a failure."""
    started = time.monotonic()
    docker_root()
    # The Debian root filesystem beside the Ubuntu one and the image build (mostly downloads).
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        bookworm = pool.submit(bookworm_rootfs)
        noble_rootfs()
        with private_dockerd() as daemon:
            import_ubuntu(daemon)
            with (
                tempfile.TemporaryDirectory(prefix="q38-standins-") as tmp,
                standin_server(Path(tmp)) as url,
            ):
                built = time.monotonic()
                result = build_image(daemon, standin_build_args(Path(tmp), url))
                if result.returncode != 0:
                    raise RuntimeError(f"docker build failed:\n{result.stderr[-4000:]}")
                say(f"image built in {time.monotonic() - built:.0f} s")
        bookworm.result()
    say(f"prepared in {time.monotonic() - started:.0f} s")


def _stop(signum: int, frame: object) -> None:
    raise SystemExit(f"stopped by signal {signum}")


def main() -> int:
    """Run `prepare`; the exit status described above. SIGTERM unwinds it (dockerd stopped)."""
    signal.signal(signal.SIGTERM, _stop)
    problem = switched_off() or host_problem()
    if problem:
        say(f"skipped, the live deployment tests will skip too: {problem}")
        return 0
    try:
        prepare()
    except (Missing, RuntimeError, OSError) as exc:
        say(f"ERROR: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
