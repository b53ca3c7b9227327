//! The fetch loop: runs the [`Scheduler`]'s requests concurrently through a caller-supplied
//! `fetch(donor, chunk)` (streams in production, plain closures in the tests below), verifies
//! every chunk's size and SHA-256 against the manifest before it is kept, and counts what
//! happened. Memory: the chunks kept so far plus at most `max_in_flight` chunks in transit.

use std::future::Future;

use futures::stream::{FuturesUnordered, StreamExt};
use tokio::time::{sleep_until, timeout_at, Instant};

use super::manifest::{sha256, short, Digest};
use super::schedule::{Failure, Limits, Scheduler};
use super::snapshot::from_le_bytes;

/// What one chunk must be.
#[derive(Debug, Clone)]
pub(crate) struct Expected {
    pub values: usize,
    pub hash: Digest,
}

/// What happened at one donor.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct DonorTally {
    pub chunks: usize,
    pub bytes: u64,
    pub bad_chunks: usize,
    pub failures: usize,
    pub last_failure: Option<String>,
}

/// What happened in one fetch loop.
#[derive(Debug, Clone, Default)]
pub(crate) struct Tally {
    pub donors: Vec<DonorTally>,
    pub retries: usize,
    pub bad_chunks: usize,
    pub busy: usize,
    pub stale: usize,
    pub bytes: u64,
    pub peak_in_flight: usize,
}

/// How the loop ended when not every chunk arrived.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Unfinished {
    /// No donor is left to ask.
    NoDonors,
    /// The deadline passed.
    Deadline,
}

/// Checks a chunk's bytes against what the manifest says.
pub(crate) fn verify(expected: &Expected, bytes: &[u8]) -> Result<Vec<f32>, String> {
    if bytes.len() != expected.values * 4 {
        return Err(format!(
            "chunk of {} bytes, expected {}",
            bytes.len(),
            expected.values * 4
        ));
    }
    let got = sha256(bytes);
    if got != expected.hash {
        return Err(format!(
            "chunk hash {} is not the manifest's {}",
            short(&got),
            short(&expected.hash)
        ));
    }
    Ok(from_le_bytes(bytes))
}

/// What to fetch from whom, within which bounds.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Plan<'a> {
    /// Every chunk's size and hash.
    pub expected: &'a [Expected],
    /// Donors, indices `0..donors`.
    pub donors: usize,
    /// Donors not to ask (they failed already).
    pub skip: &'a [usize],
    /// The scheduler's bounds.
    pub limits: Limits,
    /// When to give up.
    pub deadline: Instant,
}

