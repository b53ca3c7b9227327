//! How a reducer combines the contributions to its span: the weighted mean, or an aggregator
//! that a few lying peers cannot move far ([`Aggregation`]).
//!
//! A reducer aggregates **part by part** (a chunk's worth of elements at a time, as the parts
//! arrive), so the robust aggregators act on each part: the coordinate-wise ones (median,
//! trimmed mean) are unaffected by that, and centered clipping measures distances over the part's
//! coordinates. Each part sees the decoded values of every sender that delivered it (whatever
//! the codec) and their weights.
//!
//! Weights are claims: a peer that says it computed a million samples would outweigh everyone
//! under any weighted rule. The robust aggregators therefore cap every weight at twice the
//! median weight of the part's contributors before using it (honest peers' weights are within
//! a small factor of each other: samples per step).
//!
//! What they bound, with `f` liars among `n` contributors:
//! - `median` (coordinate-wise, weighted): each coordinate stays within the range of the
//!   honest values while liars hold less than half the weight.
//! - `trimmed-mean:β` drops the weight fraction β from each end of every coordinate and
//!   averages the rest: with f/n ≤ β the liars' values are either dropped or lie between honest
//!   ones.
//! - `centered-clip` (Karimireddy, He and Jaggi 2021, as BTARD runs it): starting from the
//!   contribution closest to the others (the weighted medoid), `v ← v + Σ wᵢ·min(1, τ/‖xᵢ − v‖)·(xᵢ − v) / Σ wᵢ`, `iters` times (or until `v`
//!   stops moving); τ is fixed (`tau=`) or, by default, the median distance of the contributions
//!   from the current centre, so a contribution far from the others moves `v` by at most its
//!   weight share times τ per iteration however large it is. It stops early once the centre
//!   moves by less than 10⁻⁵ τ. Unlike the coordinate-wise rules it
//!   keeps the mean's precision when everyone is honest (nothing is clipped much).
//!   With `reject=K`, a contribution still farther than K times the clipping radius from the
//!   converged centre is then left out, and clipping runs again from that centre over the
//!   others (only while those left out hold less than half the weight). A clipped contribution
//!   still pulls the centre by its weight share times τ each iteration, so clipping alone keeps
//!   a bias towards liars that sit a few radii out (a flipped momentum does); leaving them out
//!   removes it. Honest contributions of a part of many coordinates lie within a few tens of
//!   percent of the median distance, so K = 2 leaves none of them out.
//!
//! None of them stops a liar who stays within the honest spread (the "a little is enough"
//! attack shifts every coordinate by a fraction of the honest standard deviation): they bound
//! the damage, they do not detect it.

use std::fmt;
use std::str::FromStr;

/// How a reducer combines the contributions to its span (`AveragerConfig::aggregation`). All
/// members of a group use the same: peers with different aggregations never group (as with a
/// different codec). Parsed from and printed as `mean`, `median`, `trimmed-mean[:FRACTION]`,
/// `centered-clip[:iters=N][,tau=T][,reject=K]`.
///
/// ```
/// use starling_averager::Aggregation;
/// let a: Aggregation = "centered-clip:iters=20,tau=0.5".parse().unwrap();
/// assert_eq!(a, Aggregation::CenteredClip { iterations: 20, radius: Some(0.5), reject: None });
/// assert_eq!(a.to_string(), "centered-clip:iters=20,tau=0.5");
/// let r: Aggregation = "centered-clip:reject=2".parse().unwrap();
/// assert_eq!(r.to_string(), "centered-clip:iters=5,reject=2");
/// assert_eq!("trimmed-mean".parse::<Aggregation>().unwrap(), Aggregation::TrimmedMean { trim: 0.25 });
/// assert!("mode".parse::<Aggregation>().is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum Aggregation {
    /// The weighted mean (exact, the default): one liar moves it anywhere.
    #[default]
    Mean,
    /// Coordinate-wise weighted median.
    Median,
    /// Coordinate-wise weighted mean of what is left after dropping the weight fraction `trim`
    /// (in `[0, 0.5)`) from each end.
    TrimmedMean {
        /// The fraction of the weight dropped at each end (default 0.25).
        trim: f32,
    },
    /// Centered clipping around a running centre (see the module docs).
    CenteredClip {
        /// At most this many clipping iterations (default 5; 1 to 100).
        iterations: u32,
        /// The clipping radius; `None` (the default): the median distance from the centre,
        /// recomputed every iteration.
        radius: Option<f32>,
        /// Leave out contributions farther than this many radii from the converged centre
        /// and clip again over the rest (at least 1); `None` (the default): keep everyone.
        reject: Option<f32>,
    },
}

