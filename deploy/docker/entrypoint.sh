#!/usr/bin/env bash
# Container entry point: "engine" runs the launcher, "gateway" the gateway, anything else as given.
#
#   engine [ARGS]   exec qwen38-engine serve ARGS   (records the role for the HEALTHCHECK)
#   gateway [ARGS]  exec qwen38-gateway serve ARGS
#   CMD [ARGS]      exec CMD ARGS (e.g. qwen38-gateway keys list, qwen38-engine check)
set -euo pipefail

role_file=${QWEN38_ROLE_FILE:-/tmp/qwen38-role}

# The cache volume may be a fresh, empty host directory; create the per-tool subdirectories.
for dir in "${HOME:-}" "${XDG_CACHE_HOME:-}" "${TRITON_CACHE_DIR:-}" \
    "${TORCHINDUCTOR_CACHE_DIR:-}" "${HF_HOME:-}" "${VLLM_CACHE_ROOT:-}"; do
    if [[ -n $dir ]]; then
        mkdir -p -- "$dir" 2>/dev/null || true
    fi
done

# The HEALTHCHECK reads the role to know what to probe; a read-only /tmp only costs the probe.
record_role() {
    if ! printf '%s\n' "$1" 2>/dev/null >"$role_file"; then
        printf 'qwen38-entrypoint: cannot write %s; the HEALTHCHECK will not probe\n' "$role_file" >&2
    fi
}

if [[ $# -eq 0 ]]; then
    set -- gateway
fi

case $1 in
engine)
    shift
    record_role engine
    exec qwen38-engine serve "$@"
    ;;
gateway)
    shift
    record_role gateway
    exec qwen38-gateway serve "$@"
    ;;
*)
    exec "$@"
    ;;
esac
