#!/usr/bin/env bash
# A real peer node for tests and demos: its own network namespace and address, sshd, and its own
# Docker engine (recipe: ../shared/ENVIRONMENT.md section 3). Everything lives under DIR and is
# stopped by pid, never by name.
#
#   scripts/peer.sh up DIR [OPTIONS]   start; prints shell assignments for the peer
#   scripts/peer.sh down DIR            stop everything `up` started and remove the namespace
#
# Options of `up`:
#   --classic-store      the engine uses the classic image store (overlay2); default: containerd store
#   --data-size MB       the engine's data root and the peer's sync cache live on a tmpfs of MB MiB
#                        (a peer whose disk is too small)
#   --no-docker          no engine, and no docker CLI on the ssh session's PATH (a peer without docker)
#   --engine-in-netns    the engine lives in the peer's network namespace too (nsenter --net: /sys and the
#                        cgroups stay the host's), as on a real node: it reaches what the ssh session
#                        reaches (an ssh -R tunnel on the peer's loopback) and not the host's loopback
#
# After `up`, `$IMAGEBUILD_SSH root@$ADDR docker info` talks to the peer's engine. The ssh session
# also gets IMAGEBUILD_PEER_CACHE=DIR/cache (or DIR/disk/cache): the peer's sync cache, private to it,
# and XDG_CONFIG_HOME=DIR/config (where a test puts the peer's imagebuild/allowed_signers).
# Names and addresses (override with env): PEER_NS=ibpeer1 PEER_ADDR=10.77.0.2 HOST_ADDR=10.77.0.1
# PEER_VETH=ibveth0 PEER_BRIDGE=ibpeerbr0 (PEER_BRIDGE_CIDR=172.29.0.1/24) -- only addresses of the
# project's own test hosts. PEER_DOCKERD picks the engine binary (default: `dockerd` on PATH).
set -euo pipefail

cmd=${1:-}; DIR=${2:-}
[ -n "$cmd" ] && [ -n "$DIR" ] || { echo "usage: $0 up|down DIR [--classic-store] [--data-size MB] [--no-docker]" >&2; exit 2; }
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
  # the peer engine's mounts under DIR (and the small disk's tmpfs, last)
  if [ -d "$DIR" ]; then
    { grep -o " $DIR/[^ ]*" /proc/mounts 2>/dev/null || true; } | sort -r | while read -r m; do umount -l "$m" 2>/dev/null || true; done
  fi
}

# a PATH for the ssh session with every tool of the host's PATH except docker
nodocker_path() {
  local bin="$DIR/bin" d f
  rm -rf "$bin"; mkdir -p "$bin"
  for d in /usr/local/sbin /usr/local/bin /usr/sbin /usr/bin /sbin /bin; do
    [ -d "$d" ] || continue
    for f in "$d"/*; do
      case "${f##*/}" in docker|docker-*|dockerd|dockerd-*) continue ;; esac
      [ -e "$bin/${f##*/}" ] || ln -s "$f" "$bin/${f##*/}"
    done
  done
  echo "$bin"
}

