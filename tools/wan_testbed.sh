#!/usr/bin/env bash
# The packet-level WAN test bed: one network namespace per node of a detour
# ClusterSpec, joined by detour-wanem (a userspace forwarder with one TUN
# device per namespace) that gives every ordered pair of nodes the spec's
# one-way latency and bandwidth. docs/OPERATIONS.md §"The WAN test bed".
#
#   tools/wan_testbed.sh up --cluster FILE --prefix NAME [--bandwidth_scale X]
#       [--subnet CIDR] [--set 'SRC DST [both] key=value...; ...'] [--seed N]
#       [--binary PATH] [-- more detour-wanem flags]
#   tools/wan_testbed.sh down --prefix NAME
#   tools/wan_testbed.sh exec --prefix NAME NODE -- CMD [ARGS...]
#   tools/wan_testbed.sh ctl --prefix NAME CMD...     (a control command)
#   tools/wan_testbed.sh nodes --prefix NAME          (the node table again)
#
# `up` makes namespaces <prefix>-<node id>, starts the forwarder, waits until
# it answers, and prints node, region, address and namespace. `down` stops the
# forwarder and the processes left in those namespaces, and deletes exactly
# the namespaces `up` recorded. The prefix keeps test beds apart: several can
# run side by side (each namespace has its own copy of the subnet). State
# lives in $DETOUR_WAN_STATE/<prefix> (default /run/detour-wanem). Needs root
# (CAP_NET_ADMIN for namespaces and TUN devices, CAP_SYS_ADMIN for setns).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
state_root=${DETOUR_WAN_STATE:-/run/detour-wanem}
prog=wan_testbed

die() { echo "$prog: $*" >&2; exit 1; }
usage() { echo "$prog: $*" >&2; echo "usage: see the top of $0" >&2; exit 2; }

check_prefix() {
  [[ -n "${prefix:-}" ]] || usage "--prefix NAME is required"
  [[ "$prefix" =~ ^[A-Za-z0-9][A-Za-z0-9_.-]{0,31}$ ]] ||
    usage "--prefix '$prefix': use 1 to 32 letters, digits, '.', '_' or '-' (not first)"
  state="$state_root/$prefix"
}