/// Fetches every chunk whose slot is `None` from the plan's donors until all are verified, no
/// donor is left, or the deadline. Verified values land in `slots`; nothing else ever does.
pub(crate) async fn fetch_chunks<F, Fut>(
    plan: Plan<'_>,
    slots: &mut [Option<Vec<f32>>],
    mut fetch: F,
    tally: &mut Tally,
) -> Result<(), Unfinished>
where
    F: FnMut(usize, usize) -> Fut,
    Fut: Future<Output = Result<Vec<u8>, (Failure, String)>>,
{
    let Plan {
        expected,
        donors,
        skip,
        limits,
        deadline,
    } = plan;
    let missing = (0..slots.len()).filter(|&i| slots[i].is_none());
    let mut sched = Scheduler::new(missing, donors, limits);
    for &d in skip {
        sched.drop_donor(d, Failure::Dead);
    }
    tally.donors.resize(donors, DonorTally::default());
    let mut running = FuturesUnordered::new();
    let result = loop {
        let now = Instant::now();
        while let Some((d, c)) = sched.next(now) {
            let request = fetch(d, c);
            running.push(async move { (d, c, request.await) });
        }
        tally.peak_in_flight = tally.peak_in_flight.max(sched.peak_in_flight());
        if sched.is_complete() {
            break Ok(());
        }
        if running.is_empty() {
            match sched.wake_at() {
                Some(_) if now >= deadline => break Err(Unfinished::Deadline),
                Some(at) => {
                    sleep_until(at.min(deadline)).await;
                    continue;
                }
                None => break Err(Unfinished::NoDonors),
            }
        }
        let Ok(Some((d, c, outcome))) = timeout_at(deadline, running.next()).await else {
            break Err(Unfinished::Deadline);
        };
        let outcome = outcome.and_then(|bytes| {
            let values = verify(&expected[c], &bytes).map_err(|e| (Failure::Bad, e))?;
            Ok((bytes.len() as u64, values))
        });
        let donor = &mut tally.donors[d];
        match outcome {
            Ok((bytes, values)) => {
                slots[c] = Some(values);
                sched.succeeded(d, c);
                donor.chunks += 1;
                donor.bytes += bytes;
                tally.bytes += bytes;
            }
            Err((failure, why)) => {
                tracing::debug!(donor = d, chunk = c, ?failure, "state chunk failed: {why}");
                sched.failed(d, c, failure, Instant::now());
                donor.failures += 1;
                donor.last_failure = Some(why);
                tally.retries += 1;
                match failure {
                    Failure::Bad => {
                        donor.bad_chunks += 1;
                        tally.bad_chunks += 1;
                    }
                    Failure::Busy => tally.busy += 1,
                    Failure::Stale => tally.stale += 1,
                    Failure::Dead => {}
                }
            }
        }
    };
    tally.peak_in_flight = tally.peak_in_flight.max(sched.peak_in_flight());
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sync::snapshot::le_bytes;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Mutex;
    use std::time::Duration;

    const CHUNK: usize = 4;

    /// The truth: `n` chunks of 4 values.
    fn truth(n: usize) -> (Vec<Vec<f32>>, Vec<Expected>) {
        let chunks: Vec<Vec<f32>> = (0..n)
            .map(|c| (0..CHUNK).map(|i| (c * CHUNK + i) as f32).collect())
            .collect();
        let expected = chunks
            .iter()
            .map(|v| Expected {
                values: v.len(),
                hash: sha256(&le_bytes(v)),
            })
            .collect();
        (chunks, expected)
    }

    fn limits(max_in_flight: usize, per_donor: usize) -> Limits {
        Limits {
            max_in_flight,
            per_donor,
            busy_backoff: Duration::from_millis(1),
            max_busy: 3,
        }
    }

    fn plan<'a>(
        expected: &'a [Expected],
        donors: usize,
        skip: &'a [usize],
        limits: Limits,
    ) -> Plan<'a> {
        Plan {
            expected,
            donors,
            skip,
            limits,
            deadline: Instant::now() + Duration::from_secs(60),
        }
    }

    #[tokio::test]
    async fn in_flight_requests_never_exceed_the_bounds() {
        let (chunks, expected) = truth(40);
        let mut slots = vec![None; 40];
        let now_running = AtomicUsize::new(0);
        let peak = AtomicUsize::new(0);
        let per_donor: Vec<AtomicUsize> = (0..3).map(|_| AtomicUsize::new(0)).collect();
        let mut tally = Tally::default();
        let fetch = |d: usize, c: usize| {
            let (now_running, peak, per_donor) = (&now_running, &peak, &per_donor);
            let bytes = le_bytes(&chunks[c]).into_owned();
            async move {
                let n = now_running.fetch_add(1, Ordering::SeqCst) + 1;
                peak.fetch_max(n, Ordering::SeqCst);
                let at = per_donor[d].fetch_add(1, Ordering::SeqCst) + 1;
                assert!(at <= 2, "donor {d} has {at} requests");
                // Donors answer at different speeds.
                for _ in 0..(d + 1) * 3 {
                    tokio::task::yield_now().await;
                }
                per_donor[d].fetch_sub(1, Ordering::SeqCst);
                now_running.fetch_sub(1, Ordering::SeqCst);
                Ok(bytes)
            }
        };
        fetch_chunks(
            plan(&expected, 3, &[], limits(5, 2)),
            &mut slots,
            fetch,
            &mut tally,
        )
        .await
        .unwrap();
        assert_eq!(peak.load(Ordering::SeqCst), 5);
        assert_eq!(tally.peak_in_flight, 5);
        let got: Vec<Vec<f32>> = slots.into_iter().map(Option::unwrap).collect();
        assert_eq!(got, chunks);
        let per: Vec<usize> = tally.donors.iter().map(|d| d.chunks).collect();
        assert_eq!(per.iter().sum::<usize>(), 40);
        assert!(per.iter().all(|&n| n > 0), "{per:?}");
        assert_eq!((tally.retries, tally.bytes), (0, 40 * 16));
    }

    #[tokio::test]
    async fn bad_chunks_are_never_kept_and_dead_donors_are_left() {
        let (chunks, expected) = truth(12);
        let mut slots = vec![None; 12];
        let asked: Mutex<Vec<(usize, usize)>> = Mutex::new(Vec::new());
        let mut tally = Tally::default();
        // Donor 0 corrupts every chunk, donor 1 dies, donor 2 is honest, donor 3 sends
        // chunks of the wrong length.
        let fetch = |d: usize, c: usize| {
            asked.lock().unwrap().push((d, c));
            let mut bytes = le_bytes(&chunks[c]).into_owned();
            async move {
                match d {
                    0 => {
                        bytes[3] ^= 0x40;
                        Ok(bytes)
                    }
                    1 => Err((Failure::Dead, "connection reset".to_string())),
                    3 => Ok(bytes[..8].to_vec()),
                    _ => Ok(bytes),
                }
            }
        };
        fetch_chunks(
            plan(&expected, 4, &[], limits(8, 2)),
            &mut slots,
            fetch,
            &mut tally,
        )
        .await
        .unwrap();
        let got: Vec<Vec<f32>> = slots.into_iter().map(Option::unwrap).collect();
        assert_eq!(got, chunks, "only verified chunks were kept");
        assert_eq!(tally.donors[2].chunks, 12);
        assert_eq!(
            tally.bad_chunks,
            tally.donors[0].bad_chunks + tally.donors[3].bad_chunks
        );
        assert!(tally.donors[0].bad_chunks >= 1 && tally.donors[3].bad_chunks >= 1);
        assert!(tally.retries >= 3);
        // A donor that failed once was never asked again (one request per donor slot at most).
        let asked = asked.into_inner().unwrap();
        for d in [0, 1, 3] {
            assert!(asked.iter().filter(|(x, _)| *x == d).count() <= 2);
        }
    }

    #[tokio::test]
    async fn no_donor_left_leaves_the_missing_slots_empty() {
        let (chunks, expected) = truth(6);
        let mut slots: Vec<Option<Vec<f32>>> = vec![None; 6];
        slots[0] = Some(chunks[0].clone()); // carried over from an earlier round
        let mut tally = Tally::default();
        let fetch = |_d: usize, c: usize| {
            let bytes = le_bytes(&chunks[c]).into_owned();
            async move {
                if c == 3 {
                    Err((Failure::Stale, "serves epoch 9 now".to_string()))
                } else {
                    Ok(bytes)
                }
            }
        };
        let r = fetch_chunks(
            plan(&expected, 2, &[], limits(1, 1)),
            &mut slots,
            fetch,
            &mut tally,
        )
        .await;
        assert_eq!(r, Err(Unfinished::NoDonors));
        assert!(slots[3].is_none());
        assert_eq!(tally.stale, 2, "both donors moved on");
        // Chunks 1 and 2 arrived (chunk 0 was never asked for); 3, 4 and 5 are missing.
        assert_eq!(tally.donors.iter().map(|d| d.chunks).sum::<usize>(), 2);
        assert!(slots[4].is_none() && slots[5].is_none());
        // A skipped donor is never asked.
        let mut slots = vec![None; 6];
        let mut tally = Tally::default();
        let fetch = |d: usize, c: usize| {
            assert_ne!(d, 0);
            let bytes = le_bytes(&chunks[c]).into_owned();
            async move { Ok(bytes) }
        };
        fetch_chunks(
            plan(&expected, 2, &[0], limits(4, 4)),
            &mut slots,
            fetch,
            &mut tally,
        )
        .await
        .unwrap();
        assert_eq!(tally.donors[1].chunks, 6);
    }

    #[tokio::test]
    async fn a_busy_donor_is_asked_again_after_resting() {
        let (chunks, expected) = truth(3);
        let mut slots = vec![None; 3];
        let refusals = AtomicUsize::new(0);
        let mut tally = Tally::default();
        let fetch = |_d: usize, c: usize| {
            let refusals = &refusals;
            let bytes = le_bytes(&chunks[c]).into_owned();
            async move {
                if refusals.fetch_add(1, Ordering::SeqCst) < 2 {
                    Err((Failure::Busy, "busy".to_string()))
                } else {
                    Ok(bytes)
                }
            }
        };
        fetch_chunks(
            plan(&expected, 1, &[], limits(2, 2)),
            &mut slots,
            fetch,
            &mut tally,
        )
        .await
        .unwrap();
        assert_eq!((tally.busy, tally.donors[0].chunks), (2, 3));
    }
}