/// Default iterations of centered clipping.
const CLIP_ITERATIONS: u32 = 5;
/// Default trimmed fraction at each end.
const TRIM: f32 = 0.25;

impl Aggregation {
    /// Whether this is the plain weighted mean.
    pub fn is_mean(&self) -> bool {
        matches!(self, Aggregation::Mean)
    }

    /// Whether each coordinate of the result depends on that coordinate of the inputs alone
    /// (every aggregation but `centered-clip`), so a block of it can be recomputed by itself.
    ///
    /// ```
    /// use starling_averager::Aggregation;
    /// assert!(Aggregation::Median.is_coordinatewise());
    /// assert!(!"centered-clip".parse::<Aggregation>().unwrap().is_coordinatewise());
    /// ```
    pub fn is_coordinatewise(&self) -> bool {
        !matches!(self, Aggregation::CenteredClip { .. })
    }

    /// Checks the parameters.
    pub fn validate(&self) -> Result<(), String> {
        match *self {
            Aggregation::Mean | Aggregation::Median => Ok(()),
            Aggregation::TrimmedMean { trim } => {
                if (0.0..0.5).contains(&trim) {
                    Ok(())
                } else {
                    Err(format!(
                        "trimmed-mean: the fraction {trim} is not in [0, 0.5)"
                    ))
                }
            }
            Aggregation::CenteredClip {
                iterations,
                radius,
                reject,
            } => {
                if let Some(k) = reject.filter(|k| !(k.is_finite() && *k >= 1.0)) {
                    return Err(format!("centered-clip: reject={k} is not a number >= 1"));
                }
                if !(1..=100).contains(&iterations) {
                    return Err(format!(
                        "centered-clip: iters={iterations} is not in 1..=100"
                    ));
                }
                match radius {
                    Some(t) if !(t.is_finite() && t > 0.0) => {
                        Err(format!("centered-clip: tau={t} is not a positive number"))
                    }
                    _ => Ok(()),
                }
            }
        }
    }

    /// Writes the aggregate of `inputs` (weight, values; every slice `out.len()` long) into
    /// `out`. Weights sum to zero: every input counts equally.
    pub(crate) fn aggregate(&self, out: &mut [f32], inputs: &[(f64, &[f32])]) {
        if inputs.is_empty() {
            return;
        }
        match *self {
            Aggregation::Mean => weighted_mean(out, inputs, &plain_weights(inputs)),
            Aggregation::Median => {
                trimmed(out, inputs, &capped_weights(inputs), None);
            }
            Aggregation::TrimmedMean { trim } => {
                trimmed(out, inputs, &capped_weights(inputs), Some(f64::from(trim)));
            }
            Aggregation::CenteredClip {
                iterations,
                radius,
                reject,
            } => centered_clip(
                out,
                inputs,
                &capped_weights(inputs),
                iterations,
                radius,
                reject,
            ),
        }
    }
}

impl fmt::Display for Aggregation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Aggregation::Mean => write!(f, "mean"),
            Aggregation::Median => write!(f, "median"),
            Aggregation::TrimmedMean { trim } => write!(f, "trimmed-mean:{trim}"),
            Aggregation::CenteredClip {
                iterations,
                radius,
                reject,
            } => {
                write!(f, "centered-clip:iters={iterations}")?;
                if let Some(t) = radius {
                    write!(f, ",tau={t}")?;
                }
                if let Some(k) = reject {
                    write!(f, ",reject={k}")?;
                }
                Ok(())
            }
        }
    }
}

