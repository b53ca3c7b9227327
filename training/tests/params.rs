//! ParamSet layout, schema hashes and seeded initialisation.

use rand::{rngs::StdRng, SeedableRng};
use starling_training::{schema_hash, Init, ParamError, ParamSet};

#[test]
fn layout_follows_registration_order() {
    let mut set = ParamSet::new();
    let a = set
        .add("a", &[2, 3], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
        .unwrap();
    let b = set.add_zeros("b", &[4]).unwrap();
    let c = set.add_zeros("c", &[0, 7]).unwrap();
    let ranges: Vec<_> = [a, b, c]
        .iter()
        .map(|&id| set.info(id).unwrap().range())
        .collect();
    assert_eq!(ranges, [0..6, 6..10, 10..10]);
    assert_eq!(
        (set.len(), set.num_tensors(), set.grads().len()),
        (10, 3, 10)
    );
    set.grads_mut()[6..10].copy_from_slice(&[1.0, 2.0, 3.0, 4.0]);
    assert_eq!(set.grad("b"), Some(&[1.0, 2.0, 3.0, 4.0][..]));
    assert_eq!(set.tensor("a").map(|t| t[5]), Some(6.0));
    assert_eq!(set.tensor("zzz"), None);
}

#[test]
fn registration_errors_say_what_is_wrong() {
    let mut set = ParamSet::new();
    set.add_zeros("w", &[2]).unwrap();
    assert_eq!(
        set.add_zeros("w", &[2]),
        Err(ParamError::Duplicate { name: "w".into() })
    );
    assert_eq!(set.add_zeros("", &[2]), Err(ParamError::EmptyName));
    let err = set.add("v", &[2, 2], &[1.0; 3]).unwrap_err();
    assert_eq!(
        err.to_string(),
        "tensor \"v\": shape [2, 2] holds 4 values but 3 were given"
    );
    assert!(matches!(
        set.add_zeros("huge", &[usize::MAX, 2]),
        Err(ParamError::ShapeOverflow { .. })
    ));
    // A failed registration changes nothing.
    assert_eq!((set.len(), set.num_tensors()), (2, 1));
}

/// The hash is part of the checkpoint format and of what peers compare: pin its value.
#[test]
fn schema_hash_is_pinned() {
    let mut set = ParamSet::new();
    set.add_zeros("l1.weight", &[16, 8]).unwrap();
    set.add_zeros("l1.bias", &[16]).unwrap();
    assert_eq!(
        set.schema_hash(),
        schema_hash([("l1.weight", &[16usize, 8][..]), ("l1.bias", &[16][..])])
    );
    assert_eq!(format!("{:016x}", set.schema_hash()), PINNED);
    assert_eq!(
        format!("{:016x}", ParamSet::new().schema_hash()),
        "cbf29ce484222325"
    );
    // Names and shapes do not run into each other.
    let h1 = schema_hash([("ab", &[1usize][..])]);
    let h2 = schema_hash([("a", &[][..]), ("b", &[1][..])]);
    assert_ne!(h1, h2);
}
/// Computed independently with a few lines of Python (FNV-1a over the same little-endian fields).
const PINNED: &str = "8187d263c0610c81";

#[test]
fn same_seed_same_bits_other_seed_other_bits() {
    let build = |seed| {
        let mut set = ParamSet::new();
        let mut rng = StdRng::seed_from_u64(seed);
        set.add_init("w", &[64, 32], Init::KaimingNormal, &mut rng)
            .unwrap();
        set.add_init("b", &[64], Init::torch_bias(32), &mut rng)
            .unwrap();
        set.add_init(
            "odd",
            &[3, 3],
            Init::Normal {
                mean: 1.0,
                std: 0.5,
            },
            &mut rng,
        )
        .unwrap();
        set
    };
    let (a, b, c) = (build(1), build(1), build(2));
    let bits = |s: &ParamSet| s.params().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&a), bits(&b));
    assert_ne!(bits(&a), bits(&c));
}