up() {
  local classic=0 size="" nodocker=0 innetns=0
  shift 2
  while [ $# -gt 0 ]; do
    case "$1" in
      --classic-store) classic=1 ;;
      --data-size) size=$2; shift ;;
      --no-docker) nodocker=1 ;;
      --engine-in-netns) innetns=1 ;;
      *) echo "peer.sh: unknown option $1" >&2; exit 2 ;;
    esac
    shift
  done
  mkdir -p "$DIR"
  DIR=$(cd "$DIR" && pwd)
  down
  local data="$DIR/data" cache="$DIR/cache"
  if [ -n "$size" ]; then
    mkdir -p "$DIR/disk"
    mount -t tmpfs -o "size=${size}m" ibpeerdisk "$DIR/disk"
    data="$DIR/disk/docker" cache="$DIR/disk/cache"
  fi
  mkdir -p "$data" "$DIR/exec" "$cache" /run/sshd

  # network: host side HADDR, peer side ADDR inside the namespace
  ip netns add "$NS"
  ip link add "$VETH" type veth peer name "${VETH}p"
  ip link set "${VETH}p" netns "$NS"
  ip addr add "$HADDR/24" dev "$VETH" && ip link set "$VETH" up
  ip netns exec "$NS" ip addr add "$ADDR/24" dev "${VETH}p"
  ip netns exec "$NS" ip link set "${VETH}p" up
  ip netns exec "$NS" ip link set lo up

  # the peer's engine (on the host, not inside the namespace: it needs the host's cgroups)
  local inns=()
  if [ $innetns = 1 ]; then
    inns=(ip netns exec "$NS")
    echo "$NS" > "$DIR/engine-netns"
  fi
  "${inns[@]}" ip link add name "$BRIDGE" type bridge && "${inns[@]}" ip addr add "$BRIDGE_CIDR" dev "$BRIDGE" \
    && "${inns[@]}" ip link set "$BRIDGE" up
  local cfg="$DIR/daemon.json"
  if [ $classic = 1 ]; then echo '{}' > "$cfg"; else echo '{"features":{"containerd-snapshotter":true}}' > "$cfg"; fi
  if [ $nodocker = 0 ]; then
    local nsenter=()
    [ $innetns = 1 ] && nsenter=(nsenter "--net=/run/netns/$NS")
    setsid "${nsenter[@]}" "${PEER_DOCKERD:-dockerd}" --config-file "$cfg" --data-root "$data" --exec-root "$DIR/exec" \
      -H "unix://$DIR/docker.sock" --pidfile "$DIR/docker.pid" --bridge="$BRIDGE" --iptables=false \
      >"$DIR/dockerd.log" 2>&1 < /dev/null &
  fi

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
SetEnv DOCKER_HOST=unix://$DIR/docker.sock IMAGEBUILD_PEER_CACHE=$cache XDG_CONFIG_HOME=$DIR/config
CFG
  if [ $nodocker = 1 ]; then
    sed -i "s|^SetEnv .*|& PATH=$(nodocker_path)|" "$DIR/sshd_config"
  fi
  ip netns exec "$NS" /usr/sbin/sshd -f "$DIR/sshd_config" -E "$DIR/sshd.log"
  # the client knows the peer's host key from the start (as an operator's known_hosts would): a
  # changed or unknown key is refused, never accepted
  echo "$ADDR $(cut -d' ' -f1,2 "$DIR/host_key.pub")" > "$DIR/known_hosts"
  cat > "$DIR/ssh_config" <<CFG
Host $ADDR
  User root
  IdentityFile $DIR/id_ed25519
  IdentitiesOnly yes
  StrictHostKeyChecking yes
  UserKnownHostsFile $DIR/known_hosts
  BatchMode yes
  ConnectTimeout 5
CFG

  if [ $nodocker = 0 ]; then
    for _ in $(seq 1 60); do
      DOCKER_HOST="unix://$DIR/docker.sock" docker info >/dev/null 2>&1 && break
      sleep 0.5
    done
    DOCKER_HOST="unix://$DIR/docker.sock" docker info >/dev/null 2>&1 || { tail -20 "$DIR/dockerd.log" >&2; say "peer engine did not start"; exit 1; }
    ssh -F "$DIR/ssh_config" "$ADDR" docker version --format '{{.Server.Version}}' >/dev/null \
      || { say "ssh to the peer failed (see $DIR/sshd.log)"; exit 1; }
  else
    ssh -F "$DIR/ssh_config" "$ADDR" true || { say "ssh to the peer failed (see $DIR/sshd.log)"; exit 1; }
  fi
  say "up: ssh -F $DIR/ssh_config $ADDR (engine unix://$DIR/docker.sock)"
  echo "PEER_ADDR=$ADDR"
  echo "PEER_SSH_CONFIG=$DIR/ssh_config"
  echo "PEER_DOCKER_HOST=unix://$DIR/docker.sock"
  echo "IMAGEBUILD_SSH='ssh -F $DIR/ssh_config'"
  echo "PEER_CACHE=$cache"
  echo "PEER_DATA_ROOT=$data"
  echo "PEER_VETH=$VETH"
}

case "$cmd" in
  up) up "$@" ;;
  down) DIR=$(cd "$DIR" 2>/dev/null && pwd || echo "$DIR"); down; say "down" ;;
  *) echo "usage: $0 up|down DIR [--classic-store] [--data-size MB] [--no-docker]" >&2; exit 2 ;;
esac
