# Sourced by the netns bench scripts: N hosts (network namespaces) on one bridge, each with
# its own 10.213.X.(i+1)/24 address, and links limited by `tc tbf` both ways (burst 64kb,
# latency 50ms, as in the tests' `Net::throttle`). Needs root and iproute2.
#
#   netns_hosts_up PEERS       creates the hub and hosts; sets $hosts (array) and $ns_list
#   netns_throttle RATE VERB   VERB add (first time) or change, RATE e.g. 100mbit
#   netns_hosts_down           deletes them (trap it on EXIT)
#   netns_need_root_and_bin    checks root and an executable $bin; makes $bin absolute

netns_tag="sb$$"
netns_hub="$netns_tag-hub"
hosts=()
ns_list=""

netns_hosts_down() {
  for h in "${hosts[@]}"; do ip netns del "$h" 2>/dev/null || true; done
  ip netns del "$netns_hub" 2>/dev/null || true
}

netns_hosts_up() {
  local peers="$1" i h tag="$netns_tag"
  ip netns add "$netns_hub"
  ip -n "$netns_hub" link add br0 type bridge
  ip -n "$netns_hub" link set br0 up
  for i in $(seq 0 $((peers - 1))); do
    h="$tag-$i"
    hosts+=("$h")
    ip netns add "$h"
    ip link add "v$tag$i" type veth peer name "o$tag$i"
    ip link set "v$tag$i" netns "$h"
    ip link set "o$tag$i" netns "$netns_hub"
    ip -n "$h" link set "v$tag$i" name eth0
    ip -n "$h" addr add "10.213.$(( $$ % 250 )).$((i + 1))/24" dev eth0
    ip -n "$h" link set eth0 up
    ip -n "$h" link set lo up
    ip -n "$netns_hub" link set "o$tag$i" master br0
    ip -n "$netns_hub" link set "o$tag$i" up
  done
  ns_list="$(IFS=,; echo "${hosts[*]}")"
}

netns_throttle() {
  local rate="$1" verb="$2" i
  for i in $(seq 0 $((${#hosts[@]} - 1))); do
    tc -n "$netns_tag-$i" qdisc "$verb" dev eth0 root tbf rate "$rate" burst 64kb latency 50ms
    tc -n "$netns_hub" qdisc "$verb" dev "o$netns_tag$i" root tbf rate "$rate" burst 64kb latency 50ms
  done
}

netns_need_root_and_bin() {
  [ -x "$bin" ] || { echo "no starling binary at $bin (cargo build --release, or --bin)" >&2; exit 2; }
  [ "$(id -u)" = 0 ] || { echo "needs root (network namespaces)" >&2; exit 2; }
  bin="$(realpath "$bin")"
}
