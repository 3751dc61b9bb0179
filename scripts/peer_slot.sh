# Sourced (bash): `take_peer_slot` takes a free peer slot N as the tests do (tests/peers.py peer_slot):
# no namespace ibpN exists, and an flock on /tmp/imagebuild-peer-slots/N.lock, held on the file
# descriptor $PEER_SLOT_FD until this shell (and what it starts) exits. It exports the names and
# addresses scripts/peer.sh reads (PEER_NS=ibpN, PEER_ADDR=10.77.N.2, ...) and PEER_SLOT=N, so two
# checkouts (or a demo and a test session) on one machine never share, or tear down, each other's peer.
take_peer_slot() {
  local dir=/tmp/imagebuild-peer-slots n taken
  mkdir -p "$dir"
  taken=$(ip netns list 2>/dev/null | awk '{print $1}')
  for n in $(seq 100 249); do
    if printf '%s\n' "$taken" | grep -qx "ibp$n"; then continue; fi
    exec {PEER_SLOT_FD}>"$dir/$n.lock"
    if flock -n "$PEER_SLOT_FD"; then
      export PEER_SLOT=$n PEER_NS=ibp$n PEER_ADDR=10.77.$n.2 HOST_ADDR=10.77.$n.1 PEER_VETH=ibpv$n \
             PEER_BRIDGE=ibpbr$n PEER_BRIDGE_CIDR=172.29.$n.1/24
      return 0
    fi
    exec {PEER_SLOT_FD}>&-
  done
  echo "no free peer slot in 100-249" >&2
  return 1
}
