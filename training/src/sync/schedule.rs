//! Which chunk to ask which donor for next: a pure state machine, driven by the fetch loop and
//! unit-tested without sockets.
//!
//! - At most `max_in_flight` requests in all and `per_donor` at one donor, so memory stays
//!   bounded and no donor is swamped.
//! - The least-loaded donor gets the next chunk (fewest in flight, then fewest served, then
//!   the first listed): a fast donor asks for more work sooner and so serves more, a slow one
//!   never has more than `per_donor` requests waiting.
//! - A failed chunk goes back to the front of the queue. A donor that sent a bad chunk, died,
//!   timed out or moved on to another snapshot is asked nothing more. A donor that refuses a
//!   request as busy while others of ours run there has shown its limit: it gets no more
//!   requests at once than it had then. One that refuses with nothing of ours running is rested
//!   for `busy_backoff`, and dropped after `max_busy` such refusals.

use std::collections::VecDeque;
use std::time::Duration;

use tokio::time::Instant;

/// How one request failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Failure {
    /// The chunk's size or hash is wrong, or the donor broke the protocol.
    Bad,
    /// The stream failed, could not be opened, or the donor did not answer in time.
    Dead,
    /// The donor serves another snapshot now.
    Stale,
    /// The donor refused: too many requests.
    Busy,
}

/// Bounds of the scheduler.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    pub max_in_flight: usize,
    pub per_donor: usize,
    pub busy_backoff: Duration,
    pub max_busy: u32,
}

#[derive(Debug, Clone)]
struct Donor {
    in_flight: usize,
    /// Requests it takes at once (`per_donor`, lowered by busy answers).
    cap: usize,
    served: usize,
    busy: u32,
    resting_until: Option<Instant>,
    dropped: Option<Failure>,
}

/// The fetch plan's state (see the module docs).
#[derive(Debug)]
pub(crate) struct Scheduler {
    pending: VecDeque<usize>,
    remaining: usize,
    donors: Vec<Donor>,
    in_flight: usize,
    limits: Limits,
    peak_in_flight: usize,
}

impl Scheduler {
    /// A plan to fetch `chunks` from `donors` donors.
    pub fn new(chunks: impl IntoIterator<Item = usize>, donors: usize, limits: Limits) -> Self {
        let pending: VecDeque<usize> = chunks.into_iter().collect();
        Scheduler {
            remaining: pending.len(),
            pending,
            donors: vec![
                Donor {
                    in_flight: 0,
                    cap: limits.per_donor.max(1),
                    served: 0,
                    busy: 0,
                    resting_until: None,
                    dropped: None,
                };
                donors
            ],
            in_flight: 0,
            limits: Limits {
                max_in_flight: limits.max_in_flight.max(1),
                per_donor: limits.per_donor.max(1),
                ..limits
            },
            peak_in_flight: 0,
        }
    }

    fn usable(&self, d: usize, now: Instant) -> bool {
        let donor = &self.donors[d];
        donor.dropped.is_none()
            && donor.in_flight < donor.cap
            && donor.resting_until.is_none_or(|t| t <= now)
    }

    /// The next request to start, `(donor, chunk)`, if the bounds allow one.
    pub fn next(&mut self, now: Instant) -> Option<(usize, usize)> {
        if self.in_flight >= self.limits.max_in_flight || self.pending.is_empty() {
            return None;
        }
        let d = (0..self.donors.len())
            .filter(|&d| self.usable(d, now))
            .min_by_key(|&d| (self.donors[d].in_flight, self.donors[d].served, d))?;
        let chunk = self.pending.pop_front()?;
        self.donors[d].in_flight += 1;
        self.donors[d].resting_until = None;
        self.in_flight += 1;
        self.peak_in_flight = self.peak_in_flight.max(self.in_flight);
        Some((d, chunk))
    }

    fn finish(&mut self, d: usize) {
        self.in_flight = self.in_flight.saturating_sub(1);
        let donor = &mut self.donors[d];
        donor.in_flight = donor.in_flight.saturating_sub(1);
    }

    /// `chunk` arrived from donor `d` and verified.
    pub fn succeeded(&mut self, d: usize, _chunk: usize) {
        self.finish(d);
        self.donors[d].served += 1;
        self.remaining = self.remaining.saturating_sub(1);
    }

    /// The request for `chunk` at donor `d` failed: the chunk is queued again.
    pub fn failed(&mut self, d: usize, chunk: usize, failure: Failure, now: Instant) {
        self.finish(d);
        self.pending.push_front(chunk);
        let limits = self.limits;
        let donor = &mut self.donors[d];
        match failure {
            Failure::Busy if donor.in_flight > 0 => donor.cap = donor.in_flight,
            Failure::Busy => {
                donor.busy += 1;
                donor.resting_until = Some(now + limits.busy_backoff);
                if donor.busy > limits.max_busy {
                    donor.dropped = Some(Failure::Busy);
                }
            }
            other => {
                donor.dropped.get_or_insert(other);
            }
        }
    }

    /// Drops donor `d` (for example when the manifest could not be had from it).
    pub fn drop_donor(&mut self, d: usize, failure: Failure) {
        self.donors[d].dropped.get_or_insert(failure);
    }

