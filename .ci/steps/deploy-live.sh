#!/usr/bin/env bash
# The live deployment suites (tests/test_deploy_live_*.py, tests/README.md "Live deployment
# tests") as a CI step of their own: .ci/setup.d/20-deploy-live.sh starts this script in the
# background, in a session of its own (setsid), as soon as the Python environment exists; it
# runs beside the main pytest run, never inside its workers, and .ci/run waits for it at the end,
# prints its summary after the main one and fails the run when it fails.
#
# 1. `python -m tests.deploy_prepare`: Docker 26, the Ubuntu 24.04 and Debian 12 roots and the
#    image, cached in .ci-cache/deploy (minutes on a fresh machine, seconds with the cache);
# 2. pytest on the two live files, serially, its report in .ci-report/junit-deploy-live.xml.
# A failed preparation is not fatal here: the tests' fixtures repeat the failed step and fail
# with what is missing and how to install it. Where the host cannot run them (not root, no
# cgroups, no systemd-nspawn) both print one line and the tests skip.
# Exit status: pytest's.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
REPORT_DIR="$PWD/.ci-report"
mkdir -p .ci-cache "$REPORT_DIR"
started=$(date +%s)
echo "== live deployment: prepare (tests.deploy_prepare)"
python3 -m tests.deploy_prepare
prepared=$(date +%s)
echo "== live deployment: tests"
python3 -m pytest -q -p no:cacheprovider --durations=5 \
  --junitxml="$REPORT_DIR/junit-deploy-live.xml" \
  tests/test_deploy_live_image.py tests/test_deploy_live_systemd.py
status=$?
# 5 is pytest's "no tests collected": both files skipped whole (switched off, or the host cannot
# run them), each with its one line above; not a failure.
if [ "$status" = 5 ]; then status=0; fi
finished=$(date +%s)
{
  printf '%-28s %5d s\n' "live deployment prepare" "$((prepared - started))"
  printf '%-28s %5d s\n' "live deployment tests" "$((finished - prepared))"
} >"$REPORT_DIR/deploy-live-steps.txt"
exit "$status"
