# shellcheck shell=bash
# Live deployment tests (tests/test_deploy_live_*.py, tests/README.md "Live deployment tests"):
# systemd 252 booted under systemd-nspawn and the image built by a real Docker 26 daemon. They
# run as a background step of their own (.ci/steps/deploy-live.sh), in a session of its own,
# beside the main pytest run and not in its workers: preparation (Docker 26, the Debian 12 and
# Ubuntu 24.04 roots, the image; cached in .ci-cache/deploy, gitignored) starts now, the tests
# follow it. .ci/run waits for the step at the end, prints its summary and fails if it fails.
# Where the host cannot run them (not root, no cgroups, no systemd-nspawn) they skip with one
# line. QWEN38_DEPLOY_LIVE=0 switches them off (an operator's explicit choice; printed).
MAIN_PYTEST_IGNORE+=(tests/test_deploy_live_image.py tests/test_deploy_live_systemd.py)
if [ "${QWEN38_DEPLOY_LIVE:-1}" = 0 ]; then
  echo "live deployment tests: NOT RUN (QWEN38_DEPLOY_LIVE=0)"
else
  # 40 minutes at most: about 13 with the cache, 20 on a fresh machine (tests/README.md).
  background_step deploy-live 2400 .ci/steps/deploy-live.sh
fi