    /// Every chunk arrived.
    pub fn is_complete(&self) -> bool {
        self.remaining == 0
    }

    /// Requests running now.
    #[cfg(test)]
    pub fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// Most requests that ran at once.
    pub fn peak_in_flight(&self) -> usize {
        self.peak_in_flight
    }

    /// Chunks still to fetch.
    #[cfg(test)]
    pub fn remaining(&self) -> usize {
        self.remaining
    }

    /// Why donor `d` is no longer asked, if it is not.
    #[cfg(test)]
    pub fn dropped(&self, d: usize) -> Option<Failure> {
        self.donors[d].dropped
    }

    /// When nothing runs and nothing can start now: the instant a resting donor may be asked
    /// again, or `None` when no donor is left (the plan is stuck).
    pub fn wake_at(&self) -> Option<Instant> {
        self.donors
            .iter()
            .filter(|d| d.dropped.is_none())
            .map(|d| d.resting_until.unwrap_or_else(Instant::now))
            .min()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(max_in_flight: usize, per_donor: usize) -> Limits {
        Limits {
            max_in_flight,
            per_donor,
            busy_backoff: Duration::from_millis(100),
            max_busy: 2,
        }
    }

    #[test]
    fn requests_stay_within_both_bounds_and_spread_over_donors() {
        let now = Instant::now();
        let mut s = Scheduler::new(0..20, 3, limits(4, 2));
        let mut running = Vec::new();
        while let Some(r) = s.next(now) {
            running.push(r);
        }
        // 4 in all, at most 2 per donor, least-loaded first: donors 0, 1, 2, 0.
        assert_eq!(running, [(0, 0), (1, 1), (2, 2), (0, 3)]);
        assert_eq!(s.in_flight(), 4);
        // Complete them one by one, refilling; no bound is ever exceeded.
        let mut served = [0usize; 3];
        while let Some((d, c)) = running.pop() {
            s.succeeded(d, c);
            served[d] += 1;
            while let Some(r) = s.next(now) {
                running.insert(0, r);
                let at_donor = running.iter().filter(|(x, _)| *x == r.0).count();
                assert!(at_donor <= 2 && running.len() <= 4);
            }
        }
        assert!(s.is_complete());
        assert_eq!(s.peak_in_flight(), 4);
        assert!(served.iter().all(|&n| n >= 5), "{served:?}");
    }

    #[test]
    fn failed_chunks_go_elsewhere_and_failing_donors_are_dropped() {
        let now = Instant::now();
        let mut s = Scheduler::new(0..3, 3, limits(3, 1));
        assert_eq!(s.next(now), Some((0, 0)));
        assert_eq!(s.next(now), Some((1, 1)));
        assert_eq!(s.next(now), Some((2, 2)));
        s.failed(0, 0, Failure::Bad, now);
        s.failed(1, 1, Failure::Dead, now);
        // Chunk 1 then 0 are queued again; only donor 2 is left, and it is busy with chunk 2.
        assert_eq!(s.next(now), None);
        assert_eq!(
            (s.dropped(0), s.dropped(1)),
            (Some(Failure::Bad), Some(Failure::Dead))
        );
        s.succeeded(2, 2);
        assert_eq!(s.next(now), Some((2, 1)));
        s.succeeded(2, 1);
        assert_eq!(s.next(now), Some((2, 0)));
        s.failed(2, 0, Failure::Stale, now);
        // Nobody is left: stuck, with one chunk missing.
        assert_eq!((s.next(now), s.wake_at(), s.remaining()), (None, None, 1));
        assert!(!s.is_complete());
    }

    #[test]
    fn a_donor_busy_beyond_some_requests_gets_no_more_than_that() {
        let now = Instant::now();
        let mut s = Scheduler::new(0..4, 1, limits(4, 3));
        assert_eq!(s.next(now), Some((0, 0)));
        assert_eq!(s.next(now), Some((0, 1)));
        assert_eq!(s.next(now), Some((0, 2)));
        // The third is refused while two run: the donor takes two at once from now on.
        s.failed(0, 2, Failure::Busy, now);
        assert_eq!(s.next(now), None);
        s.succeeded(0, 0);
        assert_eq!(s.next(now), Some((0, 2)));
        assert_eq!(s.next(now), None);
        assert_eq!(s.dropped(0), None);
    }

    #[test]
    fn busy_donors_rest_then_are_dropped() {
        let now = Instant::now();
        let mut s = Scheduler::new(0..1, 1, limits(2, 2));
        for round in 0..3 {
            let t = now + Duration::from_millis(100 * round);
            assert_eq!(s.next(t), Some((0, 0)));
            s.failed(0, 0, Failure::Busy, t);
            assert_eq!(s.next(t), None, "resting");
            if round < 2 {
                assert_eq!(s.wake_at(), Some(t + Duration::from_millis(100)));
            }
        }
        // The third refusal is over max_busy = 2.
        assert_eq!((s.dropped(0), s.wake_at()), (Some(Failure::Busy), None));
    }
}
