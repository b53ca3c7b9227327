#!/usr/bin/env bash
# `starling bench training` with simulated compute between N hosts whose links are limited
# by `tc tbf` (issue #24): N network namespaces on one bridge (scripts/netns_hosts.sh), one
# training peer per host listening with the node's defaults, the bench run from inside the
# first host. Prints the bench's JSON line. Each peer computes at 1000/MS samples per second
# with MS = peers x 1000 / 1024 unless --sample-ms is passed after `--`: a global step of
# 1024 samples takes about 1 s at the ideal rate. Needs root and iproute2; deletes its
# namespaces on exit, also on failure.
#
# Usage: sudo scripts/bench_training_netns.sh [--bin PATH] [--peers 4] [--rate 100mbit]
#          [--params 1000000] [-- extra arguments for bench training, e.g. --delayed-update
#          --steps 20 --codec powersgd:4]
set -euo pipefail
cd "$(dirname "$0")/.."

bin=target/release/starling
peers=4
rate=100mbit
params=1000000
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --bin) bin="$2"; shift 2 ;;
    --peers) peers="$2"; shift 2 ;;
    --rate) rate="$2"; shift 2 ;;
    --params) params="$2"; shift 2 ;;
    --) shift; extra=("$@"); break ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done

. scripts/netns_hosts.sh
netns_need_root_and_bin
trap netns_hosts_down EXIT
netns_hosts_up "$peers"
netns_throttle "$rate" add

sample_ms="$(awk -v n="$peers" 'BEGIN { printf "%.6f", n * 1000 / 1024 }')"
for a in "${extra[@]}"; do
  [ "$a" = "--sample-ms" ] && sample_ms=""
done
ip netns exec "${hosts[0]}" "$bin" bench training --peers "$peers" --netns "$ns_list" \
  --params "$params" ${sample_ms:+--sample-ms "$sample_ms"} "${extra[@]}" | tail -n1
