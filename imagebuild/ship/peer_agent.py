"""The shell side of ``imagebuild sync`` / ``gc --peer`` / ``doctor --peer``: a POSIX sh library sent over
ssh with each call (nothing is installed on the peer).

One ssh session per sync runs ``AGENT`` + ``LOOP`` (sent on stdin, evaluated by ``sh``); each call is a
frame of script (``script()``) run in a subshell. Data a step needs (JSON documents, lists, small
blobs in base64) travel inside the script as quoted here-documents, so no command ever reads the
ssh channel. The peer needs: sh, docker (CLI and
an engine the ssh user may use), rsync, flock, tar, stat, df, sha256sum; ctr only for lease cleanup.

Rules the steps keep:
- everything is written under ``$CACHE`` (``$IMAGEBUILD_PEER_CACHE``, default
  ``${XDG_CACHE_HOME:-$HOME/.cache}/imagebuild/peer``) and moved into place with ``mv`` (atomic);
- ``probe`` and ``gc_list`` only read; the steps that write take ``$CACHE/lock`` (flock) first;
- a receipt is accepted (``ib_receipt_ok``: before the transfer, again before the tag moves, and when
  only the receipt is carried) only if it verifies against the peer's own allowed-signers file
  (``$IMAGEBUILD_ALLOWED_SIGNERS``, else ``${XDG_CONFIG_HOME:-$HOME/.config}/imagebuild/allowed_signers``)
  when it has one; the sender cannot name that file;
- SIGHUP and SIGPIPE are ignored: when the sender dies (kill -9, a dropped link) the step that runs
  finishes (a ``docker load`` is never cut half-way by the sender), output is simply lost;
- the engine is asked with ``--pull never`` only: a peer engine never reaches for a registry;
- output is line-oriented: ``@@NAME`` starts a section, ``@@error CODE message`` ends a failed call.
"""

from __future__ import annotations

import shlex
import uuid

AGENT_VERSION = 1

