#!/usr/bin/env bash
# Install the qwen38 systemd units, configuration, host wrappers and directories; safe to re-run.
#
# Usage:
#   sudo deploy/install.sh                     install on this host and start both services
#   DESTDIR=/tmp/root deploy/install.sh        only lay the files under DESTDIR (no useradd,
#                                              docker or systemctl); for packaging and tests
#
# Files that are ours (units, tmpfiles.d snippet, wrappers, *.example, Prometheus and Grafana
# files) are replaced on every run. Files that are the operator's (gateway.toml, engine.toml,
# units.env, api-keys.env) are created once and never overwritten. The first API key (tenant
# "default") is generated when api-keys.env is created: its secret is printed once, alone on the
# last line of standard output; everything else goes to standard error.
#
# Environment, used only when units.env is created:
#   QWEN38_IMAGE      image tag (default qwen38:latest); must exist (docker build) for a live install
#   QWEN38_GPU        GPU UUID (default: the first GPU nvidia-smi lists; live install only)
#   QWEN38_MODEL_DIR  host directory holding the checkpoint directory (default /srv/models)
set -euo pipefail

here=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)
destdir=${DESTDIR:-}
destdir=${destdir%/}
user=qwen38
default_id=10038
keys_tenant=default

say() {
    printf 'install: %s\n' "$*" >&2
}

die() {
    say "error: $*"
    exit 1
}

live() {
    [[ -z $destdir ]]
}

# --- where things go -------------------------------------------------------------------------
etc_dir=$destdir/etc/qwen38
unit_dir=$destdir/etc/systemd/system
tmpfiles_dir=$destdir/etc/tmpfiles.d
sbin_dir=$destdir/usr/local/sbin
share_dir=$destdir/usr/local/share/qwen38
doc_dir=$destdir/usr/local/share/doc/qwen38
run_dir=$destdir/run/qwen38
cache_dir=$destdir/var/cache/qwen38
state_dir=$destdir/var/lib/qwen38
keys_file=$etc_dir/api-keys.env
units_env=$etc_dir/units.env

# --- prerequisites (live only) ---------------------------------------------------------------
if live; then
    [[ $EUID -eq 0 ]] || die "run as root, or set DESTDIR to only lay the files"
    for tool in docker systemctl systemd-tmpfiles useradd groupadd; do
        command -v "$tool" >/dev/null || die "${tool} not found"
    done
fi

setting_from_units_env() {
    # $1: name; prints its value from an existing units.env, or nothing.
    [[ -f $units_env ]] || return 0
    sed -n "s/^$1=//p" "$units_env" | tail -n 1
}

image=$(setting_from_units_env QWEN38_IMAGE)
image=${image:-${QWEN38_IMAGE:-qwen38:latest}}
[[ $image =~ ^[A-Za-z0-9][A-Za-z0-9._/:@-]*$ ]] || die "QWEN38_IMAGE=${image}: not an image reference"
model_dir=${QWEN38_MODEL_DIR:-/srv/models}
[[ $model_dir =~ ^/[A-Za-z0-9._/-]*$ ]] || die "QWEN38_MODEL_DIR=${model_dir}: need an absolute path without spaces or commas"
gpu=${QWEN38_GPU:-}

if live; then
    docker image inspect "$image" >/dev/null 2>&1 ||
        die "image ${image} not found: build it first (docker build -f deploy/docker/Dockerfile -t ${image} ...)"
    if [[ ! -f $units_env && -z $gpu ]] && command -v nvidia-smi >/dev/null; then
        gpu=$(nvidia-smi --query-gpu=uuid --format=csv,noheader | sed -n 1p)
        [[ -z $gpu ]] || say "GPU ${gpu} (the first one nvidia-smi lists; set QWEN38_GPU to choose)"
    fi
    if [[ ! -f $units_env && -z $gpu ]]; then
        die "no GPU UUID: set QWEN38_GPU=GPU-... (nvidia-smi --query-gpu=uuid --format=csv,noheader)"
    fi
fi
if [[ -n $gpu && ! $gpu =~ ^GPU-[0-9a-fA-F-]{36}$ ]]; then
    die "QWEN38_GPU=${gpu}: expected a UUID like GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"
fi

# --- user ------------------------------------------------------------------------------------
if live; then
    getent group "$user" >/dev/null || groupadd --system "$user"
    if ! getent passwd "$user" >/dev/null; then
        useradd --system --gid "$user" --home-dir /var/cache/qwen38 --no-create-home \
            --shell /usr/sbin/nologin "$user"
        say "created system user ${user}"
    fi
fi
if getent passwd "$user" >/dev/null; then
    uid=$(id -u "$user")
    gid=$(id -g "$user")
else
    uid=$default_id
    gid=$default_id
fi

# install(1) with the owner only when live: under DESTDIR the files belong to whoever runs this.
owned=()
if live; then
    owned=(-o "$user" -g "$user")
fi

# --- directories -----------------------------------------------------------------------------
install -d -m 0750 "${owned[@]}" "$etc_dir" "$run_dir" "$cache_dir" "$state_dir"
install -d -m 0755 "$unit_dir" "$tmpfiles_dir" "$sbin_dir" "$share_dir" "$doc_dir"

# --- files that are ours: replaced when they differ ------------------------------------------
# install -C leaves a file that is already the same (content, mode, owner) untouched, times
# included, so a second run changes nothing.
units_changed=0
for unit in qwen38-engine.service qwen38-engine@.service qwen38-gateway.service; do
    if ! cmp -s "$here/systemd/$unit" "$unit_dir/$unit"; then
        units_changed=1
    fi
    install -C -m 0644 "$here/systemd/$unit" "$unit_dir/$unit"
