//! What `starling bench dht` prints: latency and success per operation kind, per phase, and
//! the whole run's report.

use serde::Serialize;

use crate::percentile;

#[derive(Serialize, Default)]
pub(super) struct LatencyStats {
    pub(super) ops: usize,
    pub(super) success_rate: f64,
    pub(super) p50_ms: f64,
    pub(super) p90_ms: f64,
    pub(super) p99_ms: f64,
}

impl LatencyStats {
    pub(super) fn from(results: &[(bool, f64)]) -> Self {
        let mut ms: Vec<f64> = results.iter().map(|(_, ms)| *ms).collect();
        ms.sort_by(f64::total_cmp);
        let ok = results.iter().filter(|(ok, _)| *ok).count();
        LatencyStats {
            ops: results.len(),
            success_rate: ok as f64 / results.len().max(1) as f64,
            p50_ms: percentile(&ms, 0.5),
            p90_ms: percentile(&ms, 0.9),
            p99_ms: percentile(&ms, 0.99),
        }
    }
}

/// Store, get (latest) and get-first latencies of one phase.
#[derive(Serialize)]
pub(super) struct PhaseStats {
    pub(super) records: usize,
    pub(super) in_flight: usize,
    pub(super) store: LatencyStats,
    pub(super) get: LatencyStats,
    pub(super) get_first: LatencyStats,
}

#[derive(Serialize)]
pub(super) struct Report {
    pub(super) bench: &'static str,
    pub(super) peers: usize,
    pub(super) procs: usize,
    pub(super) startup_s: f64,
    pub(super) idle_timeout_s: u64,
    /// Each peer's connection manager: pruning above `high_water` down to `low_water`, and
    /// the ceiling on established connections.
    pub(super) high_water: usize,
    pub(super) low_water: usize,
    pub(super) max_established: Option<u32>,
    /// Routing-table refresh interval of every peer (null: never).
    pub(super) routing_refresh_s: Option<u64>,
    pub(super) sequential: PhaseStats,
    pub(super) concurrent: PhaseStats,
    pub(super) killed: usize,
    /// After `killed` peers stopped: gets (latest and first) of every record by survivors.
    pub(super) after_kill: Option<PhaseStats>,
    /// Resident memory of all processes, megabytes, and per peer (growth since start, KiB).
    pub(super) rss_total_mb: f64,
    pub(super) rss_per_peer_kb: f64,
    /// Open connections per peer when memory was read (libp2p keeps a connection open until it
    /// has been idle for `idle_connection_timeout`, 120 s by default, or the connection
    /// manager closes it).
    pub(super) connections_per_peer: f64,
    /// CPU time the idle swarm used (all processes), per peer: milliseconds per second. The
    /// machine's cores divided by the peer count is the most a peer may use.
    pub(super) idle_cpu_ms_per_s_per_peer: f64,
    /// Open connections per peer after the idle time.
    pub(super) idle_connections_per_peer: f64,
    /// Routing-table sizes of the peers after the idle time.
    pub(super) routing_table: RoutingStats,
}

/// How full the peers' routing tables are: a peer with only its bootstrap peer in it is cut
/// off from the swarm once that connection closes.
#[derive(Serialize, Debug, Default)]
pub(super) struct RoutingStats {
    pub(super) min: usize,
    pub(super) p10: usize,
    pub(super) p50: usize,
    /// Peers whose table holds at most one peer.
    pub(super) isolated: usize,
}

impl RoutingStats {
    pub(super) fn from(mut sizes: Vec<usize>) -> Self {
        sizes.sort_unstable();
        let at = |q: f64| {
            sizes
                .get(((sizes.len() as f64 - 1.0) * q).round() as usize)
                .copied()
                .unwrap_or(0)
        };
        RoutingStats {
            min: at(0.0),
            p10: at(0.1),
            p50: at(0.5),
            isolated: sizes.iter().filter(|&&s| s <= 1).count(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routing_stats_count_peers_that_know_at_most_one_other() {
        let r = RoutingStats::from(vec![1, 30, 0, 25, 40, 41, 42, 43, 44, 45, 46]);
        assert_eq!((r.min, r.p10, r.p50, r.isolated), (0, 1, 41, 2));
    }
}