impl FromStr for Aggregation {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let (name, params) = s.split_once(':').unwrap_or((s, ""));
        let a = match name {
            "mean" if params.is_empty() => Aggregation::Mean,
            "median" if params.is_empty() => Aggregation::Median,
            "trimmed-mean" => Aggregation::TrimmedMean {
                trim: if params.is_empty() {
                    TRIM
                } else {
                    params
                        .parse()
                        .map_err(|_| format!("trimmed-mean: {params:?} is not a fraction"))?
                },
            },
            "centered-clip" => {
                let (mut iterations, mut radius, mut reject) = (CLIP_ITERATIONS, None, None);
                for kv in params.split(',').filter(|p| !p.is_empty()) {
                    match kv.split_once('=') {
                        Some(("iters", v)) => {
                            iterations = v
                                .parse()
                                .map_err(|_| format!("centered-clip: iters={v} is not a count"))?
                        }
                        Some(("tau", v)) => {
                            radius =
                                Some(v.parse().map_err(|_| {
                                    format!("centered-clip: tau={v} is not a number")
                                })?)
                        }
                        Some(("reject", v)) => {
                            reject = Some(v.parse().map_err(|_| {
                                format!("centered-clip: reject={v} is not a number")
                            })?)
                        }
                        _ => {
                            return Err(format!(
                                "centered-clip: unknown parameter {kv:?} (iters=N, tau=T, \
                                 reject=K)"
                            ))
                        }
                    }
                }
                Aggregation::CenteredClip {
                    iterations,
                    radius,
                    reject,
                }
            }
            _ => {
                return Err(format!(
                    "unknown aggregation {s:?} (mean, median, trimmed-mean[:FRACTION], \
                     centered-clip[:iters=N][,tau=T][,reject=K])"
                ))
            }
        };
        a.validate()?;
        Ok(a)
    }
}

/// The weights as given, or all equal when they sum to zero.
fn plain_weights(inputs: &[(f64, &[f32])]) -> Vec<f64> {
    let total: f64 = inputs.iter().map(|(w, _)| *w).sum();
    if total > 0.0 {
        inputs.iter().map(|(w, _)| *w).collect()
    } else {
        vec![1.0; inputs.len()]
    }
}

/// [`plain_weights`], each capped at twice the median positive weight (see the module docs).
fn capped_weights(inputs: &[(f64, &[f32])]) -> Vec<f64> {
    let mut w = plain_weights(inputs);
    let mut positive: Vec<f64> = w.iter().copied().filter(|x| *x > 0.0).collect();
    positive.sort_by(f64::total_cmp);
    if let Some(median) = positive.get(positive.len() / 2) {
        let cap = 2.0 * median;
        w.iter_mut().for_each(|x| *x = x.min(cap));
    }
    w
}

fn weighted_mean(out: &mut [f32], inputs: &[(f64, &[f32])], weights: &[f64]) {
    let total: f64 = weights.iter().sum();
    out.fill(0.0);
    for ((_, values), w) in inputs.iter().zip(weights) {
        let k = (w / total) as f32;
        out.iter_mut().zip(*values).for_each(|(m, x)| *m += k * x);
    }
}

/// Coordinate-wise: the weighted median (`trim` `None`), or the weighted mean after dropping the
/// weight fraction `trim` from each end.
fn trimmed(out: &mut [f32], inputs: &[(f64, &[f32])], weights: &[f64], trim: Option<f64>) {
    let total: f64 = weights.iter().sum();
    let mut column: Vec<(f32, f64)> = Vec::with_capacity(inputs.len());
    for (j, o) in out.iter_mut().enumerate() {
        column.clear();
        column.extend(
            inputs
                .iter()
                .zip(weights)
                .filter(|(_, w)| **w > 0.0)
                .map(|((_, v), w)| (v[j], *w)),
        );
        column.sort_unstable_by(|a, b| a.0.total_cmp(&b.0));
        *o = match trim {
            None => weighted_median(&column, total),
            Some(t) => trimmed_mean(&column, total, t),
        };
    }
}

/// The weighted median of `column` (sorted by value, weights summing to `total`): the value
/// where the cumulative weight reaches half, the midpoint when it lands exactly on a boundary.
fn weighted_median(column: &[(f32, f64)], total: f64) -> f32 {
    let half = total / 2.0;
    let mut acc = 0.0;
    for (i, (x, w)) in column.iter().enumerate() {
        acc += w;
        if (acc - half).abs() <= 1e-12 * total {
            let next = column.get(i + 1).map_or(*x, |n| n.0);
            return (x + next) / 2.0;
        }
        if acc > half {
            return *x;
        }
    }
    column.last().map_or(0.0, |c| c.0)
}

/// The weighted mean of `column` (sorted) without the weight `trim x total` at each end (the
/// boundary values count in part).
fn trimmed_mean(column: &[(f32, f64)], total: f64, trim: f64) -> f32 {
    let (lo, hi) = (trim * total, (1.0 - trim) * total);
    let (mut acc, mut sum, mut kept) = (0.0, 0.0, 0.0);
    for (x, w) in column {
        let (a, b) = (acc, acc + w);
        acc = b;
        let inside = (b.min(hi) - a.max(lo)).max(0.0);
        sum += inside * f64::from(*x);
        kept += inside;
    }
    if kept > 0.0 {
        (sum / kept) as f32
    } else {
        weighted_median(column, total)
    }
}