AGENT = r"""
set -u
umask 022
trap '' PIPE HUP
CACHE=${IMAGEBUILD_PEER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/imagebuild/peer}
IB_LOCK_WAIT=${IB_LOCK_WAIT:-600}
ib_sect() { printf '@@%s\n' "$1"; }
ib_fail() { code=$1; shift; printf '@@error %s %s\n' "$code" "$*"; exit 3; }
ib_have() { command -v "$1" >/dev/null 2>&1; }
ib_df() {  # df -Pk of PATH or of its nearest existing parent
  p=$1
  while [ ! -e "$p" ]; do p=$(dirname "$p"); done
  df -Pk "$p" 2>/dev/null | tail -n 1
}
ib_lock() {
  mkdir -p "$CACHE" 2>/dev/null || ib_fail io "cannot create the cache folder $CACHE"
  ib_have flock || ib_fail tools "flock not found on the peer (util-linux)"
  exec 9>>"$CACHE/lock" || ib_fail io "cannot open $CACHE/lock"
  if ! flock -w "$IB_LOCK_WAIT" 9; then
    ib_fail busy "another imagebuild sync or gc still holds $CACHE/lock after ${IB_LOCK_WAIT} s ($(cat "$CACHE/lock.holder" 2>/dev/null))"
  fi
  printf '%s pid %s since %s\n' "$(hostname 2>/dev/null)" "$$" "$(date -u +%Y-%m-%dT%H:%M:%SZ)" > "$CACHE/lock.holder"
  mkdir -p "$CACHE/incoming" "$CACHE/stage" "$CACHE/tmp" "$CACHE/pending" "$CACHE/records" \
           "$CACHE/receipts" "$CACHE/attempts" || ib_fail io "cannot create folders under $CACHE"
}
ib_start_time() {  # the start time of process $1 (clock ticks since boot: /proc/PID/stat field 22), or nothing
  [ -r "/proc/$1/stat" ] && sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f20
}
ib_end_dead_holder() {  # $1 lock name, $2 the sender token of a holder whose sender is gone (the sender's
                        # machine says so: its process no longer runs). When the holder record still names
                        # that sender, its session's shell (pid and start time from the record) is ended:
                        # it waits for a call that never comes. A step it runs keeps the lock (fd 8) until
                        # it ends, as when the sender dies with the connection up.
  ib_h=$(cat "$CACHE/locks/$1.holder" 2>/dev/null) || return 0
  case " $ib_h " in *" sender $2 "*) ;; *) return 0 ;; esac
  ib_p=$(printf '%s\n' "$ib_h" | sed -n 's/^.* pid \([0-9][0-9]*\) start \([0-9][0-9]*\) .*$/\1/p')
  ib_s=$(printf '%s\n' "$ib_h" | sed -n 's/^.* pid \([0-9][0-9]*\) start \([0-9][0-9]*\) .*$/\2/p')
  [ -n "$ib_p" ] && [ -n "$ib_s" ] && [ "$(ib_start_time "$ib_p")" = "$ib_s" ] || return 0
  printf '@@ended %s\n' "$ib_h"
  kill -TERM "$ib_p" 2>/dev/null
  return 0
}
ib_hold() {  # $1 lock name (hex), $2 seconds to wait, $3 run id, $4 the sender's token (BOOT:PID:START),
             # $5 the token of a holder's sender that is gone, or -. Run by the session's own shell (LOOP's
             # @@hold), not a call: fd 8 of the session holds $CACHE/locks/$1.lock until the session ends
             # (the sender gone, the step that runs finished). One sync of one image to this peer at a time.
             # Says the holder before this one (@@previous): the probe saw it too if nothing ran between.
  case "$1" in ''|*[!0-9a-f]*) printf '@@error usage bad lock name\n'; return 3 ;; esac
  case "$2" in ''|*[!0-9]*) printf '@@error usage bad lock wait\n'; return 3 ;; esac
  case "${4:--}" in *[!0-9a-f:-]*) printf '@@error usage bad sender\n'; return 3 ;; esac
  case "${5:--}" in *[!0-9a-f:-]*) printf '@@error usage bad sender\n'; return 3 ;; esac
  command -v flock >/dev/null 2>&1 || { printf '@@error tools flock not found on the peer (util-linux)\n'; return 3; }
  mkdir -p "$CACHE/locks" 2>/dev/null
  ( : >> "$CACHE/locks/$1.lock" ) 2>/dev/null || { printf '@@error io cannot open %s\n' "$CACHE/locks/$1.lock"; return 3; }
  exec 8>>"$CACHE/locks/$1.lock"
  ib_got=
  flock -n 8 && ib_got=1
  if [ -z "$ib_got" ] && [ "${5:--}" != - ]; then
    ib_end_dead_holder "$1" "$5"
    flock -w 2 8 && ib_got=1
  fi
  if [ -z "$ib_got" ]; then
    printf '@@waiting %s\n' "$(cat "$CACHE/locks/$1.holder" 2>/dev/null)"
    if ! flock -w "$2" 8; then
      printf '@@error busy another imagebuild sync of this image to this peer still runs after %s s (%s)\n' \
        "$2" "$(cat "$CACHE/locks/$1.holder" 2>/dev/null)"
      exec 8>&-
      return 3
    fi
  fi
  printf '@@previous %s\n' "$(cat "$CACHE/locks/$1.holder" 2>/dev/null)"
  printf '%s pid %s start %s since %s run %s sender %s\n' "$(hostname 2>/dev/null)" "$$" "$(ib_start_time $$)" \
    "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "${3:--}" "${4:--}" > "$CACHE/locks/$1.holder" 2>/dev/null
  printf '@@held %s\n' "$1"
  return 0
}
ib_put() {  # ib_put PATH: stdin -> PATH, atomically (PATH is relative to $CACHE)
  mkdir -p "$(dirname "$CACHE/$1")" || ib_fail io "cannot create $(dirname "$CACHE/$1")"
  cat > "$CACHE/$1.tmp.$$" && mv -f "$CACHE/$1.tmp.$$" "$CACHE/$1" || { rm -f "$CACHE/$1.tmp.$$"; ib_fail io "cannot write $CACHE/$1"; }
}
ib_put_b64() {  # ib_put_b64 PATH: base64 on stdin -> PATH (exact bytes), atomically
  mkdir -p "$(dirname "$CACHE/$1")" || ib_fail io "cannot create $(dirname "$CACHE/$1")"
  base64 -d > "$CACHE/$1.tmp.$$" && mv -f "$CACHE/$1.tmp.$$" "$CACHE/$1" || { rm -f "$CACHE/$1.tmp.$$"; ib_fail io "cannot write $CACHE/$1"; }
}
ib_list_files() {  # size mtime name of the files directly in folder $1
  [ -d "$1" ] || return 0
  for f in "$1"/* "$1"/.[!.]*; do
    [ -f "$f" ] && stat -c '%s %Y %n' "$f"
  done
  return 0
}
ib_cat_json() {  # each *.json of folder $1 on one line, prefixed with its mtime
  [ -d "$1" ] || return 0
  for f in "$1"/*.json; do
    [ -f "$f" ] && printf '%s %s\n' "$(stat -c %Y "$f")" "$(tr -d '\n' < "$f")"
  done
  return 0
}
ib_docker_ok() {
  ib_have docker || ib_fail nodocker "docker: command not found on the peer (PATH=$PATH)"
  out=$(docker version --format '{{.Server.Version}}' 2>&1 </dev/null) || ib_fail noengine "the peer's Docker engine does not answer: $(printf '%s' "$out" | tail -n 1)"
}
ib_images() {  # id, tags, diff ids of every image
  docker image ls -aq --no-trunc </dev/null | sort -u | xargs -r docker image inspect \
    --format '{{.Id}}{{"\t"}}{{json .RepoTags}}{{"\t"}}{{json .RootFS.Layers}}'
}
ib_users() {  # running containers whose image is $1: "name (id12)"
  for c in $(docker ps -q --no-trunc </dev/null); do
    docker inspect --format '{{.Image}} {{.Name}} {{.Config.Image}}' "$c" </dev/null
  done | while read -r img name cfg; do
    [ "$img" = "$1" ] && printf '%s (%s) ' "${name#/}" "$cfg"
  done
  return 0
}
ib_verify() {  # $1 ref: inspect, listing and a real run, at once
  t=$(mktemp -d "${TMPDIR:-/tmp}/imagebuild-verify.XXXXXX") || ib_fail io "cannot create a temporary folder"
  { docker image inspect "$1" </dev/null > "$t/inspect" 2>&1; echo "$?" > "$t/inspect.rc"; } &
  docker image ls --no-trunc --format '{{.ID}} {{.Repository}}:{{.Tag}}' "${1%:*}" </dev/null > "$t/listed" 2>&1 &
  { docker run --rm --pull never --network none --log-driver none --entrypoint /bin/sh "$1" -c true \
      </dev/null > "$t/run" 2>&1; echo "$?" > "$t/run.rc"; } &
  wait
  ib_sect inspect
  cat "$t/inspect"; printf '@@rc %s\n' "$(cat "$t/inspect.rc")"
  ib_sect listed
  cat "$t/listed"
  ib_sect run
  cat "$t/run"; printf '@@rc %s\n' "$(cat "$t/run.rc")"
  rm -rf "$t"
}

ib_probe() {  # read only. $1 target ref, $2 staging ref, $3 identity hex, $4 spec hex (or -),
               # $5 ids (comma-separated) that mean "the target already is the image": then only the quick part,
               # $6 the image's sync lock name (ib_hold) or -
  ib_sect synclock
  if [ "${6:--}" != - ] && [ -f "$CACHE/locks/$6.lock" ]; then
    if flock -n "$CACHE/locks/$6.lock" true 2>/dev/null; then echo free; else echo held; fi
    printf 'holder %s\n' "$(cat "$CACHE/locks/$6.holder" 2>/dev/null)"
  else
    echo none
    printf 'holder %s\n' "$(cat "$CACHE/locks/${6:--}.holder" 2>/dev/null)"
  fi
  ib_sect meta
  printf 'agent %s\ncache %s\nhost %s\n' "1" "$CACHE" "$(hostname 2>/dev/null)"
  for t in docker rsync flock tar stat df sha256sum ctr; do printf 'tool %s %s\n' "$t" "$(command -v "$t" 2>/dev/null)"; done
  [ -d "$CACHE" ] && [ -w "$CACHE" ] && echo "cache-writable yes"
  # whether receipts must verify here (ib_signers' rule, said without failing): file | none | broken
  ib_s=${IMAGEBUILD_ALLOWED_SIGNERS:-}
  if [ "$ib_s" = none ]; then echo "signers none"
  elif [ -n "$ib_s" ]; then if [ -f "$ib_s" ]; then echo "signers file"; else echo "signers broken"; fi
  elif [ -f "${XDG_CONFIG_HOME:-$HOME/.config}/imagebuild/allowed_signers" ]; then echo "signers file"
  else echo "signers none"; fi
  # the streamed load reads a growing file by byte offsets (ib_follow): GNU dd's skip_bytes,count_bytes
  dd if=/dev/null iflag=skip_bytes,count_bytes count=0 status=none 2>/dev/null && echo "dd-bytes yes"
  ib_sect receipt
  [ "$4" != - ] && [ -f "$CACHE/receipts/$3/$4.json" ] && echo present
  [ "$4" != - ] && [ -f "$CACHE/receipts/$3/$4.json.sig" ] && echo signed
  if ib_have docker; then
    tid=$(docker image inspect --format '{{.Id}}' "$1" </dev/null 2>/dev/null)
    case ",${5:-}," in
      *",$tid,"*)
        if [ -n "$tid" ]; then
          ib_sect quick
          ib_sect target
          docker image inspect "$1" </dev/null 2>/dev/null
          ib_sect target-listed
          docker image ls --no-trunc --format '{{.ID}} {{.Repository}}:{{.Tag}}' "${1%:*}" </dev/null 2>/dev/null
          ib_sect end
          return 0
        fi ;;
    esac
  fi
  ib_sect rsync
  rsync --version 2>/dev/null | head -n 12
  ib_sect df-cache
  ib_df "$CACHE"
  if ! ib_have docker; then ib_sect end; return 0; fi
  # the engine's answers, asked at once, in as few docker calls as possible (each costs 50-200 ms)
  t=$(mktemp -d "${TMPDIR:-/tmp}/imagebuild-probe.XXXXXX") || ib_fail io "cannot create a temporary folder"
  { docker info --format '{{json .}}' </dev/null > "$t/info" 2>&1; echo "$?" > "$t/info.rc"; } &
  { docker image ls -a --no-trunc --format '{{.ID}} {{.Repository}}:{{.Tag}}' </dev/null > "$t/listed" 2>/dev/null
    cut -d' ' -f1 "$t/listed" | sort -u | xargs -r docker image inspect \
      --format '{{.Id}}{{"\t"}}{{json .RepoTags}}{{"\t"}}{{json .RootFS.Layers}}' > "$t/images" 2>&1; } &
  docker image inspect "$1" "$2" </dev/null > "$t/refs" 2>/dev/null &
  { ids=$(docker ps -q --no-trunc </dev/null)
    [ -n "$ids" ] && docker inspect --format '{{.Id}}{{"\t"}}{{.Image}}{{"\t"}}{{.Config.Image}}{{"\t"}}{{.Name}}' \
      $ids </dev/null > "$t/containers" 2>/dev/null; } &
  wait
  ib_sect info
  cat "$t/info"
  printf '@@rc %s\n' "$(cat "$t/info.rc")"
  root=$(sed -n 's/.*"DockerRootDir":"\([^"]*\)".*/\1/p' "$t/info")
  ib_sect df-docker
  ib_df "${root:-/var/lib/docker}"
  ib_sect images
  cat "$t/images" 2>/dev/null
  ib_sect target-listed
  cat "$t/listed" 2>/dev/null
  ib_sect refs
  cat "$t/refs" 2>/dev/null
  ib_sect containers
  cat "$t/containers" 2>/dev/null
  rm -rf "$t"
  # the kernel's binfmt_misc handlers: can this peer run an image of another architecture (emulation.py)
  ib_sect binfmt
  for f in /proc/sys/fs/binfmt_misc/*; do
    case "${f##*/}" in register|status) continue ;; esac
    [ -f "$f" ] && head -c 4096 "$f" 2>/dev/null | sed "s|^|${f##*/} |"
  done
  ib_sect incoming
  ib_list_files "$CACHE/incoming"
  ib_sect partial
  [ "${6:--}" != - ] && ib_list_files "$CACHE/partial/$6"
  ib_sect records
  ib_cat_json "$CACHE/records"
  ib_sect pending
  ib_cat_json "$CACHE/pending"
  ib_sect end
}

ib_signers() {  # IB_SIGNERS: the allowed-signers file receipts must verify against here; empty: not required
  IB_SIGNERS=${IMAGEBUILD_ALLOWED_SIGNERS:-}
  if [ "$IB_SIGNERS" = none ]; then IB_SIGNERS=; return 0; fi
  if [ -n "$IB_SIGNERS" ]; then
    [ -f "$IB_SIGNERS" ] || ib_fail refused "IMAGEBUILD_ALLOWED_SIGNERS on the peer names $IB_SIGNERS, which is not a file: no receipt can be verified"
    return 0
  fi
  IB_SIGNERS=${XDG_CONFIG_HOME:-$HOME/.config}/imagebuild/allowed_signers
  [ -f "$IB_SIGNERS" ] || IB_SIGNERS=
  return 0
}
ib_receipt_ok() {  # $1 receipt file, $2 its signature file (either may be absent). With an allowed-signers
                   # file here the signature must verify (namespace imagebuild-receipt): prints "signer P",
                   # or "not-required"; else IB_RECEIPT_ERR says why and it returns 1
  ib_signers
  if [ -z "$IB_SIGNERS" ]; then echo not-required; return 0; fi
  IB_RECEIPT_ERR="receipt refused: this peer requires receipts signed by a key of $IB_SIGNERS"
  [ -f "$1" ] || { IB_RECEIPT_ERR="$IB_RECEIPT_ERR, and this image comes without a gate receipt"; return 1; }
  [ -f "$2" ] || { IB_RECEIPT_ERR="$IB_RECEIPT_ERR, and the receipt is not signed"; return 1; }
  ib_have ssh-keygen || { IB_RECEIPT_ERR="$IB_RECEIPT_ERR, and ssh-keygen is not on the peer's PATH"; return 1; }
  ssh-keygen -Y find-principals -s "$2" -f "$IB_SIGNERS" </dev/null 2>/dev/null | {
    while read -r p; do
      [ -n "$p" ] || continue
      if ssh-keygen -Y verify -f "$IB_SIGNERS" -I "$p" -n imagebuild-receipt -s "$2" < "$1" >/dev/null 2>&1; then
        echo "signer $p"; exit 0
      fi
    done
    exit 1
  } && return 0
  IB_RECEIPT_ERR="$IB_RECEIPT_ERR, and its signature does not verify (an unknown signer, or the receipt was changed after it was signed)"
  return 1
}
ib_receipt_check() {  # read only: would this peer accept the receipt in $IB_RECEIPT_B64 (signature: $IB_SIG_B64)?
  ib_sect receipt-check
  ib_signers
  if [ -z "$IB_SIGNERS" ]; then echo not-required; ib_sect end; return 0; fi
  t=$(mktemp -d "${TMPDIR:-/tmp}/imagebuild-receipt.XXXXXX") || ib_fail io "cannot create a temporary folder"
  [ -n "${IB_RECEIPT_B64:-}" ] && printf '%s\n' "$IB_RECEIPT_B64" | base64 -d > "$t/r"
  [ -n "${IB_SIG_B64:-}" ] && printf '%s\n' "$IB_SIG_B64" | base64 -d > "$t/r.sig"
  ok=yes
  ib_receipt_ok "$t/r" "$t/r.sig" || ok=no
  rm -rf "$t"
  [ $ok = yes ] || ib_fail refused "$IB_RECEIPT_ERR"
  ib_sect end
}
ib_receipt_store() {  # $1 receipt path under $CACHE (and $1.sig), $2 identity hex, $3 spec hex: into receipts/
  [ -f "$CACHE/$1" ] || return 0
  mkdir -p "$CACHE/receipts/$2" || ib_fail io "cannot create $CACHE/receipts/$2"
  if [ -f "$CACHE/$1.sig" ]; then
    mv -f "$CACHE/$1.sig" "$CACHE/receipts/$2/$3.json.sig"
  else
    rm -f "$CACHE/receipts/$2/$3.json.sig"
  fi
  mv -f "$CACHE/$1" "$CACHE/receipts/$2/$3.json"
}
ib_receipt_carry() {  # $1 receipt path under $CACHE, $2 identity hex, $3 spec hex: the image is there already
  ib_sect receipt-check
  ib_receipt_ok "$CACHE/$1" "$CACHE/$1.sig" || { rm -f "$CACHE/$1" "$CACHE/$1.sig"; ib_fail refused "$IB_RECEIPT_ERR"; }
  ib_receipt_store "$1" "$2" "$3"
  ib_sect end
}

ib_prepare() {  # $1 run id, $2 the image's sync lock name (after ib_lock and the puts of pending/$1.json and
                # pending/$1.blobs). rsync writes into partial/$2/ only: a folder of this image's syncs, which
                # its sync lock (ib_hold) gives to one session at a time; so syncs of other images that share a
                # blob never write the same file. Says "have HEX" for each blob already in incoming/ (whole,
                # verified when it was moved there): those are not sent again
  case "$2" in ''|*[!0-9a-f]*) ib_fail usage "bad lock name" ;; esac
  p="$CACHE/partial/$2"
  mkdir -p "$p" || ib_fail io "cannot create $p"
  ib_sect prepared
  printf 'cache %s\n' "$CACHE"
  while read -r hex size; do
    [ -n "$hex" ] || continue
    f="$CACHE/incoming/$hex"
    if [ -f "$f" ] && [ "$(stat -c %s "$f")" = "$size" ]; then
      rm -f "$p/$hex"; echo "have $hex"; continue
    fi
    # a file longer than its blob cannot be a partial of it: rsync --append would skip it
    [ -f "$p/$hex" ] && [ "$(stat -c %s "$p/$hex")" -gt "$size" ] && rm -f "$p/$hex"
  done < "$CACHE/pending/$1.blobs"
  return 0
}

ib_others() {  # $1 this image's sync lock name, then blob hexes. Says "busy HEX LOCK" for each blob a sync of
               # another image is sending here now (partial/LOCK/HEX while that sync holds its lock). Read only.
  case "$1" in ''|*[!0-9a-f]*) ib_fail usage "bad lock name" ;; esac
  ib_own=$1; shift
  ib_sect others
  for hex in "$@"; do
    case "$hex" in ''|*[!0-9a-f]*) continue ;; esac
    for f in "$CACHE"/partial/*/"$hex"; do
      [ -f "$f" ] || continue
      n=$(basename "$(dirname "$f")")
      [ "$n" = "$ib_own" ] && continue
      if [ -f "$CACHE/locks/$n.lock" ] && ! flock -n "$CACHE/locks/$n.lock" true 2>/dev/null; then
        echo "busy $hex $n"; break
      fi
    done
  done
  return 0
}
ib_wait_locks() {  # $1 seconds, then sync lock names: waits (up to $1 s) until no session holds any of them
                   # (that sync has ended: its blobs are loaded and recorded, or it failed). Read only.
  case "$1" in ''|*[!0-9]*) ib_fail usage "bad wait" ;; esac
  ib_end=$(( $(date +%s) + $1 )); shift
  while :; do
    ib_held=
    for n in "$@"; do
      case "$n" in ''|*[!0-9a-f]*) continue ;; esac
      flock -n "$CACHE/locks/$n.lock" true 2>/dev/null || ib_held=1
    done
    [ -z "$ib_held" ] && { ib_sect waited; echo ended; return 0; }
    [ "$(date +%s)" -ge "$ib_end" ] && { ib_sect waited; echo timeout; return 0; }
    sleep 1
  done
}

ib_settle() {  # $1 run id, $2 lock name: each blob rsync wrote to partial/$2/ is hashed (outside the cache
               # lock: the folder is this session's) and, only when its content is its name, moved into
               # incoming/ (under the lock, with mv: atomic); a blob another sync put there meanwhile is reused
  case "$2" in ''|*[!0-9a-f]*) ib_fail usage "bad lock name" ;; esac
  p="$CACHE/partial/$2"
  t=$(mktemp -d "${TMPDIR:-/tmp}/imagebuild-settle.XXXXXX") || ib_fail io "cannot create a temporary folder"
  while read -r hex size; do
    [ -n "$hex" ] || continue
    [ -f "$p/$hex" ] || continue
    [ "$(stat -c %s "$p/$hex")" = "$size" ] || continue
    { sha256sum "$p/$hex" | cut -d' ' -f1 > "$t/$hex"; } &
  done < "$CACHE/pending/$1.blobs"
  wait
  ib_lock
  ib_sect settled
  bad=""
  while read -r hex size; do
    [ -n "$hex" ] || continue
    f="$CACHE/incoming/$hex"
    if [ -f "$f" ] && [ "$(stat -c %s "$f")" = "$size" ]; then
      rm -f "$p/$hex"; echo "reused $hex"; continue
    fi
    if [ ! -f "$t/$hex" ]; then
      rm -rf "$t"; ib_fail missing "blob sha256:$hex did not arrive whole in $p ($(stat -c %s "$p/$hex" 2>/dev/null || echo 0) of $size bytes)"
    fi
    got=$(cat "$t/$hex")
    if [ "$got" != "$hex" ]; then
      rm -f "$p/$hex"; bad="$bad $hex:$got"; continue
    fi
    mv -f "$p/$hex" "$f" || { rm -rf "$t"; ib_fail io "cannot move sha256:$hex into $CACHE/incoming"; }
    echo "moved $hex"
  done < "$CACHE/pending/$1.blobs"
  rm -rf "$t"
  rmdir "$p" 2>/dev/null
  [ -z "$bad" ] || ib_fail digest "blob(s) arrived with other content than their digest (removed):$bad"
  ib_sect end
}

ib_load() {  # $1 run id, $2 staging ref. stage/$1/ holds the JSON files; stage/$1.layers "hex size" lines
  d="$CACHE/stage/$1"
  mkdir -p "$d/blobs/sha256" || ib_fail io "cannot create $d"
  printf '{"imageLayoutVersion":"1.0.0"}' > "$d/oci-layout"
  while read -r hex size; do
    [ -n "$hex" ] || continue
    f="$CACHE/incoming/$hex"
    [ -f "$f" ] || { rm -rf "$d" "$d.layers"; ib_fail missing "blob sha256:$hex is not in $CACHE/incoming"; }
    have=$(stat -c %s "$f")
    [ "$have" = "$size" ] || { rm -rf "$d" "$d.layers"; ib_fail missing "blob sha256:$hex in $CACHE/incoming has $have of $size bytes"; }
    ln -f "$f" "$d/blobs/sha256/$hex" 2>/dev/null || cp "$f" "$d/blobs/sha256/$hex" || ib_fail io "cannot stage sha256:$hex"
  done < "$d.layers"
  a="$CACHE/attempts/$1.json"
  t0=$(date +%s)
  printf '{"run":"%s","started":%s,"finished":null,"status":"running"}\n' "$1" "$t0" > "$a"
  { (cd "$d" && tar -cf - .); echo "$?" > "$d.tarrc"; } | docker load -q > "$d.log" 2>&1
  rc=$?
  trc=$(cat "$d.tarrc" 2>/dev/null || echo 1)
  st=ok; { [ "$rc" = 0 ] && [ "$trc" = 0 ]; } || st=failed
  # docker load exits 0 after "Error unpacking image ..." (containerd store): that is a failed load
  grep -qi '^error' "$d.log" && st=failed
  printf '{"run":"%s","started":%s,"finished":%s,"status":"%s"}\n' "$1" "$t0" "$(date +%s)" "$st" > "$a"
  ib_sect load
  cat "$d.log"
  printf 'rc %s tar %s\n' "$rc" "$trc"
  rm -rf "$d" "$d.layers" "$d.tarrc" "$d.log"
  [ "$st" = ok ] || ib_fail load "docker load failed (exit $rc, tar $trc)"
  ib_verify "$2"
  ib_sect end
}

ib_writer() {  # is a process of this user working in folder $1 (rsync's receiver has it as its cwd)?
  for c in /proc/[0-9]*/cwd; do [ "$c" -ef "$1" ] && return 0; done
  return 1
}

ib_follow() {  # $1 file, $2 size, $3 stall seconds, $4 stall note: exactly $2 bytes of $1 to stdout while rsync
              # (--append: in place) still writes it. It ends (writing $4, failing) when the file has not grown
              # for $3 s (a frozen link), or for 1 s once rsync's receiver, seen at work before, is gone (a cut
              # link: its ssh channel closed)
  sent=0; quiet=0
  while [ "$sent" -lt "$2" ]; do
    now=$(stat -c %s "$1" 2>/dev/null || echo 0)
    [ "$now" -gt "$2" ] && now=$2
    if [ "$now" -gt "$sent" ]; then
      dd if="$1" bs=1M iflag=skip_bytes,count_bytes skip="$sent" count=$((now - sent)) status=none || return 1
      [ "$sent" -gt 0 ] && IB_WRITER=seen  # it grew while followed: rsync writes it
      sent=$now; quiet=0
    else
      quiet=$((quiet + 1))
      [ "$quiet" = 1 ] && since=$(date +%s)
      if [ $((quiet % 20)) = 0 ]; then
        if [ $(($(date +%s) - since)) -ge "$3" ]; then
          echo "sha256:${1##*/} stopped at $now of $2 bytes" > "$4"; return 1
        fi
        if ib_writer "${1%/*}"; then IB_WRITER=seen
        elif [ "${IB_WRITER:-}" = seen ]; then
          echo "sha256:${1##*/} stopped at $now of $2 bytes: the transfer ended (rsync is gone)" > "$4"; return 1
        fi
      fi
      sleep 0.05
    fi
  done
}

ib_stream_tar() {  # $1 stage dir, $2 partial dir, $3 stall seconds: the image as one tar on stdout, the layer
                  # blobs first in stage/$1.layers order (rsync's), each from its tar header ($1.hdr/HEX, made by
                  # the sender) and its bytes as they arrive (ib_follow; a blob already in incoming/: from there);
                  # then the index, manifests, config and layout files, and the end of the archive. containerd's
                  # import takes each blob into its content store as it comes: it digests it on the way
  meta=$(ls "$1/blobs/sha256")
  IB_WRITER=
  while read -r hex size; do
    [ -n "$hex" ] || continue
    cat "$1.hdr/$hex" || return 1
    f="$CACHE/incoming/$hex"
    if [ -f "$f" ] && [ "$(stat -c %s "$f")" = "$size" ]; then
      cat "$f" || return 1
    else
      ib_follow "$2/$hex" "$size" "$3" "$1.stall" || return 1
    fi
    pad=$(( (512 - size % 512) % 512 ))
    [ "$pad" = 0 ] || head -c "$pad" /dev/zero
  done < "$1.layers"
  names=""
  for x in $meta; do names="$names blobs/sha256/$x"; done
  # shellcheck disable=SC2086 # the names are hex digests
  (cd "$1" && tar -cf - --no-recursion --owner=0 --group=0 --numeric-owner $names oci-layout index.json manifest.json)
}

ib_load_stream() {  # $1 run id, $2 staging ref, $3 lock name, $4 stall seconds: like ib_load, but docker load
                    # starts while rsync still writes the blobs into partial/$3/ (stage/$1.layers: their order)
  case "$3" in ''|*[!0-9a-f]*) ib_fail usage "bad lock name" ;; esac
  d="$CACHE/stage/$1"; p="$CACHE/partial/$3"
  mkdir -p "$d/blobs/sha256" "$p" || ib_fail io "cannot create $d"
  printf '{"imageLayoutVersion":"1.0.0"}' > "$d/oci-layout"
  a="$CACHE/attempts/$1.json"
  t0=$(date +%s)
  printf '{"run":"%s","started":%s,"finished":null,"status":"running"}\n' "$1" "$t0" > "$a"
  { ib_stream_tar "$d" "$p" "$4"; echo "$?" > "$d.tarrc"; } | docker load -q > "$d.log" 2>&1
  rc=$?
  trc=$(cat "$d.tarrc" 2>/dev/null || echo 1)
  st=ok; { [ "$rc" = 0 ] && [ "$trc" = 0 ]; } || st=failed
  grep -qi '^error' "$d.log" && st=failed
  [ -f "$d.stall" ] && st=failed
  printf '{"run":"%s","started":%s,"finished":%s,"status":"%s"}\n' "$1" "$t0" "$(date +%s)" "$st" > "$a"
  ib_sect load
  cat "$d.log"
  [ -f "$d.stall" ] && printf 'stalled %s\n' "$(cat "$d.stall")"
  printf 'rc %s tar %s\n' "$rc" "$trc"
  if [ "$st" = ok ]; then  # the engine holds the blobs now (its content store checked each digest)
    while read -r hex size; do [ -n "$hex" ] && rm -f "$p/$hex"; done < "$d.layers"
    rmdir "$p" 2>/dev/null
  fi
  rm -rf "$d" "$d.layers" "$d.hdr" "$d.tarrc" "$d.log" "$d.stall"
  [ "$st" = ok ] || ib_fail load "docker load failed (exit $rc, tar $trc)"
  ib_verify "$2"
  ib_sect end
}

ib_verify_step() {  # $1 ref: verify an image already on the peer (under the lock: a load may still run)
  ib_docker_ok
  ib_verify "$1"
  ib_sect end
}

ib_check() {  # $1 run id: hash every complete blob the run names; remove those whose content is not their name
  [ -f "$CACHE/pending/$1.blobs" ] || { ib_sect end; return 0; }
  ib_sect check
  while read -r hex size; do
    f="$CACHE/incoming/$hex"
    [ -f "$f" ] || continue
    [ "$(stat -c %s "$f")" -ge "$size" ] || continue
    got=$(sha256sum "$f" | cut -d' ' -f1)
    if [ "$got" != "$hex" ]; then rm -f "$f"; echo "bad $hex $got"; else echo "good $hex"; fi
  done < "$CACHE/pending/$1.blobs"
  ib_sect end
}

ib_untag() {  # $1 staging ref: untag it (only ever our own incoming name)
  case "$1" in imagebuild-incoming:*) docker image rm "$1" >/dev/null 2>&1 </dev/null ;; esac
  return 0
}

ib_finish() {  # $1 run id: forget the run (pending record) and the blobs no other pending run needs
  if [ -f "$CACHE/pending/$1.blobs" ]; then
    while read -r hex size; do
      [ -n "$hex" ] || continue
      other=no
      for o in "$CACHE"/pending/*.blobs; do
        [ "$o" = "$CACHE/pending/$1.blobs" ] && continue
        [ -f "$o" ] && grep -q "^$hex " "$o" && other=yes
      done
      [ $other = no ] && rm -f "$CACHE/incoming/$hex"
    done < "$CACHE/pending/$1.blobs"
  fi
  rm -f "$CACHE/pending/$1.json" "$CACHE/pending/$1.blobs"
  # a load attempt that did not end well stays on record: gc --peer matches the engine's leases against
  # it (a load cut on the peer, its engine killed, leaves one); gc --peer removes the record then
  if [ -f "$CACHE/attempts/$1.json" ] && ! grep -q '"status":"ok"' "$CACHE/attempts/$1.json"; then :; else
    rm -f "$CACHE/attempts/$1.json"
  fi
}

ib_promote() {  # $1 run id, $2 verified image id, $3 target ref, $4 previous ref or -, $5 staging ref or -,
                # $6 force 0/1, $7 identity hex, $8 spec hex or -. Receipt and record were put to tmp/$1.*
  ib_have docker || ib_fail nodocker "docker: command not found on the peer"
  id=$(docker image inspect --format '{{.Id}}' "$2" </dev/null 2>/dev/null) || ib_fail missing "the verified image $2 is no longer on the peer"
  # the receipt this tag moves on, checked again under the lock, just before the tag moves
  ib_sect receipt-check
  ib_receipt_ok "$CACHE/tmp/$1.receipt" "$CACHE/tmp/$1.receipt.sig" || {
    rm -f "$CACHE/tmp/$1.receipt" "$CACHE/tmp/$1.receipt.sig"; [ "$5" != - ] && ib_untag "$5"; ib_fail refused "$IB_RECEIPT_ERR"; }
  old=$(docker image inspect --format '{{.Id}}' "$3" </dev/null 2>/dev/null) || old=""
  moved=no
  if [ "$old" != "$id" ]; then
    if [ -n "$old" ]; then
      users=$(ib_users "$old")
      if [ -n "$users" ] && [ "$6" != 1 ]; then
        ib_fail refused "running containers use $3 ($old): $users"
      fi
      if [ "$4" != - ]; then
        docker tag "$old" "$4" </dev/null || ib_fail tag "docker tag $old $4 failed"
      fi
    fi
    docker tag "$id" "$3" </dev/null || ib_fail tag "docker tag $id $3 failed"
    moved=yes
  fi
  [ "$5" != - ] && ib_untag "$5"
  [ "$8" != - ] && ib_receipt_store "tmp/$1.receipt" "$7" "$8"
  [ -f "$CACHE/tmp/$1.record" ] && mv -f "$CACHE/tmp/$1.record" "$CACHE/records/$7.json"
  # earlier runs of this very image that were interrupted are done now too
  for o in "$CACHE"/pending/*.json; do
    [ -f "$o" ] || continue
    r=$(basename "$o" .json)
    [ "$r" != "$1" ] && grep -q "sha256:$7" "$o" && ib_finish "$r"
  done
  ib_finish "$1"
  ib_sect promoted
  printf 'moved %s\nlocal %s\nprevious %s\n' "$moved" "$id" "$old"
  ib_sect end
}

ib_abort() {  # $1 run id, $2 staging ref or -: a verification failed; untag what was loaded
  [ "$2" != - ] && ib_untag "$2"
  rm -f "$CACHE/attempts/$1.json"
  ib_sect end
}

ib_gc_list() {  # read only: what the peer cache holds
  ib_sect meta
  printf 'cache %s\n' "$CACHE"
  for t in docker ctr; do printf 'tool %s %s\n' "$t" "$(command -v "$t" 2>/dev/null)"; done
  [ -e "$CACHE/lock" ] && { ib_have flock && flock -n "$CACHE/lock" true && echo "lock free" || echo "lock held $(cat "$CACHE/lock.holder" 2>/dev/null)"; }
  now=$(date +%s); echo "now $now"
  ib_sect incoming
  ib_list_files "$CACHE/incoming"
  [ -d "$CACHE/partial" ] && for d in "$CACHE"/partial/*; do [ -d "$d" ] && ib_list_files "$d"; done
  ib_sect stage
  [ -d "$CACHE/stage" ] && for f in "$CACHE"/stage/*; do [ -e "$f" ] && printf '%s %s\n' "$(du -sk "$f" | cut -f1)" "$f"; done
  ib_sect tmp
  ib_list_files "$CACHE/tmp"
  ib_list_files "$CACHE"
  ib_sect pending
  ib_cat_json "$CACHE/pending"
  ib_sect records
  ib_cat_json "$CACHE/records"
  ib_sect attempts
  ib_cat_json "$CACHE/attempts"
  ib_sect receipts
  [ -d "$CACHE/receipts" ] && for f in "$CACHE"/receipts/*/*.json "$CACHE"/receipts/*/*.json.sig; do [ -f "$f" ] && stat -c '%s %Y %n' "$f"; done
  if ib_have docker && docker version >/dev/null 2>&1 </dev/null; then
    ib_sect images
    ib_images 2>&1
    ib_sect containerd
    docker info --format '{{.Driver}}{{"\t"}}{{json .Containerd}}{{"\t"}}{{.DockerRootDir}}' </dev/null 2>&1
    addr=$(docker info --format '{{json .Containerd}}' </dev/null 2>/dev/null | sed -n 's/.*"Address":"\([^"]*\)".*/\1/p')
    if [ -z "$addr" ]; then
      for c in /run/containerd/containerd.sock /var/run/docker/containerd/containerd.sock; do
        [ -S "$c" ] && { addr=$c; break; }
      done
    fi
    ib_sect leases
    echo "address ${addr:--}"
    [ -n "$addr" ] && ib_leases "$addr"
  fi
  ib_sect end
}

ib_leases() {  # $1 containerd address: the moby namespace's leases
  ib_have ctr || { echo "unavailable ctr not found on the peer"; return 0; }
  [ -S "$1" ] || { echo "unavailable no containerd socket at $1"; return 0; }
  out=$(ctr -a "$1" -n moby leases ls 2>&1 </dev/null) || { echo "unavailable $(printf '%s' "$out" | tail -n 1)"; return 0; }
  printf '%s\n' "$out"
}

ib_gc_apply() {  # the actions, one a line: "rm PATH" (under $CACHE), "untag REF", "lease ADDRESS ID"
  while read -r act a b; do
    case "$act" in
      rm)
        case "$a" in "$CACHE"/*) rm -rf "$a" && echo "removed $a" ;; *) echo "refused $a (outside $CACHE)" ;; esac ;;
      rmblob)  # an incoming blob: only when no pending sync (left after the removals above) names it
        if ls "$CACHE"/pending/*.blobs >/dev/null 2>&1 && grep -q "^$b " "$CACHE"/pending/*.blobs 2>/dev/null; then
          echo "kept $a (a sync started meanwhile needs it)"
        else
          case "$a" in "$CACHE"/incoming/*|"$CACHE"/partial/*) rm -f "$a" && echo "removed $a" ;; esac
        fi ;;
      untag) ib_untag "$a" && echo "untagged $a" ;;
      lease) ctr -a "$a" -n moby leases rm --sync "$b" </dev/null >/dev/null 2>&1 && echo "lease $b" || echo "lease-failed $b" ;;
    esac
  done < "$CACHE/tmp/gc.actions"
  rm -f "$CACHE/tmp/gc.actions"
  [ -d "$CACHE/partial" ] && for d in "$CACHE"/partial/*; do [ -d "$d" ] && rmdir "$d" 2>/dev/null; done
  ib_sect end
}
"""


