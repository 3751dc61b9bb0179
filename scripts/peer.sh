#!/usr/bin/env bash
# A real peer node for tests and demos: its own network namespace and address, sshd, and its own
# Docker engine (recipe: ../shared/ENVIRONMENT.md section 3). Everything lives under DIR and is
# stopped by pid, never by name.
#
#   scripts/peer.sh up DIR [--classic-store]   start; prints shell assignments for the peer
#   scripts/peer.sh down DIR                    stop everything `up` started and remove the namespace
#
# After `up`, `$IMAGEBUILD_SSH root@$ADDR docker info` talks to the peer's engine.
# Names and addresses (override with env): PEER_NS=ibpeer1 PEER_ADDR=10.77.0.2 HOST_ADDR=10.77.0.1
# PEER_BRIDGE=ibpeerbr0 (172.29.0.1/24) -- only addresses of the project's own test hosts.
set -euo pipefail

cmd=${1:-}; DIR=${2:-}
[ -n "$cmd" ] && [ -n "$DIR" ] || { echo "usage: $0 up|down DIR [--classic-store]" >&2; exit 2; }
NS=${PEER_NS:-ibpeer1}
ADDR=${PEER_ADDR:-10.77.0.2}
HADDR=${HOST_ADDR:-10.77.0.1}
VETH=${PEER_VETH:-ibveth0}
BRIDGE=${PEER_BRIDGE:-ibpeerbr0}
BRIDGE_CIDR=${PEER_BRIDGE_CIDR:-172.29.0.1/24}

say() { echo "peer: $*" >&2; }

kill_pidfile() {
  local f=$1
  [ -f "$f" ] || return 0
  local pid; pid=$(cat "$f" 2>/dev/null || true)
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -9 "$pid" 2>/dev/null || true
  fi
  rm -f "$f"
}

down() {
  kill_pidfile "$DIR/sshd.pid"
  kill_pidfile "$DIR/docker.pid"
  ip netns del "$NS" 2>/dev/null || true
  ip link del "$VETH" 2>/dev/null || true
  ip link del "$BRIDGE" 2>/dev/null || true
  # the peer engine's mounts under DIR
  if [ -d "$DIR" ]; then
    { grep -o " $DIR/[^ ]*" /proc/mounts 2>/dev/null || true; } | sort -r | while read -r m; do umount -l "$m" 2>/dev/null || true; done
  fi
}

up() {
  local classic=0
  [ "${3:-}" = "--classic-store" ] && classic=1
  mkdir -p "$DIR"
  DIR=$(cd "$DIR" && pwd)
  down
  mkdir -p "$DIR/data" "$DIR/exec" /run/sshd

  # network: host side HADDR, peer side ADDR inside the namespace
  ip netns add "$NS"
  ip link add "$VETH" type veth peer name "${VETH}p"
  ip link set "${VETH}p" netns "$NS"
  ip addr add "$HADDR/24" dev "$VETH" && ip link set "$VETH" up
  ip netns exec "$NS" ip addr add "$ADDR/24" dev "${VETH}p"
  ip netns exec "$NS" ip link set "${VETH}p" up
  ip netns exec "$NS" ip link set lo up

  # the peer's engine (on the host, not inside the namespace: it needs the host's cgroups)
  ip link add name "$BRIDGE" type bridge && ip addr add "$BRIDGE_CIDR" dev "$BRIDGE" && ip link set "$BRIDGE" up
  local cfg="$DIR/daemon.json"
  if [ $classic = 1 ]; then echo '{}' > "$cfg"; else echo '{"features":{"containerd-snapshotter":true}}' > "$cfg"; fi
  setsid dockerd --config-file "$cfg" --data-root "$DIR/data" --exec-root "$DIR/exec" \
    -H "unix://$DIR/docker.sock" --pidfile "$DIR/docker.pid" --bridge="$BRIDGE" --iptables=false \
    >"$DIR/dockerd.log" 2>&1 < /dev/null &

  # sshd inside the namespace, its own key material and config
  ssh-keygen -q -t ed25519 -N '' -f "$DIR/host_key" <<<y >/dev/null 2>&1 || true
  ssh-keygen -q -t ed25519 -N '' -f "$DIR/id_ed25519" <<<y >/dev/null 2>&1 || true
  cp "$DIR/id_ed25519.pub" "$DIR/authorized_keys"
  chmod 600 "$DIR/authorized_keys"
  cat > "$DIR/sshd_config" <<CFG
ListenAddress $ADDR
Port 22
HostKey $DIR/host_key
PidFile $DIR/sshd.pid
AuthorizedKeysFile $DIR/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
SetEnv DOCKER_HOST=unix://$DIR/docker.sock
CFG
  ip netns exec "$NS" /usr/sbin/sshd -f "$DIR/sshd_config" -E "$DIR/sshd.log"
  cat > "$DIR/ssh_config" <<CFG
Host $ADDR
  User root
  IdentityFile $DIR/id_ed25519
  IdentitiesOnly yes
  StrictHostKeyChecking no
  UserKnownHostsFile $DIR/known_hosts
  BatchMode yes
  ConnectTimeout 5
CFG

  for _ in $(seq 1 60); do
    DOCKER_HOST="unix://$DIR/docker.sock" docker info >/dev/null 2>&1 && break
    sleep 0.5
  done
  DOCKER_HOST="unix://$DIR/docker.sock" docker info >/dev/null 2>&1 || { tail -20 "$DIR/dockerd.log" >&2; say "peer engine did not start"; exit 1; }
  ssh -F "$DIR/ssh_config" "$ADDR" docker version --format '{{.Server.Version}}' >/dev/null \
    || { say "ssh to the peer failed (see $DIR/sshd.log)"; exit 1; }
  say "up: ssh -F $DIR/ssh_config $ADDR (engine unix://$DIR/docker.sock)"
  echo "PEER_ADDR=$ADDR"
  echo "PEER_SSH_CONFIG=$DIR/ssh_config"
  echo "PEER_DOCKER_HOST=unix://$DIR/docker.sock"
  echo "IMAGEBUILD_SSH='ssh -F $DIR/ssh_config'"
}

case "$cmd" in
  up) up "$@" ;;
  down) DIR=$(cd "$DIR" 2>/dev/null && pwd || echo "$DIR"); down; say "down" ;;
  *) echo "usage: $0 up|down DIR" >&2; exit 2 ;;
esac
