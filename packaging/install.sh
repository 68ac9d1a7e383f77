#!/usr/bin/env bash
# Install prewarm on a node: a self-contained virtualenv under a prefix (default /opt/prewarm),
# the systemd units (prewarmd.service; prewarm-csi.service, the CSI node plugin, enabled with
# --csi), tmpfiles.d and sysusers.d entries, and /etc/prewarm/agent.toml.
#
# Usable as it is as a Packer shell provisioner or an EC2 Image Builder step (see
# packaging/imagebuilder/ and docs/node-setup.md). Run it as root from an unpacked source tree
# (a git checkout or `git archive` of it), or give it a wheel built with `make wheel`.
#
#   packaging/install.sh [options]
#     --prefix DIR      where the virtualenv goes (default /opt/prewarm); must be its final path
#     --python PROG     interpreter for the virtualenv, Python >= 3.11 (default: the first of
#                       python3.14 ... python3.11, python3 that is new enough)
#     --wheel FILE      install this wheel (make wheel: dist/prewarm_agent-*.whl) instead of the
#                       source tree around this script
#     --extras LIST     more extras besides "daemon" (always installed: prewarmd's own
#                       dependencies), e.g. "torch" (load_safetensors into torch tensors)
#     --pip-arg ARG     pass ARG to pip install (repeatable), e.g. --pip-arg=--no-index
#                       --pip-arg=--find-links=/tmp/wheelhouse for an image built offline
#     --gid N           the prewarm group's GID (default 2929, as in the DaemonSet's image; pods
#                       that do not run as root list it in securityContext.supplementalGroups)
#     --root DIR        write the system files (/etc/...) under DIR instead of / (image trees, tests)
#     --bin-dir DIR     link the prewarm CLI here (default /usr/local/bin; "" for none)
#     --no-system       the virtualenv only: no unit, users, config (container images)
#     --no-enable       do not enable prewarmd.service (nor prewarm-csi.service)
#     --csi             also enable prewarm-csi.service, the CSI node plugin, for Kubernetes
#                       nodes whose pods mount models as csi volumes (docs/kubernetes.md)
#     --start           (re)start prewarmd.service now (and prewarm-csi.service with --csi;
#                       not while baking an image)
#
# Running it again upgrades in place and keeps an existing /etc/prewarm/agent.toml (the new
# default is written next to it as agent.toml.default).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source_dir="$(dirname "$here")"
prefix=/opt/prewarm
python=""
wheel=""
extras=""
pip_args=()
gid=2929
root=/
bin_dir=/usr/local/bin
system=1
enable=1
csi=0
start=0

die() { echo "install.sh: $*" >&2; exit 2; }
say() { echo "install.sh: $*"; }

while [ $# -gt 0 ]; do
    case "$1" in
        --prefix) prefix="${2:?--prefix needs a directory}"; shift 2 ;;
        --prefix=*) prefix="${1#*=}"; shift ;;
        --python) python="${2:?--python needs a program}"; shift 2 ;;
        --python=*) python="${1#*=}"; shift ;;
        --wheel) wheel="${2:?--wheel needs a file}"; shift 2 ;;
        --wheel=*) wheel="${1#*=}"; shift ;;
        --extras) extras="${2?--extras needs a list}"; shift 2 ;;
        --extras=*) extras="${1#*=}"; shift ;;
        --pip-arg) pip_args+=("${2:?--pip-arg needs an argument}"); shift 2 ;;
        --pip-arg=*) pip_args+=("${1#*=}"); shift ;;
        --gid) gid="${2:?--gid needs a number}"; shift 2 ;;
        --gid=*) gid="${1#*=}"; shift ;;
        --root) root="${2:?--root needs a directory}"; shift 2 ;;
        --root=*) root="${1#*=}"; shift ;;
        --bin-dir) bin_dir="${2?--bin-dir needs a directory}"; shift 2 ;;
        --bin-dir=*) bin_dir="${1#*=}"; shift ;;
        --no-system) system=0; shift ;;
        --no-enable) enable=0; shift ;;
        --csi) csi=1; shift ;;
        --start) start=1; shift ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed -e '/^set -euo/d' -e 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown option $1 (see --help)" ;;
    esac
done

