//! Who reduces what: span fractions for a group (the load-balancing solve or an equal split),
//! the re-delegation plan for a failed reducer's span, and transfer-time estimates. Pure
//! functions: every peer computes the same plan from the same inputs.

use std::collections::BTreeSet;
use std::ops::Range;
use std::time::Duration;

use crate::config::{AveragerConfig, AveragingMode};
use crate::partition::{denoise_bandwidths, solve_fractions, spans};
use crate::wire::MemberIdx;

/// Span fractions for members with these bandwidths and modes: the load-balancing solve, or an
/// equal split among the members that may reduce. `None` when nobody may reduce.
pub(crate) fn fractions(
    cfg: &AveragerConfig,
    bandwidths: &[f64],
    modes: &[AveragingMode],
) -> Option<Vec<f64>> {
    if cfg.load_balance {
        return solve_fractions(&denoise_bandwidths(bandwidths), modes);
    }
    let reducers = modes
        .iter()
        .filter(|m| **m != AveragingMode::Client)
        .count();
    (reducers > 0).then(|| {
        modes
            .iter()
            .map(|m| {
                if *m == AveragingMode::Client {
                    0.0
                } else {
                    1.0 / reducers as f64
                }
            })
            .collect()
    })
}

/// How the span of failed reducer `failed` is split over the surviving reducers, as seen by a
/// peer that believes the members in `down` failed too: `(member, part)` for every non-empty
/// part, in range order, covering the whole span (empty when no reducer survives).
///
/// A surviving reducer is a member with a non-empty span in `ranges`, other than `failed` and
/// the members in `down`; parts are sized by the same solve as the round's spans, over the
/// survivors' declared bandwidths. Deterministic: equal inputs give equal plans on every peer.
pub(crate) fn repair_plan(
    cfg: &AveragerConfig,
    ranges: &[Range<usize>],
    bandwidths: &[f64],
    modes: &[AveragingMode],
    failed: MemberIdx,
    down: &BTreeSet<MemberIdx>,
) -> Vec<(MemberIdx, Range<usize>)> {
    let Some(span) = failed
        .within(ranges.len())
        .map(|f| ranges[f].clone())
        .filter(|r| !r.is_empty())
    else {
        return vec![];
    };
    let survivors: Vec<MemberIdx> = MemberIdx::all(ranges.len())
        .filter(|&i| i != failed && !ranges[i.get()].is_empty() && !down.contains(&i))
        .collect();
    if survivors.is_empty() {
        return vec![];
    }
    let bw: Vec<f64> = survivors.iter().map(|i| bandwidths[i.get()]).collect();
    let sub_modes: Vec<AveragingMode> = survivors.iter().map(|i| modes[i.get()]).collect();
    let Some(f) = fractions(cfg, &bw, &sub_modes) else {
        return vec![];
    };
    spans(span.len(), &f)
        .into_iter()
        .zip(survivors)
        .filter(|(part, _)| !part.is_empty())
        .map(|(part, i)| (i, span.start + part.start..span.start + part.end))
        .collect()
}

/// Time to move `len` f32 values out and back at `bandwidth` bytes per second.
pub(crate) fn transfer_estimate(len: usize, bandwidth: f64) -> Duration {
    Duration::try_from_secs_f64(2.0 * 4.0 * len as f64 / bandwidth).unwrap_or(Duration::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::AveragingMode::{Client, Node};

    fn idx(v: &[(u32, Range<usize>)]) -> Vec<(MemberIdx, Range<usize>)> {
        v.iter().map(|(i, r)| (MemberIdx(*i), r.clone())).collect()
    }

    #[test]
    fn repair_plan_splits_the_failed_span_over_survivors_only() {
        let cfg = AveragerConfig::new("plan");
        let ranges = vec![0..25, 25..50, 50..50, 50..100];
        let bw = [1e8; 4];
        let modes = [Node, Node, Client, Node];
        let none = BTreeSet::new();
        // Member 3 failed: its span goes to the two other reducers (not the client), in halves.
        let plan = repair_plan(&cfg, &ranges, &bw, &modes, MemberIdx(3), &none);
        assert_eq!(plan, idx(&[(0, 50..75), (1, 75..100)]));
        assert_eq!(
            plan,
            repair_plan(&cfg, &ranges, &bw, &modes, MemberIdx(3), &none)
        );
        // A reducer seen failing too gets nothing.
        let down = BTreeSet::from([MemberIdx(3), MemberIdx(1)]);
        assert_eq!(
            repair_plan(&cfg, &ranges, &bw, &modes, MemberIdx(3), &down),
            idx(&[(0, 50..100)])
        );
        // Nobody left, an empty span, or an index out of range: no plan.
        let all = BTreeSet::from([MemberIdx(0), MemberIdx(1)]);
        assert!(repair_plan(&cfg, &ranges, &bw, &modes, MemberIdx(3), &all).is_empty());
        assert!(repair_plan(&cfg, &ranges, &bw, &modes, MemberIdx(2), &none).is_empty());
        assert!(repair_plan(&cfg, &ranges, &bw, &modes, MemberIdx(9), &none).is_empty());
        // Parts follow bandwidth like the round's spans.
        let bw = [3e9, 1e8, 1e8, 1e8];
        let plan = repair_plan(&cfg, &ranges, &bw, &modes, MemberIdx(3), &none);
        assert_eq!(plan.first().map(|p| p.1.start), Some(50));
        assert_eq!(plan.last().map(|p| p.1.end), Some(100));
        assert!(plan[0].1.len() > plan[1].1.len(), "{plan:?}");
    }

    #[test]
    fn equal_split_skips_clients() {
        let mut cfg = AveragerConfig::new("plan");
        cfg.load_balance = false;
        assert_eq!(
            fractions(&cfg, &[1.0, 9.0, 5.0], &[Node, Client, Node]),
            Some(vec![0.5, 0.0, 0.5])
        );
        assert_eq!(fractions(&cfg, &[1.0], &[Client]), None);
    }

    #[test]
    fn transfer_estimate_never_panics() {
        assert_eq!(transfer_estimate(1000, 8000.0), Duration::from_secs(1));
        assert_eq!(transfer_estimate(1000, 0.0), Duration::MAX);
        assert_eq!(transfer_estimate(1000, f64::NAN), Duration::MAX);
    }
}
