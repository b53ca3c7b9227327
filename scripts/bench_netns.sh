#!/usr/bin/env bash
# Starling's all-reduce against the plain-TCP reference butterfly between 4 hosts with real,
# throttled links (issue #15): 4 network namespaces on one bridge, each host's upload and
# download limited by `tc tbf` (burst 64kb, latency 50ms, as in the tests' `Net::throttle`).
# For every rate x size x codec it runs, in one go,
#   starling bench allreduce --procs --netns <the 4 hosts> --reference
# from inside the first host (the bootstrap node lives there; the workers listen on all
# interfaces, with the node's defaults), prints each JSON result on stderr and a table on stdout:
#   rate size codec starling_s reference_s ratio warm_share max_rel_error
# Needs root, iproute2 (`ip`, `tc`). Deletes its namespaces on exit, also on failure.
#
# Usage: sudo scripts/bench_netns.sh [--bin PATH] [--rates "500mbit 100mbit"]
#          [--sizes "1000000 10000000"] [--codecs "none f16 u8"] [--rounds 5] [--peers 4]
#          [-- extra arguments for bench allreduce]
set -euo pipefail
cd "$(dirname "$0")/.."

bin=target/release/starling
rates="500mbit 100mbit"
sizes="1000000 10000000"
codecs="none f16 u8"
rounds=5
peers=4
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --bin) bin="$2"; shift 2 ;;
    --rates) rates="$2"; shift 2 ;;
    --sizes) sizes="$2"; shift 2 ;;
    --codecs) codecs="$2"; shift 2 ;;
    --rounds) rounds="$2"; shift 2 ;;
    --peers) peers="$2"; shift 2 ;;
    --) shift; extra=("$@"); break ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done

. scripts/netns_hosts.sh
netns_need_root_and_bin
trap netns_hosts_down EXIT
netns_hosts_up "$peers"

field() { # field NAME JSON: the first numeric value of "NAME" in JSON
  printf '%s' "$2" | grep -o "\"$1\":[-0-9.e+]*" | head -n1 | cut -d: -f2
}

printf '%-8s %-9s %-5s %10s %12s %7s %6s %10s\n' rate size codec starling_s reference_s ratio warm max_err
verb=add
for rate in $rates; do
  netns_throttle "$rate" "$verb"
  verb=change
  for size in $sizes; do
    for codec in $codecs; do
      out="$(ip netns exec "${hosts[0]}" "$bin" bench allreduce --procs --netns "$ns_list" \
        --peers "$peers" --size "$size" --codec "$codec" --rounds "$rounds" --reference \
        "${extra[@]}" | tail -n1)"
      echo "$rate $out" >&2
      starling="$(field median_allreduce_s "$out")"
      reference="$(printf '%s' "$out" | grep -o '"reference":{.*' | grep -o '"median_allreduce_s":[-0-9.e+]*' | cut -d: -f2)"
      ratio="$(field vs_reference "$out")"
      warm="$(field warm_lane_share "$out")"
      err="$(field max_rel_error "$out")"
      printf '%-8s %-9s %-5s %10.4f %12.4f %7.3f %6.2f %10.2e\n' \
        "$rate" "$size" "$codec" "$starling" "$reference" "$ratio" "$warm" "$err"
    done
  done
done