/// Euclidean distance between `a` and `b`: f32 lanes (vectorised) per block of 1024 elements,
/// blocks summed in f64.
fn distance(a: &[f32], b: &[f32]) -> f64 {
    let mut total = 0.0f64;
    for (x, y) in a.chunks(1024).zip(b.chunks(1024)) {
        let mut lanes = [0.0f32; 8];
        let (xc, yc) = (x.chunks_exact(8), y.chunks_exact(8));
        let (xr, yr) = (xc.remainder(), yc.remainder());
        for (xs, ys) in xc.zip(yc) {
            for k in 0..8 {
                let e = xs[k] - ys[k];
                lanes[k] += e * e;
            }
        }
        let tail: f32 = xr.iter().zip(yr).map(|(p, q)| (p - q) * (p - q)).sum();
        total += f64::from(lanes.iter().sum::<f32>() + tail);
    }
    total.sqrt()
}

/// Euclidean norm of `a`, computed like [`distance`].
fn norm(a: &[f32]) -> f64 {
    let mut total = 0.0f64;
    for x in a.chunks(1024) {
        let mut lanes = [0.0f32; 8];
        let xc = x.chunks_exact(8);
        let tail: f32 = xc.remainder().iter().map(|p| p * p).sum();
        for xs in xc {
            for k in 0..8 {
                lanes[k] += xs[k] * xs[k];
            }
        }
        total += f64::from(lanes.iter().sum::<f32>() + tail);
    }
    total.sqrt()
}

/// The input with the least weighted sum of distances to the others: where centered clipping
/// starts (from the mean, liars far away would be worked off only by half per iteration).
fn medoid<'a>(inputs: &[(f64, &'a [f32])], weights: &[f64]) -> &'a [f32] {
    let n = inputs.len();
    let mut sums = vec![0.0f64; n];
    for i in 0..n {
        for j in i + 1..n {
            let d = distance(inputs[i].1, inputs[j].1);
            sums[i] += weights[j] * d;
            sums[j] += weights[i] * d;
        }
    }
    let best = (0..n)
        .filter(|i| weights[*i] > 0.0)
        .min_by(|a, b| sums[*a].total_cmp(&sums[*b]))
        .unwrap_or(0);
    inputs[best].1
}

fn centered_clip(
    out: &mut [f32],
    inputs: &[(f64, &[f32])],
    weights: &[f64],
    iterations: u32,
    radius: Option<f32>,
    reject: Option<f32>,
) {
    out.copy_from_slice(medoid(inputs, weights));
    let tau = clip_from(out, inputs, weights, iterations, radius);
    let (Some(k), Some(tau)) = (reject, tau) else {
        return;
    };
    let limit = f64::from(k) * tau;
    let mut kept = weights.to_vec();
    for (w, (_, x)) in kept.iter_mut().zip(inputs) {
        if distance(x, out) > limit {
            *w = 0.0;
        }
    }
    let (total, left): (f64, f64) = (weights.iter().sum(), kept.iter().sum());
    // Only a minority of the weight is ever left out (nothing at all when all are honest).
    if left < total && left > total / 2.0 {
        clip_from(out, inputs, &kept, iterations, radius);
    }
}