# The session: after the library, frames "@@call ID N" + N bytes of script, each run in a subshell
# (an ib_fail ends only that call) with stdin from /dev/null (no command may read the channel).
LOOP = r"""
printf '@@ready %s\n' 1
while IFS=' ' read -r ib_tag ib_id ib_n; do
  if [ "$ib_tag" = "@@hold" ]; then  # @@hold NAME WAIT: in this shell, so that the lock lasts the session
    set -f; set -- $ib_n; set +f
    ib_hold "$ib_id" "${1:-}" "${2:--}" "${3:--}" "${4:--}" </dev/null 2>&1
    printf '@@done hold %s\n' "$?"
    continue
  fi
  [ "$ib_tag" = "@@call" ] || continue
  ib_chunk=$(head -c "$ib_n")
  ( eval "$ib_chunk" ) </dev/null 2>&1
  printf '@@done %s %s\n' "$ib_id" "$?"
done
exit 0
"""


def heredoc(path: str, text: str) -> str:
    """A step line that writes ``text`` to ``$CACHE/path`` atomically (quoted here-document: no expansion)."""
    tag = "IBEOF_" + uuid.uuid4().hex
    if not text.endswith("\n"):
        text += "\n"
    return f"ib_put {shlex.quote(path)} <<'{tag}'\n{text}{tag}\n"


def heredoc_bytes(path: str, data: bytes) -> str:
    """Like ``heredoc`` for exact bytes (base64 on the way)."""
    import base64

    tag = "IBEOF_" + uuid.uuid4().hex
    b64 = base64.encodebytes(data).decode()
    return f"ib_put_b64 {shlex.quote(path)} <<'{tag}'\n{b64}{tag}\n"


def shell_var(name: str, data: bytes | None) -> str:
    """A step line that sets the shell variable ``name`` to ``data`` in base64 (empty for None): data a
    read-only step needs, without writing a file."""
    import base64

    if not data:
        return f"{name}=\n"
    tag = "IBEOF_" + uuid.uuid4().hex
    return f"{name}=$(cat <<'{tag}'\n{base64.encodebytes(data).decode()}{tag}\n)\n"


def call(step: str, *args: str) -> str:
    return " ".join([step, *(shlex.quote(a) for a in args)]) + "\n"


def script(*lines: str) -> str:
    """The text of one call (the session holds the library already)."""
    return "ib_main() {\n" + "".join(lines) + "}\nib_main\n"
