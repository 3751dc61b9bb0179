#!/usr/bin/env bash
# `make demo`: the README's main job. The whole nightly chain on the small built-in `example`
# definition: prefetch (pins the base image by digest), build every stage offline, gate, promote
# to example:local, sync to a peer, gc, and the run report; it ends with the report's summary.
#
# It runs in a scratch copy of the definition (.imagebuild/demo/project) so that the pins prefetch
# writes (versions.env, lock.json) do not change this checkout. The peer is made on the fly
# (scripts/peer.sh: its own network namespace, sshd and Docker engine) when this machine allows it
# (root, ip netns, dockerd, sshd) and imagebuild has sync; otherwise the demo says so and runs the
# chain without sync. Everything it started is stopped at the end, by pid.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
BIN="$root/.venv/bin"
work="$root/.imagebuild/demo"
project="$work/project"

rm -rf "$project/docker-images"  # its .imagebuild/ (records, receipts) stays: a second demo is a no-op
mkdir -p "$project/docker-images" "$work"
cp -r docker-images/example "$project/docker-images/example"
echo "demo: the built-in definition docker-images/example, copied to ${project#"$root"/} (prefetch pins it there)"

# the example's image is under 1 GB: the build's disk guard (10 GiB by default, sized for the real
# images) asks for 3 GiB here unless the caller set it
export IMAGEBUILD_MIN_FREE_GB="${IMAGEBUILD_MIN_FREE_GB:-3}"

peers=(--no-peers)
peer_dir="$work/peer"
why_no_peer=""
if ! "$BIN/python" -c 'import imagebuild.ship.sync' 2>/dev/null; then
  why_no_peer="this version of imagebuild has no sync yet"
elif [ "$(id -u)" != 0 ]; then
  why_no_peer="making a peer needs root (network namespace, a second dockerd)"
elif ! command -v ip >/dev/null || ! command -v dockerd >/dev/null || [ ! -x /usr/sbin/sshd ]; then
  why_no_peer="making a peer needs ip, dockerd and sshd"
fi
if [ -z "$why_no_peer" ]; then
  # a free slot, as the tests take one (never a fixed name another checkout's demo would tear down)
  # shellcheck source=scripts/peer_slot.sh
  source scripts/peer_slot.sh
  take_peer_slot 2>"$work/peer-up.log" || why_no_peer="no free peer slot (see $work/peer-up.log)"
fi
if [ -z "$why_no_peer" ]; then
  if out=$(bash scripts/peer.sh up "$peer_dir" 2>"$work/peer-up.log"); then
    trap 'bash scripts/peer.sh down "$peer_dir" 2>/dev/null || true' EXIT
    eval "$(printf '%s\n' "$out" | grep -E '^(PEER_ADDR|IMAGEBUILD_SSH)=')"
    export IMAGEBUILD_SSH
    peers=(--peer "root@$PEER_ADDR")
    echo "demo: local peer root@$PEER_ADDR up (own network namespace, sshd, own Docker engine)"
  else
    why_no_peer="the local peer did not start: $(tail -n 1 "$work/peer-up.log")"
  fi
fi
if [ -n "$why_no_peer" ]; then
  echo "demo: NO SYNC in this run: $why_no_peer; the rest of the chain runs"
fi

rc=0
"$BIN/imagebuild" --root "$project" nightly example --refresh "${peers[@]}" --report-dir "$work/reports" \
  --progress quiet || rc=$?
exit "$rc"
