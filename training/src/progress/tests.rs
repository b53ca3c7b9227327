//! The progress reports and the swarm's readings made of them, with no network.

use super::*;

fn r(epoch: u64, samples: u64, rate: f64, time_ms: u64) -> PeerProgress {
    PeerProgress {
        epoch,
        samples,
        samples_per_second: rate,
        time_ms,
    }
}

#[test]
fn a_partial_reading_is_completed_only_by_a_round_of_the_same_epoch_and_peers() {
    // The round left 16 peers in epoch 9 at 64 samples/s each from 10 s.
    let began = SwarmProgress {
        epoch: 9,
        peers: 16,
        peers_in_epoch: 16,
        samples_per_second: 1024.0,
        own_samples_per_second: 64.0,
        ..SwarmProgress::estimate(&[r(9, 0, 1024.0, 10_000)], 1024, 10_000)
    };
    // At 10.9 s, 6 of them reported 64 samples at 10.5 s; 10 still show epoch 8.
    let mut reports: Vec<PeerProgress> = (0..6).map(|_| r(9, 64, 64.0, 10_500)).collect();
    reports.extend((0..10).map(|_| r(8, 640, 64.0, 9_900)));
    let read = SwarmProgress::estimate(&reports, 1024, 10_900);
    assert_eq!((read.peers_in_epoch, read.samples), (6, 384));
    // 6 x (64 + 64 x 0.4) = 537 projected from the reports alone.
    assert_eq!(read.projected, 537);
    let full = read.completed_by_round(&began, 10_000, 1024, 10_900);
    assert_eq!(
        (full.peers_in_epoch, full.peers, full.samples),
        (16, 16, 384)
    );
    assert_eq!(full.samples_per_second, 1024.0);
    // 1024 samples/s for 0.9 s.
    assert_eq!(full.projected, 921);
    assert!((full.eta.as_secs_f64() - 103.0 / 1024.0).abs() < 1e-9);
    assert!(!full.ready);
    // This peer computed 64 samples in the epoch: the others, 15 x 64 by the same time.
    let mut mine = full.clone();
    mine.own_samples = 64;
    assert_eq!(mine.projected_with(64, 64.0), 64 + 15 * 64);
    // Unchanged: another epoch, another set of live peers (one joined), or a reading in
    // which every live peer reported.
    let other_epoch = SwarmProgress {
        epoch: 8,
        ..began.clone()
    };
    assert_eq!(
        read.completed_by_round(&other_epoch, 10_000, 1024, 10_900),
        read
    );
    let joined = SwarmProgress {
        peers: 15,
        peers_in_epoch: 15,
        ..began.clone()
    };
    assert_eq!(read.completed_by_round(&joined, 10_000, 1024, 10_900), read);
    let all: Vec<PeerProgress> = (0..16).map(|_| r(9, 32, 60.0, 10_500)).collect();
    let all = SwarmProgress::estimate(&all, 1024, 10_900);
    assert_eq!(all.completed_by_round(&began, 10_000, 1024, 10_900), all);
}

#[test]
fn the_latest_epoch_counts_and_reports_are_extrapolated() {
    // Two peers in epoch 5: 100 + 200 samples reported 2 s ago at 50 and 25 samples/s.
    let s = SwarmProgress::estimate(
        &[
            r(5, 100, 50.0, 8_000),
            r(5, 200, 25.0, 8_000),
            r(4, 10_000, 1e6, 8_000),
        ],
        1000,
        10_000,
    );
    assert_eq!(s.epoch, 5);
    assert_eq!((s.samples, s.projected), (300, 300 + 150));
    assert_eq!(s.samples_per_second, 75.0);
    assert_eq!((s.peers_in_epoch, s.peers), (2, 3));
    assert!(!s.ready);
    // 550 samples to go at 75 samples/s.
    let expected = 550.0 / 75.0;
    assert!((s.eta.as_secs_f64() - expected).abs() < 1e-9, "{:?}", s.eta);
    assert!(s.is_behind(4) && !s.is_behind(5));
}

#[test]
fn unconnected_peers_count_only_while_their_reports_are_fresh() {
    let peers: Vec<PeerId> = (0..4).map(|_| PeerId::random()).collect();
    let (me, linked, quiet, fresh) = (peers[0], peers[1], peers[2], peers[3]);
    let now = 100_000;
    let reports = vec![
        (me, r(1, 1, 1.0, now - 25_000)),
        (linked, r(1, 2, 1.0, now - 25_000)),
        // Not connected, last heard 12 s ago: crashed (its connections closed).
        (quiet, r(1, 4, 1.0, now - 12_000)),
        // Not connected but reported 3 s ago: alive in a large swarm.
        (fresh, r(1, 8, 1.0, now - 3_000)),
    ];
    let live = live_reports(
        reports.clone(),
        me,
        &[linked],
        &[],
        Duration::from_secs(10),
        now,
    );
    let samples: Vec<u64> = live.iter().map(|(_, r)| r.samples).collect();
    assert_eq!(samples, [1, 2, 8]);
    // Peers refused for lying never count, connected or fresh; this peer's own always does.
    let ignored = [me, linked, fresh];
    let live = live_reports(
        reports,
        me,
        &[linked],
        &ignored,
        Duration::from_secs(10),
        now,
    );
    let samples: Vec<u64> = live.iter().map(|(_, r)| r.samples).collect();
    assert_eq!(samples, [1]);
}

