//! A peer that lies on purpose (`starling train --byzantine ATTACK`), to test a swarm's
//! defences with separate processes before opening it to volunteers. A lying *sender*
//! (`scale:K`, `sign-flip`, `noise:K`): each batch's gradient is replaced by a wrong one before
//! the collaborative optimizer sees it, so the peer sends the lie in every round (and, with
//! worker momentum, the momentum of its lies), while it applies the swarm's averaged step like
//! everyone else; whether the lie lands is up to the run's `--aggregation`. A lying *reducer*
//! (`reducer:K`): it sends its true gradient, but the results it returns for its span are K too
//! high (`AveragerConfig::result_bias`); a run with `--verify` above 0 catches it, publishes
//! the evidence and refuses it, one without applies the lie. See the README's "Peers who lie".

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
    /// As a reducer, `K` added to every value of the results it returns (`reducer:K`, `K` any
    /// finite number but 0); its gradients are true.
    ReducerBias(f32),
}

impl FromStr for Attack {
    type Err = String;

    /// ```
    /// use starling_run::attack::Attack;
    /// assert_eq!("scale:100".parse::<Attack>(), Ok(Attack::Scale(100.0)));
    /// assert_eq!("sign-flip".parse::<Attack>(), Ok(Attack::SignFlip));
    /// assert!("noise:nan".parse::<Attack>().is_err());
    /// assert_eq!("reducer:-0.5".parse::<Attack>(), Ok(Attack::ReducerBias(-0.5)));
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
            Some(("reducer", k)) => match k.parse::<f32>() {
                Ok(k) if k.is_finite() && k != 0.0 => Ok(Attack::ReducerBias(k)),
                _ => Err(format!(
                    "{k:?}: the bias must be a finite number other than 0"
                )),
            },
            _ => Err(format!(
                "unknown attack {s:?}: scale:K, sign-flip, noise:K or reducer:K"
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
            Attack::ReducerBias(k) => write!(f, "reducer:{k}"),
        }
    }
}

impl Attack {
    /// What a lying reducer adds to its results (`AveragerConfig::result_bias`), if this is
    /// that attack.
    pub fn result_bias(&self) -> Option<f32> {
        match *self {
            Attack::ReducerBias(k) => Some(k),
            _ => None,
        }
    }

    /// Replaces `grads` (one batch's gradient) with the lie; a lying reducer's gradients stay
    /// true.
    pub fn apply(&self, grads: &mut [f32], rng: &mut impl Rng) {
        match *self {
            Attack::ReducerBias(_) => {}
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
        for s in [
            "scale:100",
            "sign-flip",
            "noise:100",
            "scale:0.5",
            "reducer:1",
            "reducer:-0.25",
        ] {
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
            "reducer:0",
            "reducer:nan",
            "reducer",
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
        // A lying reducer sends its true gradient; its lie is in the averager's results.
        let mut r = g.clone();
        Attack::ReducerBias(1.0).apply(&mut r, &mut rng);
        assert_eq!(r, g);
        assert_eq!(Attack::ReducerBias(1.0).result_bias(), Some(1.0));
        assert_eq!(Attack::Scale(2.0).result_bias(), None);
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
