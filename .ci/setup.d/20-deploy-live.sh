# shellcheck shell=bash
# Live deployment tests (tests/test_deploy_live_*.py, tests/README.md "Live deployment tests"):
# Docker 26 from Debian trixie's packages, the Debian 12 and Ubuntu 24.04 root filesystems and the
# image, built by `python -m tests.deploy_prepare` in the background while pytest starts, and
# cached in .ci-cache/deploy (gitignored; kept when the machine is reused). The tests' fixtures
# wait for it on the cache's locks, then find everything built (about 5 minutes on a fresh
# machine, seconds with the cache). A failed step is repeated by the fixtures, whose error names
# what is missing and how to install it; where the host cannot run them the tests skip (one line).
# They are opt-in (QWEN38_DEPLOY_LIVE=1, tests/README.md): without it nothing is prepared.
if [ "${QWEN38_DEPLOY_LIVE:-0}" != 0 ] && [ -n "${QWEN38_DEPLOY_LIVE:-}" ]; then
  mkdir -p .ci-cache
  python3 -m tests.deploy_prepare >.ci-cache/deploy-prepare.log 2>&1 &
  DEPLOY_PREPARE_PID=$!
  # Ended (its dockerd stopped) if .ci/run exits first.
  # shellcheck disable=SC2064 # the pid is known now
  trap "kill $DEPLOY_PREPARE_PID 2>/dev/null || true" EXIT
  echo "live deployment tests: preparing in the background (.ci-cache/deploy-prepare.log)"
else
  echo "live deployment tests: not run (opt-in: QWEN38_DEPLOY_LIVE=1)"
fi
