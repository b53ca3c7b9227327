//! This peer's upload bandwidth estimate, declared to the group at matchmaking: the configured
//! value, else the median of what the last rounds measured, else the initial guess.

use std::collections::VecDeque;
use std::sync::Mutex;

use crate::partition::geometric_median;
use starling_node::lock::lock;

/// Measurements the estimate is the median of. A median, not an average: one round's
/// measurement can be off several times either way (a reducer that admitted this peer late, a
/// socket buffer that swallowed a small span at once), and one such outlier must not move the
/// split.
const RECENT: usize = 5;

/// The estimate (bytes per second).
pub(crate) struct Bandwidth {
    configured: Option<f64>,
    initial: f64,
    measured: Mutex<VecDeque<f64>>,
}

impl Bandwidth {
    pub fn new(configured: Option<f64>, initial: f64) -> Self {
        Bandwidth {
            configured,
            initial,
            measured: Mutex::new(VecDeque::with_capacity(RECENT)),
        }
    }

    /// What this peer declares now.
    pub fn current(&self) -> f64 {
        self.configured
            .or_else(|| geometric_median(lock(&self.measured).iter().copied()))
            .unwrap_or(self.initial)
    }

    /// Adds a measured upload rate (bytes/s, from a round's sender streams) to the recent
    /// ones; the first replaces the initial guess outright. Non-finite or non-positive
    /// measurements are ignored.
    pub fn record(&self, measured: Option<f64>) {
        let Some(measured) = measured.filter(|m| m.is_finite() && *m > 0.0) else {
            return;
        };
        let mut recent = lock(&self.measured);
        if recent.len() == RECENT {
            recent.pop_front();
        }
        recent.push_back(measured);
    }
}

#[cfg(test)]
mod tests {
    use super::Bandwidth;

    #[test]
    fn configured_wins_then_measured_then_initial() {
        let b = Bandwidth::new(None, 100.0);
        assert_eq!(b.current(), 100.0);
        b.record(Some(f64::NAN));
        b.record(Some(-1.0));
        b.record(None);
        assert_eq!(b.current(), 100.0);
        b.record(Some(200.0));
        assert_eq!(b.current(), 200.0);
        b.record(Some(300.0));
        assert!((b.current() - (200.0f64 * 300.0).sqrt()).abs() < 1e-9);
        // One outlier among five does not move the estimate.
        for m in [250.0, 260.0, 5000.0] {
            b.record(Some(m));
        }
        assert_eq!(b.current(), 260.0);
        // Only the last five count.
        for _ in 0..3 {
            b.record(Some(10.0));
        }
        assert_eq!(b.current(), 10.0);
        let fixed = Bandwidth::new(Some(5.0), 100.0);
        fixed.record(Some(300.0));
        assert_eq!(fixed.current(), 5.0);
    }
}