fn mean_std(v: &[f32]) -> (f64, f64) {
    let n = v.len() as f64;
    let mean = v.iter().map(|&x| f64::from(x)).sum::<f64>() / n;
    let var = v
        .iter()
        .map(|&x| (f64::from(x) - mean).powi(2))
        .sum::<f64>()
        / n;
    (mean, var.sqrt())
}

/// Moments of 262144 draws: the sample mean is within 5 standard errors of the target, the sample
/// std within 1% (its standard error is ~0.14% here).
#[test]
fn initialisers_have_the_documented_distributions() {
    let shape = [512usize, 512];
    let n = 512 * 512;
    let mut rng = StdRng::seed_from_u64(9);
    let cases: [(Init, f64, f64, Option<f64>); 6] = [
        (
            Init::Uniform {
                low: -2.0,
                high: 1.0,
            },
            -0.5,
            3.0 / 12f64.sqrt(),
            Some(2.0),
        ),
        (
            Init::Normal {
                mean: 0.5,
                std: 0.25,
            },
            0.5,
            0.25,
            None,
        ),
        (
            Init::KaimingUniform,
            0.0,
            (6.0 / 512.0f64).sqrt() / 3f64.sqrt(),
            Some((6.0 / 512.0f64).sqrt()),
        ),
        (Init::KaimingNormal, 0.0, (2.0 / 512.0f64).sqrt(), None),
        (
            Init::XavierUniform,
            0.0,
            (6.0 / 1024.0f64).sqrt() / 3f64.sqrt(),
            Some((6.0 / 1024.0f64).sqrt()),
        ),
        (
            Init::TorchLinear,
            0.0,
            (1.0 / 512.0f64).sqrt() / 3f64.sqrt(),
            Some((1.0 / 512.0f64).sqrt()),
        ),
    ];
    for (init, mean, std, bound) in cases {
        let mut v = vec![0.0f32; n];
        init.fill("w", &shape, &mut v, &mut rng).unwrap();
        let (m, s) = mean_std(&v);
        assert!(
            (m - mean).abs() < 5.0 * std / (n as f64).sqrt(),
            "{init:?}: mean {m} vs {mean}"
        );
        assert!((s / std - 1.0).abs() < 0.01, "{init:?}: std {s} vs {std}");
        if let Some(b) = bound {
            let lo = if let Init::Uniform { low, .. } = init {
                f64::from(low)
            } else {
                -b
            };
            let hi = if let Init::Uniform { high, .. } = init {
                f64::from(high)
            } else {
                b
            };
            assert!(
                v.iter().all(|&x| f64::from(x) >= lo && f64::from(x) < hi),
                "{init:?} out of range"
            );
        }
    }
}

#[test]
fn fan_based_inits_need_a_fan() {
    let mut rng = StdRng::seed_from_u64(0);
    let mut set = ParamSet::new();
    let err = set
        .add_init("bias", &[8], Init::KaimingUniform, &mut rng)
        .unwrap_err();
    assert!(err.to_string().contains("rank >= 2"), "{err}");
    assert!(set
        .add_init(
            "u",
            &[2],
            Init::Uniform {
                low: 1.0,
                high: 0.0
            },
            &mut rng
        )
        .is_err());
    assert!(set
        .add_init(
            "n",
            &[2],
            Init::Normal {
                mean: 0.0,
                std: f32::NAN
            },
            &mut rng
        )
        .is_err());
    // Conv-shaped weights: fan_in = in * kh * kw = 3 * 3 * 3.
    set.add_init("conv", &[8, 3, 3, 3], Init::TorchLinear, &mut rng)
        .unwrap();
    let bound = 1.0 / 27f32.sqrt();
    assert!(set.tensor("conv").unwrap().iter().all(|v| v.abs() <= bound));
    assert_eq!(set.len(), 8 * 27);
}