# The effective capability set, so a missing capability is named before any
# command fails halfway.
check_privileges() {
  local caps
  caps=$(awk '/^CapEff:/ {print $2}' /proc/self/status)
  if (( ((16#$caps) >> 12 & 1) == 0 )); then
    die "needs CAP_NET_ADMIN (run as root) to create network namespaces and TUN devices"
  fi
  if (( ((16#$caps) >> 21 & 1) == 0 )); then
    die "needs CAP_SYS_ADMIN (run as root): the forwarder enters each namespace (setns)"
  fi
  [[ -c /dev/net/tun ]] || die "/dev/net/tun is missing (load the tun module: modprobe tun)"
  command -v ip >/dev/null || die "ip is missing (Debian: iproute2; tools/install_deps.sh)"
}

find_binary() {
  if [[ -n "${binary:-}" ]]; then
    [[ -x "$binary" ]] || die "--binary $binary is not an executable"
  elif [[ -n "${DETOUR_WANEM:-}" ]]; then
    binary=$DETOUR_WANEM
  elif [[ -x "$root/build/tools/detour_wanem/detour-wanem" ]]; then
    binary="$root/build/tools/detour_wanem/detour-wanem"
  elif command -v detour-wanem >/dev/null; then
    binary=$(command -v detour-wanem)
  else
    die "detour-wanem not found: build it (cmake --build build --target detour_wanem) or pass --binary"
  fi
}

# The forwarder's pid when it is still the process we started.
forwarder_pid() {
  local pid
  [[ -f "$state/pid" ]] || return 1
  pid=$(<"$state/pid")
  [[ "$pid" =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null &&
    tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q -- "--netns_prefix $prefix " &&
    echo "$pid"
}

do_down() {
  local pid i ns
  if [[ ! -d "$state" ]]; then
    echo "$prog: nothing is up for prefix $prefix ($state does not exist)"
    return 0
  fi
  if pid=$(forwarder_pid); then
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < 50; i++)); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
    if kill -0 "$pid" 2>/dev/null; then
      echo "$prog: forwarder $pid ignored SIGTERM for 5 s; killing it" >&2
      kill -KILL "$pid" 2>/dev/null || true
    fi
  fi
  if [[ -f "$state/netns" ]]; then
    while read -r ns; do
      [[ -n "$ns" ]] || continue
      # Servers a test left running would keep the namespace alive.
      ip netns pids "$ns" 2>/dev/null | xargs -r kill -KILL 2>/dev/null || true
      ip netns delete "$ns" 2>/dev/null || echo "$prog: could not delete namespace $ns" >&2
    done <"$state/netns"
  fi
  rm -rf "$state"
  echo "$prog: $prefix is down"
}

do_up() {
  local cluster="" scale=1 subnet=10.77.0.0/16 set_arg="" seed=1 extra=() ids=() line ns i
  while [[ $# -gt 0 ]]; do
    case "$1" in
      --cluster) cluster=${2:?--cluster needs a file}; shift 2 ;;
      --prefix) prefix=${2:?--prefix needs a name}; shift 2 ;;
      --bandwidth_scale) scale=${2:?--bandwidth_scale needs a number}; shift 2 ;;
      --subnet) subnet=${2:?--subnet needs A.B.C.D/LEN}; shift 2 ;;
      --set) set_arg=${2:?--set needs overrides}; shift 2 ;;
      --seed) seed=${2:?--seed needs a number}; shift 2 ;;
      --binary) binary=${2:?--binary needs a path}; shift 2 ;;
      --) shift; extra=("$@"); break ;;
      *) usage "up: unknown argument '$1'" ;;
    esac
  done
  check_prefix
  [[ -n "$cluster" ]] || usage "up: --cluster FILE is required"
  [[ -r "$cluster" ]] || die "up: cannot read --cluster $cluster"
  check_privileges
  find_binary
  [[ ! -e "$state" ]] || die "up: $prefix is already up ($state exists); run: $0 down --prefix $prefix"
  # The forwarder validates the spec and names the nodes (and so the namespaces).
  local table
  table=$("$binary" nodes --cluster "$cluster" --subnet "$subnet") || die "up: bad cluster or subnet"
  while read -r line; do ids+=("${line%% *}"); done <<<"$table"
  for i in "${ids[@]}"; do
    if ip netns list | awk '{print $1}' | grep -qxF -- "$prefix-$i"; then
      die "up: namespace $prefix-$i exists but is not this test bed's; remove it or pick another prefix"
    fi
  done

  mkdir -p "$state"
  echo "$binary" >"$state/binary"
  : >"$state/netns"
  trap 'echo "$prog: up failed; cleaning up" >&2; do_down >&2' ERR
  for i in "${ids[@]}"; do
    ns="$prefix-$i"
    ip netns add "$ns"
    echo "$ns" >>"$state/netns"
    # IPv4 only: the forwarder drops IPv6 (router solicitations would only add noise).
    ip netns exec "$ns" sysctl -qw net.ipv6.conf.all.disable_ipv6=1 net.ipv6.conf.default.disable_ipv6=1
  done

  setsid "$binary" --cluster "$cluster" --netns_prefix "$prefix" --socket "$state/ctl.sock" \
    --subnet "$subnet" --bandwidth_scale "$scale" --seed "$seed" --set "$set_arg" \
    ${extra[@]+"${extra[@]}"} </dev/null >"$state/wanem.log" 2>&1 &
  echo $! >"$state/pid"
  # Ready when it answers on its socket: at most 10 s.
  for ((i = 0; i < 100; i++)); do
    if "$binary" ctl --socket "$state/ctl.sock" --timeout 1s ping >/dev/null 2>&1; then break; fi
    if ! kill -0 "$(<"$state/pid")" 2>/dev/null; then
      echo "$prog: detour-wanem exited during start-up; its log:" >&2
      tail -n 20 "$state/wanem.log" >&2
      false
    fi
    sleep 0.1
  done
  if ! "$binary" ctl --socket "$state/ctl.sock" --timeout 1s ping >/dev/null 2>&1; then
    echo "$prog: detour-wanem did not answer within 10 s; its log:" >&2
    tail -n 20 "$state/wanem.log" >&2
    false
  fi
  trap - ERR
  print_nodes
}

print_nodes() {
  local id region address
  printf '%-16s %-16s %-15s %s\n' node region address namespace
  "$binary" ctl --socket "$state/ctl.sock" nodes | while read -r id region address; do
    [[ "$id" == ok ]] && continue
    printf '%-16s %-16s %-15s %s\n' "$id" "$region" "$address" "$prefix-$id"
  done
}

load_state() {
  check_prefix
  [[ -d "$state" ]] || die "$prefix is not up ($state does not exist)"
  binary=$(<"$state/binary")
}

cmd=${1:-}
[[ $# -gt 0 ]] && shift
prefix=""
case "$cmd" in
  up) do_up "$@" ;;
  down)
    [[ "${1:-}" == --prefix && $# -eq 2 ]] || usage "down --prefix NAME"
    prefix=$2; check_prefix; check_privileges; do_down ;;
  exec)
    [[ "${1:-}" == --prefix && $# -ge 5 && "${4:-}" == -- ]] || usage "exec --prefix NAME NODE -- CMD..."
    prefix=$2; node=$3; shift 4
    load_state
    grep -qxF -- "$prefix-$node" "$state/netns" || die "exec: no node $node in $prefix"
    exec ip netns exec "$prefix-$node" "$@" ;;
  ctl)
    [[ "${1:-}" == --prefix && $# -ge 3 ]] || usage "ctl --prefix NAME CMD..."
    prefix=$2; shift 2
    load_state
    exec "$binary" ctl --socket "$state/ctl.sock" "$@" ;;
  nodes)
    [[ "${1:-}" == --prefix && $# -eq 2 ]] || usage "nodes --prefix NAME"
    prefix=$2; load_state; print_nodes ;;
  ""|-h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' ;;
  *) usage "unknown command '$cmd' (up, down, exec, ctl, nodes)" ;;
esac
