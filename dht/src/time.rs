use std::time::{SystemTime, UNIX_EPOCH};

/// A wall-clock time in milliseconds since the Unix epoch. Expirations travel between peers in
/// this unit; [`crate::DhtLimits::clock_skew`] absorbs differences between peers' clocks.
pub type DhtTime = u64;

/// The current wall-clock time in milliseconds since the Unix epoch.
///
/// ```
/// assert!(starling_dht::now_ms() > 1_600_000_000_000);
/// ```
pub fn now_ms() -> DhtTime {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}
