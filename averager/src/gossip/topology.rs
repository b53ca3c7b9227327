//! Who a peer averages with in a round: pure functions of the topology, this peer's rank among
//! the live members (sorted peer ids), their number and the round, unit-tested without a network.

use std::fmt;
use std::str::FromStr;

use rand::{seq::index::sample, SeedableRng};

/// The graph gossip runs on. Ranks are positions in the sorted list of live members' peer ids,
/// so every peer that sees the same members builds the same graph; it is rebuilt whenever the
/// members change (peers join, leave, or are skipped after failing).
///
/// In every topology a peer *initiates* exchanges with the neighbours below and *answers* the
/// peers that initiate with it, so with `n` peers each round uses every edge of the graph.
///
/// ```
/// use starling_averager::gossip::Topology;
/// let t: Topology = "random-3".parse().unwrap();
/// assert_eq!(t, Topology::RandomK(3));
/// assert_eq!(Topology::Exponential.targets(0, 16, 0, 0), vec![1, 2, 4, 8]);
/// assert_eq!(Topology::OnePeerExponential.targets(0, 16, 2, 0), vec![4]);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Topology {
    /// Rank `i` initiates with `i + 1` (mod n); it answers `i - 1`. Slow mixing (the gap of a
    /// cycle), two exchanges per peer and round.
    Ring,
    /// Static exponential graph: rank `i` initiates with `i + 2^k` (mod n) for every `2^k < n`
    /// (log2 n exchanges per round, fast mixing).
    Exponential,
    /// `k` distinct random peers per round, drawn afresh each round.
    RandomK(usize),
    /// One-peer dynamic exponential graph: in round `r` rank `i` initiates with `i + 2^(r mod
    /// tau)` (mod n), `tau = ceil(log2 n)`: one exchange per peer and round, a different
    /// neighbour each round (Ying et al. 2021, "Exponential graph is provably efficient").
    OnePeerExponential,
}

impl Topology {
    /// The ranks that rank `me` of `n` initiates exchanges with in `round` (never `me`, no
    /// duplicates). `seed` makes random draws differ between peers (and repeat for a seed).
    pub fn targets(self, me: usize, n: usize, round: u64, seed: u64) -> Vec<usize> {
        if n < 2 || me >= n {
            return Vec::new();
        }
        let mut out: Vec<usize> = match self {
            Topology::Ring => vec![(me + 1) % n],
            Topology::Exponential => powers_below(n).map(|d| (me + d) % n).collect(),
            Topology::OnePeerExponential => {
                let tau = powers_below(n).count() as u64;
                let d = 1usize << (round % tau.max(1));
                vec![(me + d) % n]
            }
            Topology::RandomK(k) => {
                let mut rng = rand::rngs::StdRng::seed_from_u64(
                    seed ^ round.wrapping_mul(0x9e37_79b9_7f4a_7c15),
                );
                let k = k.clamp(1, n - 1);
                // Draw among the n - 1 others, then skip over `me`.
                sample(&mut rng, n - 1, k)
                    .into_iter()
                    .map(|j| if j >= me { j + 1 } else { j })
                    .collect()
            }
        };
        let mut seen = Vec::with_capacity(out.len());
        out.retain(|&j| {
            j != me && !seen.contains(&j) && {
                seen.push(j);
                true
            }
        });
        out
    }
}

/// `1, 2, 4, ...` below `n`.
fn powers_below(n: usize) -> impl Iterator<Item = usize> {
    (0..usize::BITS)
        .map(|k| 1usize << k)
        .take_while(move |&d| d < n)
}

impl fmt::Display for Topology {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Topology::Ring => f.write_str("ring"),
            Topology::Exponential => f.write_str("exponential"),
            Topology::RandomK(k) => write!(f, "random-{k}"),
            Topology::OnePeerExponential => f.write_str("one-peer-exponential"),
        }
    }
}

impl FromStr for Topology {
    type Err = String;

    /// `ring`, `exponential` (or `exp`), `random-K` (or `random`, k = 1),
    /// `one-peer-exponential` (or `one-peer-exp`, `onepeer`).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim().to_ascii_lowercase();
        match s.as_str() {
            "ring" => return Ok(Topology::Ring),
            "exponential" | "exp" => return Ok(Topology::Exponential),
            "one-peer-exponential" | "one-peer-exp" | "onepeer" => {
                return Ok(Topology::OnePeerExponential)
            }
            "random" => return Ok(Topology::RandomK(1)),
            _ => {}
        }
        if let Some(k) = s.strip_prefix("random-") {
            if let Ok(k) = k.parse::<usize>() {
                if k >= 1 {
                    return Ok(Topology::RandomK(k));
                }
            }
        }
        Err(format!(
            "unknown topology {s:?}: use ring, exponential, random-K (K >= 1) or one-peer-exponential"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::Topology;

    #[test]
    fn neighbours_follow_the_definitions() {
        assert_eq!(Topology::Ring.targets(15, 16, 3, 0), vec![0]);
        assert_eq!(Topology::Ring.targets(0, 2, 0, 0), vec![1]);
        assert_eq!(
            Topology::Exponential.targets(3, 16, 0, 0),
            vec![4, 5, 7, 11]
        );
        // n = 5: distances 1, 2, 4.
        assert_eq!(Topology::Exponential.targets(4, 5, 9, 0), vec![0, 1, 3]);
        let one: Vec<usize> = (0..8)
            .map(|r| Topology::OnePeerExponential.targets(1, 16, r, 0)[0])
            .collect();
        assert_eq!(one, vec![2, 3, 5, 9, 2, 3, 5, 9]);
        // Alone, or not a member: nobody.
        assert!(Topology::Ring.targets(0, 1, 0, 0).is_empty());
        assert!(Topology::Exponential.targets(5, 5, 0, 0).is_empty());
    }

    #[test]
    fn random_k_draws_distinct_others_and_varies_by_round() {
        for me in 0..6 {
            for round in 0..20 {
                let t = Topology::RandomK(3).targets(me, 6, round, 42);
                assert_eq!(t.len(), 3);
                assert!(!t.contains(&me) && t.iter().all(|&j| j < 6));
                let mut d = t.clone();
                d.sort();
                d.dedup();
                assert_eq!(d.len(), 3);
            }
        }
        // k larger than the others: all of them.
        assert_eq!(Topology::RandomK(9).targets(0, 3, 0, 1).len(), 2);
        let rounds: Vec<Vec<usize>> = (0..10)
            .map(|r| Topology::RandomK(1).targets(0, 16, r, 7))
            .collect();
        assert!(rounds.windows(2).any(|w| w[0] != w[1]));
    }

    #[test]
    fn names_round_trip() {
        for t in [
            Topology::Ring,
            Topology::Exponential,
            Topology::RandomK(4),
            Topology::OnePeerExponential,
        ] {
            assert_eq!(t.to_string().parse::<Topology>(), Ok(t));
        }
        assert!("random-0".parse::<Topology>().is_err());
        assert!("star".parse::<Topology>().is_err());
    }
}