done
install -C -m 0644 "$here/systemd/qwen38.conf" "$tmpfiles_dir/qwen38.conf"
install -C -m 0755 "$here/bin/qwen38-cli" "$sbin_dir/qwen38-cli"
for name in qwen38-gateway qwen38-engine; do
    if [[ $(readlink -- "$sbin_dir/$name" 2>/dev/null) != qwen38-cli ]]; then
        ln -sfn qwen38-cli "$sbin_dir/$name"
    fi
done
install -C -m 0644 "$here/etc/gateway.toml" "$etc_dir/gateway.toml.example"
install -C -m 0644 "$here/etc/engine.toml" "$etc_dir/engine.toml.example"
install -C -m 0644 "$here/etc/engine.tp2.toml" "$etc_dir/engine.tp2.toml.example"
install -C -m 0644 "$here/etc/api-keys.env.example" "$etc_dir/api-keys.env.example"
install -C -m 0644 "$here/etc/units.env.example" "$etc_dir/units.env.example"
while IFS= read -r -d '' file; do
    install -C -D -m 0644 "$file" "$share_dir/${file#"$here"/}"
done < <(find "$here/prometheus" "$here/grafana" -type f -print0)
if [[ -f $here/../README.md ]]; then
    install -C -m 0644 "$here/../README.md" "$doc_dir/README.md"
fi

# --- files that are the operator's: created once ---------------------------------------------
for name in gateway.toml engine.toml; do
    if [[ -e $etc_dir/$name ]]; then
        say "keeping ${etc_dir}/${name}"
    else
        install -m 0640 "${owned[@]}" "$here/etc/$name" "$etc_dir/$name"
        say "created ${etc_dir}/${name}"
    fi
done

if [[ -e $units_env ]]; then
    say "keeping ${units_env}"
else
    QWEN38_IMAGE=$image QWEN38_GPU=$gpu QWEN38_MODEL_DIR=$model_dir QWEN38_UID=$uid QWEN38_GID=$gid \
        awk '
            match($0, /^QWEN38_[A-Z_]+=/) {
                name = substr($0, 1, RLENGTH - 1)
                if (ENVIRON[name] != "") { print name "=" ENVIRON[name]; next }
            }
            { print }
        ' "$here/etc/units.env.example" >"$units_env.tmp"
    chmod 0644 "$units_env.tmp"
    mv -f -- "$units_env.tmp" "$units_env"
    say "created ${units_env}"
fi

random_hex() {
    od -An -tx1 -N32 /dev/urandom | tr -d ' \n'
}

# Adds the first key to the new keys file $1 and prints its secret alone on the last stdout line.
add_first_key() {
    local file=$1
    if live; then
        # Through the image, as the user the gateway runs as (the host's Python is too old).
        docker run --rm --network none --log-driver none --user "${uid}:${gid}" \
            --mount "type=bind,source=${etc_dir},target=/etc/qwen38" \
            "$image" qwen38-gateway keys add --tenant "$keys_tenant" --keys-file "/etc/qwen38/${file##*/}"
    elif command -v qwen38-gateway >/dev/null; then
        qwen38-gateway keys add --tenant "$keys_tenant" --keys-file "$file"
    else
        # Plaintext form KEY_ID=tenant:secret; `qwen38-gateway keys add` would store a hash.
        python3 -c '
import secrets, sys
key_id = "key_" + secrets.token_hex(4)
secret = "sk-" + secrets.token_urlsafe(32)
with open(sys.argv[1], "a", encoding="utf-8") as handle:
    handle.write(f"{key_id}={sys.argv[2]}:{secret}\n")
print(secret)
' "$file" "$keys_tenant"
    fi
}

if [[ -e $keys_file ]]; then
    say "keeping ${keys_file} (no key generated)"
else
    tmp=$(mktemp "$etc_dir/.api-keys.env.XXXXXX")
    trap 'rm -f -- "$tmp"' EXIT
    {
        printf '# qwen38 API keys (mode 0600). Format and commands: api-keys.env.example.\n'
        printf 'QWEN38_CACHE_SALT_SECRET=%s\n' "$(random_hex)"
    } >"$tmp"
    chmod 0600 "$tmp"
    if live; then
        chown "$user:$user" "$tmp"
    fi
    say "first API key for tenant ${keys_tenant}; the secret is shown once, on the next line:"
    add_first_key "$tmp"
    chmod 0600 "$tmp"
    mv -f -- "$tmp" "$keys_file"
    trap - EXIT
fi

# --- activate (live only) --------------------------------------------------------------------
if live; then
    running=0
    if systemctl is-active --quiet qwen38-engine.service qwen38-gateway.service; then
        running=1
    fi
    systemd-tmpfiles --create "$tmpfiles_dir/qwen38.conf"
    systemctl daemon-reload
    systemctl enable --now --no-block qwen38-engine.service qwen38-gateway.service
    if [[ $units_changed -eq 1 && $running -eq 1 ]]; then
        say "unit files changed: running services keep the old ones until" \
            "systemctl restart qwen38-gateway (and qwen38-engine, which reloads the model)"
    fi
    say "enabled; the engine loads for several minutes: journalctl -fu qwen38-engine," \
        "then curl -s http://127.0.0.1:8000/ready"
else
    say "files laid under ${destdir}; nothing enabled or started"
fi
