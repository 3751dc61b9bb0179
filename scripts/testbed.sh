#!/usr/bin/env bash
# Make sure the real parts the test suite needs are here, then exit 0.
#
#   scripts/testbed.sh                 engine + base images (idempotent; fast when all is there)
#   scripts/testbed.sh --check         only report what is missing (exit 1 if anything is)
#   scripts/testbed.sh --print-mirror  print the Debian mirror it would use, and exit
#
# The Debian mirror is this machine's own: the first main-suite URI in apt's sources
# (/etc/apt/sources.list.d/*.sources, then /etc/apt/sources.list), or $IMAGEBUILD_DEBIAN_MIRROR.
# No mirror host is written in this project.
#
# What it provides (recipe: ../shared/ENVIRONMENT.md, sections 1-2):
#   - a Docker engine with BuildKit (buildx) and the containerd image store;
#     on a machine where an engine already answers `docker info`, that engine is used as is;
#   - git, rsync, ssh, debootstrap, busybox;
#   - local base images imported without any registry:
#       imagebuild-test/debian:bookworm   (debootstrap minbase + python3, cmake, g++, make)
#       imagebuild-test/busybox:1         (busybox-static, ~2 MB)
#       imagebuild-test/debian-arm64:bookworm  (linux/arm64, debootstrap minbase + python3, run under
#                                         QEMU: qemu-user-static's aarch64 binfmt handler is registered
#                                         too; where it cannot be, the arm64 tests skip, saying why)
#     their root-fs tarballs are cached under $IMAGEBUILD_TESTBED_CACHE (default
#     ~/.cache/imagebuild-testbed) so a second run takes seconds.
set -euo pipefail

CACHE=${IMAGEBUILD_TESTBED_CACHE:-$HOME/.cache/imagebuild-testbed}
DEBIAN_IMAGE=imagebuild-test/debian:bookworm
BUSYBOX_IMAGE=imagebuild-test/busybox:1
# linux/arm64 under QEMU user-mode emulation (ENVIRONMENT.md section 7): bookworm's CPython 3.11, the
# newest Debian has for arm64 (no 3.12 there; the glm53 sets resolve for 3.11 as well). Minimal: python3
# only; stages add what they need from prefetched debs, under emulation, as the real images do.
ARM64_IMAGE=imagebuild-test/debian-arm64:bookworm
ARM64_PKGS=python3
ARM64_PKGS_ID=$(printf 'arm64:%s' "$ARM64_PKGS" | sha256sum | cut -c1-12)
DEBIAN_PKGS=python3,cmake,g++,make,git,ccache
# the cached root-fs tarball and the imported image are named by this list: adding a package rebuilds both
DEBIAN_PKGS_ID=$(printf %s "$DEBIAN_PKGS" | sha256sum | cut -c1-12)
LOG=${IMAGEBUILD_TESTBED_LOG:-/var/log/imagebuild-dockerd.log}
check_only=0
[ "${1:-}" = "--check" ] && check_only=1

say() { echo "testbed: $*" >&2; }
die() { echo "testbed: error: $*" >&2; exit 1; }

have() { command -v "$1" >/dev/null 2>&1; }
engine_up() { docker info >/dev/null 2>&1; }
buildx_ok() { docker buildx version >/dev/null 2>&1; }

