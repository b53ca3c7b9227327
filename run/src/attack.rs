//! A peer that lies on purpose (`starling train --byzantine ATTACK`), to test a swarm's
//! defences with separate processes before opening it to volunteers: each batch's gradient is
//! replaced by a wrong one before the collaborative optimizer sees it, so the peer sends the
//! lie in every round (and, with worker momentum, the momentum of its lies), while it applies
//! the swarm's averaged step like everyone else. Whether the lie lands is up to the run's
//! `--aggregation` (see the README's "Peers who lie").

use std::fmt;
use std::str::FromStr;

use rand::Rng;

/// What a lying peer sends instead of its gradient.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Attack {
    /// The gradient times `K` (`scale:K`, e.g. `scale:100`).
    Scale(f32),
    /// The gradient with its sign flipped (`sign-flip`).
    SignFlip,
    /// Gaussian noise whose norm is about `K` times the gradient's (`noise:K`).
    Noise(f32),
}

impl FromStr for Attack {
    type Err = String;

    /// ```
    /// use starling_run::attack::Attack;
    /// assert_eq!("scale:100".parse::<Attack>(), Ok(Attack::Scale(100.0)));
    /// assert_eq!("sign-flip".parse::<Attack>(), Ok(Attack::SignFlip));
    /// assert!("noise:nan".parse::<Attack>().is_err());
    /// ```
    fn from_str(s: &str) -> Result<Self, String> {
        let factor = |k: &str| -> Result<f32, String> {
            match k.parse::<f32>() {
                Ok(k) if k.is_finite() && k > 0.0 => Ok(k),
                _ => Err(format!("{k:?}: the factor must be a finite number above 0")),
            }
        };
        match s.split_once(':') {
            None if s == "sign-flip" => Ok(Attack::SignFlip),
            Some(("scale", k)) => factor(k).map(Attack::Scale),
            Some(("noise", k)) => factor(k).map(Attack::Noise),
            _ => Err(format!(
                "unknown attack {s:?}: scale:K, sign-flip or noise:K"
            )),
        }
    }
}

impl fmt::Display for Attack {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Attack::Scale(k) => write!(f, "scale:{k}"),
            Attack::SignFlip => write!(f, "sign-flip"),
            Attack::Noise(k) => write!(f, "noise:{k}"),
        }
    }
}

impl Attack {
    /// Replaces `grads` (one batch's gradient) with the lie.
    pub fn apply(&self, grads: &mut [f32], rng: &mut impl Rng) {
        match *self {
            Attack::Scale(k) => grads.iter_mut().for_each(|g| *g *= k),
            Attack::SignFlip => grads.iter_mut().for_each(|g| *g = -*g),
            Attack::Noise(k) => {
                if grads.is_empty() {
                    return;
                }
                let norm = grads
                    .iter()
                    .map(|g| f64::from(*g).powi(2))
                    .sum::<f64>()
                    .sqrt();
                let sd = f64::from(k) * norm / (grads.len() as f64).sqrt();
                let noise = starling_compression::synthetic::normal(grads.len(), rng.gen());
                for (g, z) in grads.iter_mut().zip(noise) {
                    *g = (sd * f64::from(z)) as f32;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    fn grads(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        (0..n).map(|_| rng.gen_range(-1.0..1.0)).collect()
    }

    #[test]
    fn parses_and_prints_every_attack_and_refuses_the_rest() {
        for s in ["scale:100", "sign-flip", "noise:100", "scale:0.5"] {
            assert_eq!(s.parse::<Attack>().unwrap().to_string(), s);
        }
        for bad in [
            "",
            "scale",
            "scale:",
            "scale:0",
            "scale:-1",
            "scale:inf",
            "noise:x",
            "flip",
            "sign-flip:2",
        ] {
            assert!(bad.parse::<Attack>().is_err(), "{bad:?} was accepted");
        }
    }

    #[test]
    fn scale_and_sign_flip_are_exact() {
        let g = grads(1000, 1);
        let mut rng = rand::rngs::StdRng::seed_from_u64(0);
        let mut s = g.clone();
        Attack::Scale(100.0).apply(&mut s, &mut rng);
        assert!(s.iter().zip(&g).all(|(s, g)| *s == 100.0 * g));
        let mut f = g.clone();
        Attack::SignFlip.apply(&mut f, &mut rng);
        assert!(f.iter().zip(&g).all(|(f, g)| *f == -g));
    }

    #[test]
    fn noise_has_the_asked_norm_and_nothing_of_the_gradient() {
        let n = 100_000;
        let g = grads(n, 2);
        let norm = |v: &[f32]| v.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let mut v = g.clone();
        Attack::Noise(100.0).apply(&mut v, &mut rng);
        // The norm of n standard normals is sqrt(n) within a few percent at this n.
        let ratio = norm(&v) / norm(&g);
        assert!((ratio / 100.0 - 1.0).abs() < 0.02, "norm ratio {ratio}");
        let mean = v.iter().map(|x| f64::from(*x)).sum::<f64>() / n as f64;
        let sd = norm(&v) / (n as f64).sqrt();
        assert!(
            mean.abs() < 5.0 * sd / (n as f64).sqrt(),
            "mean {mean}, sd {sd}"
        );
        let dot: f64 = v
            .iter()
            .zip(&g)
            .map(|(a, b)| f64::from(*a) * f64::from(*b))
            .sum();
        let cos = dot / (norm(&v) * norm(&g));
        assert!(
            cos.abs() < 0.02,
            "noise correlates with the gradient: cos {cos}"
        );
        let mut empty: Vec<f32> = Vec::new();
        Attack::Noise(1.0).apply(&mut empty, &mut rng);
    }
}