#[test]
fn a_covered_epoch_is_published_late_and_its_members_reports_lifted() {
    let second = Duration::from_secs(1);
    let ms = Duration::from_millis;
    // Uncovered: a new epoch is due at once; the same epoch after the interval.
    assert!(is_due(None, 3, None, second));
    assert!(is_due(Some((ms(1), 2)), 3, None, second));
    assert!(!is_due(Some((ms(1), 3)), 3, None, second));
    assert!(is_due(Some((second, 3)), 3, None, second));
    // Covered, every 4 epochs: a new epoch is due only at a multiple of 4.
    assert!(!is_due(Some((ms(1), 2)), 3, Some(4), second));
    assert!(!is_due(Some((ms(90), 2)), 3, Some(4), second));
    assert!(is_due(Some((ms(1), 3)), 4, Some(4), second));
    assert!(!is_due(Some((ms(1), 4)), 4, Some(4), second));
    assert!(is_due(Some((second, 3)), 3, Some(4), second));
    assert_eq!(covered_stride(Duration::from_millis(26)), 2);
    assert_eq!(covered_stride(Duration::from_millis(1)), 64);
    assert_eq!(covered_stride(Duration::from_micros(10)), 1024);
    assert_eq!(covered_stride(Duration::ZERO), 1024);

    let (me, other, joiner) = (PeerId::random(), PeerId::random(), PeerId::random());
    let covered = Covered {
        epoch: 9,
        peers: vec![me, other],
        since_ms: 5_000,
        stride: 8,
    };
    let mut reports = vec![
        (me, r(6, 40, 100.0, 4_000)),
        // Published after the round: its part of the round failed, it is in epoch 8.
        (other, r(8, 30, 50.0, 5_010)),
    ];
    assert!(lift_covered(&mut reports, Some(&covered)));
    assert_eq!(reports[0].1, r(9, 0, 100.0, 5_000));
    assert_eq!(reports[1].1, r(8, 30, 50.0, 5_010));
    // Written before the round ended: lifted; one of a later epoch stays.
    let mut reports = vec![(other, r(8, 30, 50.0, 4_990)), (me, r(10, 1, 1.0, 4_000))];
    assert!(lift_covered(&mut reports, Some(&covered)));
    assert_eq!(reports[0].1, r(9, 0, 50.0, 5_000));
    assert_eq!(reports[1].1, r(10, 1, 1.0, 4_000));
    // A peer outside the round: nothing is lifted, and the caller forgets the cover.
    let mut reports = vec![(me, r(6, 40, 100.0, 4_000)), (joiner, r(9, 0, 1.0, 5_100))];
    let before = reports.clone();
    assert!(!lift_covered(&mut reports, Some(&covered)));
    assert_eq!(reports, before);
    assert!(!lift_covered(&mut reports, None));
    // The lifted reading: both members in epoch 9, the time to the target from their rates.
    let mut reports = vec![
        (me, r(8, 500, 100.0, 4_000)),
        (other, r(8, 400, 100.0, 4_500)),
    ];
    lift_covered(&mut reports, Some(&covered));
    let lifted: Vec<PeerProgress> = reports.into_iter().map(|(_, r)| r).collect();
    let s = SwarmProgress::estimate(&lifted, 1_000, 6_000);
    assert_eq!((s.epoch, s.peers_in_epoch, s.peers), (9, 2, 2));
    assert_eq!((s.samples, s.projected), (0, 200));
    assert_eq!(s.eta, Duration::from_secs(4));
}

#[test]
fn nobody_progressing_and_bad_rates_never_panic() {
    let s = SwarmProgress::estimate(&[], 10, 0);
    assert_eq!(
        (s.epoch, s.samples, s.ready, s.eta),
        (0, 0, false, Duration::MAX)
    );
    let s = SwarmProgress::estimate(
        &[
            r(1, 3, f64::NAN, 0),
            r(1, 4, -5.0, 0),
            r(1, 1, f64::INFINITY, 0),
        ],
        10,
        u64::MAX,
    );
    assert_eq!((s.samples, s.projected, s.samples_per_second), (8, 8, 0.0));
    assert_eq!(s.eta, Duration::MAX);
    // A report from the future (clock skew) is taken as it is.
    let s = SwarmProgress::estimate(&[r(0, 7, 100.0, 50_000)], 10, 1_000);
    assert_eq!((s.samples, s.projected), (7, 7));
    // Enough samples: ready, nothing left to wait.
    let s = SwarmProgress::estimate(&[r(2, u64::MAX, 1.0, 0)], 10, 1_000);
    assert!(s.ready);
    assert_eq!(s.eta, Duration::ZERO);
}