/// Centered clipping from the centre in `out` over the inputs of positive weight (see the module
/// docs); returns the last clipping radius (`None` if there was none to use).
fn clip_from(
    out: &mut [f32],
    inputs: &[(f64, &[f32])],
    weights: &[f64],
    iterations: u32,
    radius: Option<f32>,
) -> Option<f64> {
    let total: f64 = weights.iter().sum();
    let mut step = vec![0.0f32; out.len()];
    let mut distances = vec![0.0f64; inputs.len()];
    let mut last = None;
    for _ in 0..iterations {
        for (d, (_, x)) in distances.iter_mut().zip(inputs) {
            *d = distance(x, out);
        }
        let tau = match radius {
            Some(t) => f64::from(t),
            None => {
                let mut sorted: Vec<f64> = distances
                    .iter()
                    .zip(weights)
                    .filter(|(_, w)| **w > 0.0)
                    .map(|(d, _)| *d)
                    .collect();
                if sorted.is_empty() {
                    break;
                }
                sorted.sort_by(f64::total_cmp);
                sorted[sorted.len() / 2]
            }
        };
        if tau.is_nan() || tau <= 0.0 {
            break;
        }
        last = Some(tau);
        step.fill(0.0);
        for ((w, (_, x)), d) in weights.iter().zip(inputs).zip(&distances) {
            let clip = if *d > tau { tau / d } else { 1.0 };
            let k = (w * clip / total) as f32;
            if k == 0.0 {
                continue;
            }
            step.iter_mut()
                .zip(x.iter().zip(out.iter()))
                .for_each(|(s, (a, b))| *s += k * (a - b));
        }
        let moved = norm(&step);
        out.iter_mut().zip(&step).for_each(|(v, s)| *v += s);
        // Converged: the centre moved by less than a part in 10^5 of the clipping radius.
        if moved <= 1e-5 * tau {
            break;
        }
    }
    last
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn honest(rng: &mut rand::rngs::StdRng, n: usize, len: usize) -> Vec<Vec<f32>> {
        let center: Vec<f32> = (0..len).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
        (0..n)
            .map(|_| {
                center
                    .iter()
                    .map(|c| c + rng.gen_range(-0.1f32..0.1))
                    .collect()
            })
            .collect()
    }

    fn run(a: Aggregation, data: &[Vec<f32>], weights: &[f64]) -> Vec<f32> {
        let inputs: Vec<(f64, &[f32])> = weights
            .iter()
            .zip(data)
            .map(|(w, v)| (*w, v.as_slice()))
            .collect();
        let mut out = vec![f32::NAN; data[0].len()];
        a.aggregate(&mut out, &inputs);
        out
    }

    fn exact_mean(data: &[Vec<f32>]) -> Vec<f32> {
        (0..data[0].len())
            .map(|j| (data.iter().map(|v| f64::from(v[j])).sum::<f64>() / data.len() as f64) as f32)
            .collect()
    }

    fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max)
    }

    #[test]
    fn names_round_trip_and_bad_parameters_are_refused() {
        for s in [
            "mean",
            "median",
            "trimmed-mean:0.1",
            "centered-clip:iters=3",
            "centered-clip:iters=10,tau=2",
            "centered-clip:iters=5,reject=2",
            "centered-clip:iters=10,tau=2,reject=3.5",
        ] {
            let a: Aggregation = s.parse().unwrap();
            assert_eq!(a.to_string(), s);
            assert_eq!(a.to_string().parse::<Aggregation>().unwrap(), a);
        }
        for bad in [
            "trimmed-mean:0.5",
            "trimmed-mean:x",
            "centered-clip:iters=0",
            "centered-clip:tau=-1",
            "centered-clip:foo=1",
            "centered-clip:reject=0.5",
            "centered-clip:reject=inf",
            "centered-clip:reject=x",
            "mean:1",
            "avg",
        ] {
            assert!(bad.parse::<Aggregation>().is_err(), "{bad}");
        }
    }

    #[test]
    fn the_mean_is_the_exact_weighted_mean() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let data = honest(&mut rng, 5, 300);
        let w = [1.0, 2.0, 0.5, 3.0, 1.5];
        let out = run(Aggregation::Mean, &data, &w);
        let total: f64 = w.iter().sum();
        for j in 0..300 {
            let e: f64 = (0..5).map(|i| w[i] * f64::from(data[i][j])).sum::<f64>() / total;
            assert!((f64::from(out[j]) - e).abs() < 1e-6, "{j}");
        }
    }

    #[test]
    fn weighted_median_and_trimmed_mean_match_a_sort_by_hand() {
        let data: Vec<Vec<f32>> = [5.0f32, 1.0, 3.0, 100.0, 2.0]
            .iter()
            .map(|x| vec![*x])
            .collect();
        let eq = [1.0; 5];
        assert_eq!(run(Aggregation::Median, &data, &eq), vec![3.0]);
        // 20% of the weight off each end: 1 and 100 go, the mean of 2, 3, 5.
        let t = run(Aggregation::TrimmedMean { trim: 0.2 }, &data, &eq)[0];
        assert!((t - 10.0 / 3.0).abs() < 1e-6, "{t}");
        // Even count, equal weights: the midpoint of the middle two.
        let four: Vec<Vec<f32>> = [4.0f32, 1.0, 3.0, 2.0].iter().map(|x| vec![*x]).collect();
        assert_eq!(run(Aggregation::Median, &four, &[1.0; 4]), vec![2.5]);
        // A heavy weight is capped at twice the median weight: it cannot carry the median alone.
        // (Capped at 2 of 6: 1, 2, 3 hold exactly half, so the midpoint of 3 and 5.)
        let w = [1.0, 1.0, 1.0, 1000.0, 1.0];
        assert_eq!(run(Aggregation::Median, &data, &w), vec![4.0]);
    }

    #[test]
    fn robust_rules_stay_near_the_honest_mean_under_attack() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let len = 500;
        for attack in 0..3 {
            let mut data = honest(&mut rng, 6, len);
            let reference = exact_mean(&data);
            // Two liars: x1000, sign flip x10, or huge noise.
            for k in 0..2 {
                let liar: Vec<f32> = match attack {
                    0 => reference.iter().map(|x| x * 1000.0).collect(),
                    1 => reference.iter().map(|x| -10.0 * x).collect(),
                    _ => (0..len)
                        .map(|_| rng.gen_range(-100.0f32..100.0) * (k + 1) as f32)
                        .collect(),
                };
                data.push(liar);
            }
            let w = [1.0; 8];
            let spread = 0.1; // the honest values' half-width around their centre
            let mean_err = max_abs_diff(&run(Aggregation::Mean, &data, &w), &reference);
            assert!(
                mean_err > 10.0 * spread,
                "attack {attack}: the mean resisted ({mean_err})"
            );
            for a in [
                Aggregation::Median,
                Aggregation::TrimmedMean { trim: 0.25 },
                "centered-clip".parse().unwrap(),
            ] {
                let err = max_abs_diff(&run(a, &data, &w), &reference);
                assert!(err < 2.0 * spread, "attack {attack}, {a}: {err}");
            }
        }
    }

    #[test]
    fn honest_inputs_keep_the_means_precision_under_centered_clip() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let data = honest(&mut rng, 8, 1000);
        let reference = exact_mean(&data);
        let cc = run(
            Aggregation::CenteredClip {
                iterations: 10,
                radius: None,
                reject: None,
            },
            &data,
            &[1.0; 8],
        );
        // Half the inputs are clipped a little each iteration: close to the mean, not equal.
        assert!(
            max_abs_diff(&cc, &reference) < 0.02,
            "{}",
            max_abs_diff(&cc, &reference)
        );
        // A radius above every distance clips nothing: the mean itself.
        let wide = run(
            Aggregation::CenteredClip {
                iterations: 10,
                radius: Some(1e6),
                reject: None,
            },
            &data,
            &[1.0; 8],
        );
        assert!(max_abs_diff(&wide, &reference) < 1e-6);
    }

    /// Two liars send the honest centre with its sign flipped (plus their own noise): far
    /// outside the clipping radius, so clipping bounds them, but each still pulls the centre by
    /// tau per iteration. Leaving them out (`reject=2`) lands on the honest inputs' own
    /// clipped centre; with every input honest, nobody is left out and the result is plain
    /// clipping's, bit for bit.
    #[test]
    fn rejection_removes_the_pull_of_liars_a_few_radii_out() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        let len = 500;
        let honest_only = honest(&mut rng, 6, len);
        let reference = exact_mean(&honest_only);
        let mut data = honest_only.clone();
        for _ in 0..2 {
            data.push(
                reference
                    .iter()
                    .map(|x| -x + rng.gen_range(-0.1f32..0.1))
                    .collect(),
            );
        }
        let w = [1.0; 8];
        let plain: Aggregation = "centered-clip:iters=20".parse().unwrap();
        let reject: Aggregation = "centered-clip:iters=20,reject=2".parse().unwrap();
        let plain_err = max_abs_diff(&run(plain, &data, &w), &reference);
        let reject_err = max_abs_diff(&run(reject, &data, &w), &reference);
        assert!(
            reject_err < plain_err / 3.0 && reject_err < 0.05,
            "left out: {reject_err}, clipped only: {plain_err}"
        );
        // The six honest inputs alone, clipped: what rejection should have landed on.
        let alone = run(plain, &honest_only, &[1.0; 6]);
        assert!(max_abs_diff(&run(reject, &data, &w), &alone) < 1e-4);
        // All honest: nobody is farther than twice the radius.
        assert_eq!(run(reject, &honest_only, &[1.0; 6]), alone);
    }
}
