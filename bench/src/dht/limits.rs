//! How many connections and open files the peers of one `bench dht` process may hold.

use starling_node::ConnectionLimits;

/// File descriptors a bench peer holds besides its connections: its TCP listener, its
/// fast-lane listener, and room for a fast lane or dial in progress.
const DESCRIPTORS_PER_PEER: usize = 4;
/// Descriptors a process holds besides its peers' (the runtime, stdio, the binary's files).
const DESCRIPTORS_PER_PROCESS: usize = 256;
/// The fewest connections (high-water mark) a bench peer is run with: below it, most Kademlia
/// requests would dial anew.
const MIN_HIGH_WATER: usize = 16;

/// This process's open-file limit (the soft one, which the binary raises to the hard one at
/// start), or `None` where it cannot be read.
pub(super) fn open_files_limit() -> Option<usize> {
    let (soft, _hard) = rlimit::getrlimit(rlimit::Resource::NOFILE).ok()?;
    usize::try_from(soft).ok()
}

/// The connection limits every bench peer runs with: the node's defaults, or a high-water
/// mark of `requested`, with the ceiling lowered where `per_process` peers (of `peers`) would
/// not fit a process that may open `limit` files: each connection is a descriptor at each
/// end, and a process at its limit accepts no connection (its peers' dials time out, its new
/// listeners fail with "Too many open files"). Without the manager a swarm of a thousand on
/// one machine drifted towards a full mesh (about 134 connections per peer with 177 of 1024
/// peers up, 286 with 321 up) and hit this machine's 20 000 files. An error names the limit,
/// how to raise it and the `--procs` that fits.
pub(super) fn peer_connections(
    limit: Option<usize>,
    peers: usize,
    per_process: usize,
    requested: Option<usize>,
) -> Result<ConnectionLimits, String> {
    let mut c = requested.map_or_else(ConnectionLimits::default, ConnectionLimits::with_high_water);
    let Some(limit) = limit else {
        return Ok(c);
    };
    let budget = (limit.saturating_sub(DESCRIPTORS_PER_PROCESS) / per_process.max(1))
        .saturating_sub(DESCRIPTORS_PER_PEER);
    // The ceiling holds bursts; pruning starts at three quarters of it.
    let fits = budget * 3 / 4;
    if fits < MIN_HIGH_WATER.min(c.high_water) {
        let per_peer = MIN_HIGH_WATER * 4 / 3 + 1 + DESCRIPTORS_PER_PEER;
        let procs =
            (peers * per_peer).div_ceil(limit.saturating_sub(DESCRIPTORS_PER_PROCESS).max(1));
        return Err(format!(
            "{per_process} peers in one process fit the open-file limit of {limit} (the hard \
             `ulimit -n`) only with {fits} connections each, too few for a swarm: use --procs \
             {procs} or more, or raise the limit (/etc/security/limits.conf, a container's \
             --ulimit nofile, a service's LimitNOFILE)."
        ));
    }
    let ceiling = u32::try_from(budget).unwrap_or(u32::MAX);
    if c.max_established.is_none_or(|m| m > ceiling) {
        c.max_established = Some(ceiling);
    }
    c.high_water = c.high_water.min(fits);
    c.low_water = c.low_water.min(c.high_water / 2);
    Ok(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peers_get_connection_limits_that_fit_the_open_file_limit() {
        // Plenty of room: the node's defaults.
        let c = peer_connections(Some(1 << 20), 64, 64, None).unwrap();
        assert_eq!(c, ConnectionLimits::default());
        // 1024 peers over 8 processes under 20000 files (the run that stalled here): the
        // ceiling and the marks come down so that 128 peers' connections fit.
        let c = peer_connections(Some(20_000), 1024, 128, None).unwrap();
        let ceiling = c.max_established.unwrap() as usize;
        assert!(128 * (ceiling + DESCRIPTORS_PER_PEER) + DESCRIPTORS_PER_PROCESS <= 20_000);
        assert!(c.high_water < ceiling && c.low_water < c.high_water);
        assert!(c.high_water >= MIN_HIGH_WATER);
        // A smaller mark asked for is kept.
        let c = peer_connections(Some(20_000), 1024, 128, Some(32)).unwrap();
        assert_eq!((c.high_water, c.low_water), (32, 16));
        // All 1024 in one process: too few connections each; the error says what to do.
        let e = peer_connections(Some(20_000), 1024, 1024, None).unwrap_err();
        assert!(e.contains("20000") && e.contains("ulimit -n"), "{e}");
        let procs: usize = e
            .split("--procs ")
            .nth(1)
            .and_then(|t| t.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .expect("a process count");
        assert!(peer_connections(Some(20_000), 1024, 1024 / procs + 1, None).is_ok());
        // No readable limit: the defaults.
        assert_eq!(
            peer_connections(None, 1024, 1024, None).unwrap(),
            ConnectionLimits::default()
        );
        assert!(open_files_limit().is_some_and(|l| l > 0));
    }
}
