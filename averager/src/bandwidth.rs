//! This peer's upload bandwidth estimate, declared to the group at matchmaking: the configured
//! value, else a running average of what rounds measured, else the initial guess.

use std::sync::Mutex;

use crate::sync::lock;

/// Weight of a new bandwidth measurement in the running average.
const BANDWIDTH_EMA: f64 = 0.3;

/// The estimate (bytes per second).
pub(crate) struct Bandwidth {
    configured: Option<f64>,
    initial: f64,
    measured: Mutex<Option<f64>>,
}

impl Bandwidth {
    pub fn new(configured: Option<f64>, initial: f64) -> Self {
        Bandwidth {
            configured,
            initial,
            measured: Mutex::new(None),
        }
    }

    /// What this peer declares now.
    pub fn current(&self) -> f64 {
        self.configured
            .or(*lock(&self.measured))
            .unwrap_or(self.initial)
    }

    /// Folds a measured upload rate (bytes/s, from a round's sender streams) into the running
    /// estimate. The first measurement replaces the initial guess outright; later ones are
    /// smoothed. Non-finite or non-positive measurements are ignored.
    pub fn record(&self, measured: Option<f64>) {
        let Some(measured) = measured.filter(|m| m.is_finite() && *m > 0.0) else {
            return;
        };
        let mut b = lock(&self.measured);
        *b = Some(match *b {
            None => measured,
            Some(old) => (1.0 - BANDWIDTH_EMA) * old + BANDWIDTH_EMA * measured,
        });
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
        assert!((b.current() - 230.0).abs() < 1e-9);
        let fixed = Bandwidth::new(Some(5.0), 100.0);
        fixed.record(Some(300.0));
        assert_eq!(fixed.current(), 5.0);
    }
}