# The Debian mirror apt uses here: the first URI of a deb822 stanza (or a one-line "deb" entry)
# whose suite has no "-" (bookworm, not bookworm-security / bookworm-updates).
debian_mirror() {
  if [ -n "${IMAGEBUILD_DEBIAN_MIRROR:-}" ]; then echo "${IMAGEBUILD_DEBIAN_MIRROR%/}"; return 0; fi
  local m="" f parts=${IMAGEBUILD_APT_SOURCE_PARTS:-/etc/apt/sources.list.d} list=${IMAGEBUILD_APT_SOURCE_LIST:-/etc/apt/sources.list}
  for f in "$parts"/*.sources; do
    [ -f "$f" ] || continue
    m=$(awk '
      function flush() { if (uri != "" && main) { print uri; found = 1; exit } uri = ""; main = 0; deb = 0 }
      /^[[:space:]]*$/ { flush(); next }
      /^[[:space:]]*#/ { next }
      tolower($1) == "types:" { for (i = 2; i <= NF; i++) if ($i == "deb") deb = 1 }
      tolower($1) == "uris:" { uri = $2 }
      tolower($1) == "suites:" { for (i = 2; i <= NF; i++) if ($i !~ /-/) main = 1 }
      END { if (!found && uri != "" && main && deb) print uri }' "$f")
    [ -n "$m" ] && break
  done
  if [ -z "$m" ] && [ -f "$list" ]; then
    m=$(awk '$1 == "deb" { i = 2; if ($i ~ /^\[/) { while (i <= NF && $i !~ /\]$/) i++; i++ }
                           if ($(i + 1) !~ /-/) { print $i; exit } }' "$list")
  fi
  [ -n "$m" ] || die "no Debian mirror in apt's sources ($parts/*.sources, $list); set IMAGEBUILD_DEBIAN_MIRROR"
  echo "${m%/}"
}

if [ "${1:-}" = "--print-mirror" ]; then debian_mirror; exit 0; fi

apt_updated=0
apt_install() {
  [ "$(id -u)" = 0 ] || die "need root to install: $*  (install them yourself, then re-run)"
  have apt-get || die "no apt-get: install $* with your package manager, then re-run"
  if [ $apt_updated = 0 ]; then DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2; apt_updated=1; fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >&2
}

ensure_tools() {
  local missing=()
  have git || missing+=(git)
  have rsync || missing+=(rsync)
  have ssh || missing+=(openssh-client)
  have sshd || [ -x /usr/sbin/sshd ] || missing+=(openssh-server)
  have debootstrap || [ -x /usr/sbin/debootstrap ] || missing+=(debootstrap)
  [ -x /bin/busybox ] || missing+=(busybox-static)
  have ip || missing+=(iproute2)
  # the shared registry of the fleet tests (docs/fleet.md): Debian's registry, skopeo, htpasswd
  have docker-registry || missing+=(docker-registry)
  have skopeo || missing+=(skopeo)
  have htpasswd || missing+=(apache2-utils)
  # the nightly's HTML history page is loaded by headless Chromium (tests/integration/ops/test_history_page.py)
  have chromium || missing+=(chromium)
  if [ ${#missing[@]} -gt 0 ]; then
    [ $check_only = 1 ] && { say "missing tools: ${missing[*]}"; return 1; }
    say "installing ${missing[*]}"
    apt_install "${missing[@]}"
  fi
}

# The engine: Debian unstable's dockerd 28.x (BuildKit 0.2x) with its containerd 2.x and buildx 0.29,
# unpacked (dpkg -x) into $ENGINE_DIR and linked from /usr/local/bin; bookworm's docker.io provides
# runc, iptables and the rest. Why this engine: imagebuild exports every stage reproducibly
# (rewrite-timestamp), and BuildKit 0.13 (Debian 13's engine 26.1) also rewrites the base image's
# layers there and is about twice as slow (docs/build.md, "Reproducibility"). When unstable's engine
# does not run here (a newer libc than this machine's), Debian 13's 26.1 is installed instead.
ENGINE_DIR=/usr/local/lib/imagebuild-engine

_suite_debs() {  # _suite_debs SUITE DIR PACKAGE...: download PACKAGEs from SUITE of this machine's mirror
  local suite=$1 t=$2; shift 2
  rm -rf "$t"; mkdir -p "$t/lists/partial" "$t/debs"
  echo "deb $(debian_mirror) $suite main" > "$t/sources.list"
  local o=(-o Dir::Etc::SourceList="$t/sources.list" -o Dir::Etc::SourceParts=/dev/null -o Dir::State::Lists="$t/lists")
  apt-get "${o[@]}" update -qq >&2
  (cd "$t/debs" && apt-get "${o[@]}" download "$@" >&2)
}

install_engine() {
  say "installing a Docker engine (bookworm docker.io for runc, then unstable's engine 28 + buildx)"
  apt_install docker.io
  local t=/tmp/imagebuild-engine-debs
  _suite_debs sid "$t" docker.io containerd docker-buildx
  rm -rf "$t/x" && mkdir -p "$t/x"
  for d in "$t"/debs/*.deb; do dpkg -x "$d" "$t/x"; done
  if ! "$t/x/usr/sbin/dockerd" --version >/dev/null 2>&1 || ! "$t/x/usr/bin/containerd" --version >/dev/null 2>&1; then
    say "unstable's engine does not run on this machine's libc: installing Debian 13's engine 26 instead"
    install_engine_trixie
    return
  fi
  mkdir -p "$ENGINE_DIR" /usr/local/lib/docker/cli-plugins
  for b in sbin/dockerd sbin/docker-proxy bin/containerd bin/containerd-shim-runc-v2 bin/ctr; do
    cp -a "$t/x/usr/$b" "$ENGINE_DIR/"
    ln -sf "$ENGINE_DIR/$(basename "$b")" "/usr/local/bin/$(basename "$b")"
  done
  cp "$t/x/usr/libexec/docker/cli-plugins/docker-buildx" /usr/local/lib/docker/cli-plugins/
  say "engine: $("$ENGINE_DIR/dockerd" --version), containerd $("$ENGINE_DIR/containerd" --version | awk '{print $3}')"
}

# Debian 13's engine (26.x, BuildKit 0.13) and buildx on top of bookworm's containerd/runc.
install_engine_trixie() {
  local t=/tmp/imagebuild-trixie
  _suite_debs trixie "$t" docker.io docker-cli docker-buildx
  dpkg -i "$t"/debs/docker.io_*.deb "$t"/debs/docker-cli_*.deb >&2
  rm -rf "$t/bx" && dpkg -x "$t"/debs/docker-buildx_*.deb "$t/bx"
  mkdir -p /usr/local/lib/docker/cli-plugins
  cp "$t/bx/usr/libexec/docker/cli-plugins/docker-buildx" /usr/local/lib/docker/cli-plugins/
}

start_engine() {
  mkdir -p /etc/docker
  if [ ! -f /etc/docker/daemon.json ] || ! grep -q containerd-snapshotter /etc/docker/daemon.json; then
    echo '{"features":{"containerd-snapshotter":true}}' > /etc/docker/daemon.json
  fi
  say "starting dockerd (log: $LOG)"
  # setsid: the engine outlives this script and make's process group.
  setsid dockerd >"$LOG" 2>&1 < /dev/null &
  for _ in $(seq 1 60); do
    engine_up && return 0
    sleep 1
  done
  tail -n 30 "$LOG" >&2 || true
  die "dockerd did not answer within 60 s (log: $LOG)"
}

ensure_engine() {
  if engine_up; then
    buildx_ok || { [ $check_only = 1 ] && { say "engine up but no buildx"; return 1; }; install_engine; }
    if ! docker version --format '{{.Server.Version}}' 2>/dev/null | grep -qE '^(2[89]|[3-9][0-9])\.'; then
      say "note: the running engine is older than 28: reproducible stage exports work, but about twice as slow"
      say "      (stop it and re-run this script to get engine 28; a running engine is never replaced)"
    fi
    return 0
  fi
  [ $check_only = 1 ] && { say "no Docker engine answers 'docker info'"; return 1; }
  if ! have dockerd || ! buildx_ok || ! dockerd --version | grep -qE 'version (2[89]|[3-9][0-9])'; then
    install_engine
  fi
  start_engine
  buildx_ok || die "docker buildx is not available after install"
}

import_debian() {
  local have; have=$(docker image inspect --format '{{index .Config.Labels "io.imagebuild.testbed"}}' "$DEBIAN_IMAGE" 2>/dev/null)
  [ "$have" = "$DEBIAN_PKGS_ID" ] && return 0
  [ $check_only = 1 ] && { say "missing base image $DEBIAN_IMAGE (with $DEBIAN_PKGS)"; return 1; }
  mkdir -p "$CACHE"
  local tarball="$CACHE/debian-bookworm-minbase-$DEBIAN_PKGS_ID.tar"
  if [ ! -s "$tarball" ]; then
    local root; root=$(mktemp -d "$CACHE/rootfs.XXXXXX")
    say "debootstrap bookworm minbase with $DEBIAN_PKGS (a few minutes, once)"
    debootstrap --variant=minbase --include="$DEBIAN_PKGS" bookworm "$root" "$(debian_mirror)" >&2 \
      || { rm -rf "$root"; die "debootstrap failed"; }
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
    tar -C "$root" --sort=name --numeric-owner -cf "$tarball.tmp" . && mv "$tarball.tmp" "$tarball"
    rm -rf "$root"
  fi
  say "importing $DEBIAN_IMAGE"
  docker import -c 'CMD ["bash"]' -c "LABEL io.imagebuild.testbed=$DEBIAN_PKGS_ID" "$tarball" "$DEBIAN_IMAGE" >/dev/null
}

# Emulation of linux/arm64: Debian's qemu-user-static registers its handlers with the F flag (the
# interpreter is opened at registration, so containers can use it); binfmt_misc is mounted where it is
# not. Only the aarch64 handler is enabled. Returns 1 (and says why) where it cannot be set up: the
# arm64 tests then skip with that reason (IMAGEBUILD_ARM64=0 skips it on purpose).
BINFMT=/proc/sys/fs/binfmt_misc
ensure_emulation() {
  [ "${IMAGEBUILD_ARM64:-1}" = 0 ] && { say "arm64 emulation not set up (IMAGEBUILD_ARM64=0)"; return 1; }
  [ "$(uname -m)" = aarch64 ] && return 0
  if [ -r $BINFMT/qemu-aarch64 ] && grep -q '^enabled' $BINFMT/qemu-aarch64 \
     && grep -q '^flags:.*F' $BINFMT/qemu-aarch64; then return 0; fi
  [ $check_only = 1 ] && { say "missing: an enabled qemu-aarch64 binfmt handler with the F flag"; return 1; }
  { [ -x /usr/bin/qemu-aarch64-static ] && have update-binfmts; } || (apt_install qemu-user-static binfmt-support) \
    || { say "arm64 emulation: qemu-user-static could not be installed"; return 1; }
  if [ ! -e $BINFMT/register ]; then
    mount -t binfmt_misc binfmt_misc $BINFMT 2>/dev/null \
      || { say "arm64 emulation: binfmt_misc is not mounted and cannot be mounted here (not root, or a container without the right)"; return 1; }
  fi
  update-binfmts --enable qemu-aarch64 >/dev/null 2>&1 || true
  if grep -q '^enabled' $BINFMT/qemu-aarch64 2>/dev/null && grep -q '^flags:.*F' $BINFMT/qemu-aarch64; then
    say "arm64 emulation: $(sed -n 's/^interpreter //p' $BINFMT/qemu-aarch64) registered"
    return 0
  fi
  say "arm64 emulation: the qemu-aarch64 handler did not register with the F flag"; return 1
}

# The arm64 base: debootstrap of bookworm for arm64, whose second stage runs in a chroot under the
# handler above (a few minutes, once), cached as a tarball like the amd64 one.
import_debian_arm64() {
  local have; have=$(docker image inspect --format '{{index .Config.Labels "io.imagebuild.testbed"}}' "$ARM64_IMAGE" 2>/dev/null)
  [ "$have" = "$ARM64_PKGS_ID" ] && return 0
  [ $check_only = 1 ] && { say "missing base image $ARM64_IMAGE (with $ARM64_PKGS)"; return 1; }
  mkdir -p "$CACHE"
  local tarball="$CACHE/debian-bookworm-arm64-minbase-$ARM64_PKGS_ID.tar"
  if [ ! -s "$tarball" ]; then
    local root; root=$(mktemp -d "$CACHE/rootfs-arm64.XXXXXX")
    say "debootstrap bookworm arm64 minbase with $ARM64_PKGS under QEMU (a few minutes, once)"
    debootstrap --arch=arm64 --variant=minbase --include="$ARM64_PKGS" bookworm "$root" "$(debian_mirror)" >&2 \
      || { rm -rf "$root"; say "debootstrap of the arm64 base failed"; return 1; }
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
    tar -C "$root" --sort=name --numeric-owner -cf "$tarball.tmp" . && mv "$tarball.tmp" "$tarball"
    rm -rf "$root"
  fi
  say "importing $ARM64_IMAGE"
  docker import --platform linux/arm64 -c 'CMD ["bash"]' -c "LABEL io.imagebuild.testbed=$ARM64_PKGS_ID" \
    "$tarball" "$ARM64_IMAGE" >/dev/null
}

import_busybox() {
  docker image inspect "$BUSYBOX_IMAGE" >/dev/null 2>&1 && return 0
  [ $check_only = 1 ] && { say "missing base image $BUSYBOX_IMAGE"; return 1; }
  local root; root=$(mktemp -d)
  mkdir -p "$root/bin" "$root/tmp" "$root/etc"
  cp /bin/busybox "$root/bin/busybox"
  for a in $("$root/bin/busybox" --list); do [ "$a" = busybox ] || ln -sf busybox "$root/bin/$a"; done
  echo 'root:x:0:0:root:/root:/bin/sh' > "$root/etc/passwd"
  say "importing $BUSYBOX_IMAGE"
  tar -C "$root" --sort=name --numeric-owner --mtime=@0 -c . | docker import -c 'CMD ["sh"]' - "$BUSYBOX_IMAGE" >/dev/null
  rm -rf "$root"
}

rc=0
ensure_tools || rc=1
ensure_engine || rc=1
if engine_up; then
  import_busybox || rc=1
  import_debian || rc=1
  # arm64 is optional: where emulation cannot be set up the arm64 tests skip, saying why
  if ensure_emulation; then import_debian_arm64 || say "no arm64 base: the arm64 tests will skip"; fi
fi
[ $rc = 0 ] && say "ready: $(docker version --format 'engine {{.Server.Version}}'), $(docker buildx version | cut -d' ' -f1-2), store: $(docker info --format '{{.Driver}}')"
exit $rc