case "$prefix" in /*) ;; *) die "--prefix must be an absolute path, not $prefix" ;; esac
case "$root" in /*) ;; *) die "--root must be an absolute path, not $root" ;; esac
[[ "$gid" =~ ^[0-9]+$ ]] || die "--gid must be a number, not $gid"
root="${root%/}"  # "" for /, so "$root/etc" is /etc

# -- the interpreter -----------------------------------------------------------------------
new_enough() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; }
if [ -z "$python" ]; then
    for candidate in python3.14 python3.13 python3.12 python3.11 python3; do
        if command -v "$candidate" >/dev/null && new_enough "$candidate"; then
            python="$candidate"
            break
        fi
    done
    [ -n "$python" ] || die "no Python >= 3.11 found; install one (Amazon Linux 2023:" \
        "dnf install -y python3.11; Ubuntu 22.04: apt-get install -y python3.11-venv) or pass --python"
fi
new_enough "$python" || die "$python is not Python >= 3.11; pass --python with one that is"

# -- the virtualenv ------------------------------------------------------------------------
if [ -n "$wheel" ]; then
    [ -f "$wheel" ] || die "no wheel at $wheel"
    target="$(cd "$(dirname "$wheel")" && pwd)/$(basename "$wheel")"
else
    [ -f "$source_dir/pyproject.toml" ] || die "no source tree at $source_dir; pass --wheel"
    target="$source_dir"
fi
# The distribution's base is the pods' client; the node agent is its "daemon" extra.
target="${target}[daemon${extras:+,$extras}]"

say "creating the virtualenv in $prefix with $("$python" --version 2>&1)"
mkdir -p "$prefix"
"$python" -m venv "$prefix"
# An upgrade may carry the same version number (a rebuilt checkout): remove it first so pip
# does not call it satisfied ("prewarm" is the name it had before it had one of its own).
"$prefix/bin/python" -m pip uninstall --quiet --yes prewarm-agent prewarm 2>/dev/null || true
"$prefix/bin/python" -m pip install --quiet --disable-pip-version-check \
    ${pip_args[@]+"${pip_args[@]}"} "$target"
version="$("$prefix/bin/prewarmd" --version)"
say "installed $version"

if [ -n "$bin_dir" ]; then
    mkdir -p "$root$bin_dir"
    ln -sfn "$prefix/bin/prewarm" "$root$bin_dir/prewarm"
fi

[ "$system" = 1 ] || { say "done (--no-system: no unit, users or config)"; exit 0; }

# -- system files --------------------------------------------------------------------------
install -d -m 0755 "$root/etc/systemd/system" "$root/etc/tmpfiles.d" "$root/etc/sysusers.d" \
    "$root/etc/prewarm" "$root/etc/prewarm/models.d" "$prefix/share/doc/prewarm"
for unit in prewarmd.service prewarm-csi.service; do
    sed "s#/opt/prewarm/#$prefix/#g" "$source_dir/systemd/$unit" > "$root/etc/systemd/system/$unit"
    chmod 0644 "$root/etc/systemd/system/$unit"
done
install -m 0644 "$source_dir/systemd/prewarm.tmpfiles" "$root/etc/tmpfiles.d/prewarm.conf"
sed "s/^g\([[:space:]]\{1,\}\)prewarm\([[:space:]]\{1,\}\)[0-9-]\{1,\}/g\1prewarm\2$gid/" \
    "$source_dir/systemd/prewarm.sysusers" > "$root/etc/sysusers.d/prewarm.conf"
chmod 0644 "$root/etc/sysusers.d/prewarm.conf"
config="$root/etc/prewarm/agent.toml"
if [ -e "$config" ] && ! cmp -s "$source_dir/packaging/agent.toml" "$config"; then
    install -m 0644 "$source_dir/packaging/agent.toml" "$config.default"
    say "kept your $config; the new defaults are in $config.default"
else
    install -m 0644 "$source_dir/packaging/agent.toml" "$config"
fi
for doc in "$source_dir"/docs/*.md "$source_dir/README.md"; do
    if [ -f "$doc" ]; then install -m 0644 "$doc" "$prefix/share/doc/prewarm/"; fi
done

# The user and group, then the cache roots they own.
if command -v systemd-sysusers >/dev/null; then
    systemd-sysusers --root="${root:-/}" "$root/etc/sysusers.d/prewarm.conf"
elif [ -z "$root" ]; then
    # systemd < 215 has no sysusers; the same user by hand.
    getent group prewarm >/dev/null || groupadd --system --gid "$gid" prewarm
    getent passwd prewarm >/dev/null || useradd --system --gid prewarm --no-create-home \
        --home-dir / --shell /usr/sbin/nologin --comment "prewarm node agent" prewarm
else
    die "systemd-sysusers is needed to create the prewarm user under --root $root"
fi
if command -v systemd-tmpfiles >/dev/null; then
    systemd-tmpfiles --create --root="${root:-/}" "$root/etc/tmpfiles.d/prewarm.conf"
fi

# -- the services --------------------------------------------------------------------------
services=(prewarmd.service)
[ "$csi" = 0 ] || services+=(prewarm-csi.service)
running_systemd=0
[ -z "$root" ] && [ -d /run/systemd/system ] && running_systemd=1
if [ "$running_systemd" = 1 ]; then
    systemctl daemon-reload
    [ "$enable" = 0 ] || systemctl enable "${services[@]}"
    [ "$start" = 0 ] || systemctl restart "${services[@]}"
elif command -v systemctl >/dev/null; then
    # An image tree or a chroot: enabling only creates the symlinks.
    [ "$enable" = 0 ] || systemctl --root="${root:-/}" enable "${services[@]}"
    [ "$start" = 0 ] || say "--start ignored: systemd is not running here"
fi
say "done: $version in $prefix; units ${services[*]} in $root/etc/systemd/system"
