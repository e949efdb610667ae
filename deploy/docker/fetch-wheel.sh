#!/usr/bin/env bash
# Fetch one wheel (URL or file in the build context) into a directory and verify its sha256.
#
# Usage: fetch-wheel.sh SOURCE SHA256 CONTEXT_DIR OUT_DIR
#   SOURCE       https:// URL, or a path relative to CONTEXT_DIR (the build context)
#   SHA256       64 hex digits, as published next to the release
#   CONTEXT_DIR  where the build context is mounted
#   OUT_DIR      where the wheel is written, under its own file name (pip needs it)
# Exits non-zero, leaving nothing in OUT_DIR, when the source is missing or the digest differs.
set -euo pipefail

die() {
    printf 'fetch-wheel: %s\n' "$*" >&2
    exit 1
}

[[ $# -eq 4 ]] || die "usage: fetch-wheel.sh SOURCE SHA256 CONTEXT_DIR OUT_DIR"
source_ref=$1
expected=${2,,}
context_dir=$3
out_dir=$4

[[ -n $source_ref ]] || die "no wheel given: pass --build-arg VLLM_WHEEL=... and --build-arg FLASH_ATTN_WHEEL=..."
[[ $expected =~ ^[0-9a-f]{64}$ ]] ||
    die "sha256 for ${source_ref} must be 64 hex digits (pass --build-arg ..._SHA256=...)"

name=${source_ref%%\?*}
name=${name##*/}
[[ $name == *.whl ]] || die "${source_ref}: not a .whl file name"

mkdir -p -- "$out_dir"
target=$out_dir/$name
case $source_ref in
https://* | http://*)
    curl --fail --silent --show-error --location --retry 3 --output "$target" -- "$source_ref" ||
        die "download failed: ${source_ref}"
    ;;
*)
    [[ -f $context_dir/$source_ref ]] ||
        die "${source_ref}: no such file in the build context (put wheels in deploy/docker/wheels/)"
    cp -- "$context_dir/$source_ref" "$target"
    ;;
esac

actual=$(sha256sum -- "$target")
actual=${actual%% *}
if [[ $actual != "$expected" ]]; then
    rm -f -- "$target"
    die "sha256 mismatch for ${name}: expected ${expected}, got ${actual}"
fi
printf 'fetch-wheel: %s sha256 %s OK\n' "$name" "$actual"
