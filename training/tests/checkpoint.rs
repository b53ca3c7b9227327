//! Checkpoints: a resumed run equals an uninterrupted one bit for bit; every kind of damage or
//! mismatch is a named error and leaves the caller's state untouched.

use std::fs;
use std::path::Path;

use rand::{rngs::StdRng, Rng, SeedableRng};
use starling_training::checkpoint::{read_meta, META_FILE};
use starling_training::state::{StateTarget, StateView};
use starling_training::{
    AdamW, AdamWConfig, CheckpointError, Init, LrSchedule, Optimizer, ParamSet, Sgd, SgdConfig,
};

fn model(seed: u64) -> ParamSet {
    let mut set = ParamSet::new();
    let mut rng = StdRng::seed_from_u64(seed);
    set.add_init("l1.weight", &[16, 8], Init::KaimingUniform, &mut rng)
        .unwrap();
    set.add_init("l1.bias", &[16], Init::torch_bias(8), &mut rng)
        .unwrap();
    set.add_init("l2.weight", &[4, 16], Init::XavierUniform, &mut rng)
        .unwrap();
    set.add_zeros("l2.bias", &[4]).unwrap();
    set
}

fn fill_grads(set: &mut ParamSet, rng: &mut StdRng) {
    for g in set.grads_mut() {
        *g = rng.gen_range(-1.0..1.0);
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// A peer that checkpoints at step 7, restarts into fresh objects and continues, ends with exactly
/// the bits of a peer that never stopped: parameters, both optimizers, the extra buffer.
#[test]
fn resumed_training_is_bit_identical_to_uninterrupted() {
    let dir = tempfile::tempdir().unwrap();
    let schedule = LrSchedule::WarmupCosine {
        peak_lr: 1e-2,
        min_lr: 1e-4,
        warmup_steps: 3,
        total_steps: 20,
    };
    let run = |set: &mut ParamSet,
               inner: &mut AdamW,
               outer: &mut Sgd,
               anchor: &mut Vec<f32>,
               steps: std::ops::Range<u64>| {
        for t in steps {
            let mut rng = StdRng::seed_from_u64(1000 + t);
            fill_grads(set, &mut rng);
            schedule.apply(inner);
            inner.step_set(set).unwrap();
            if t % 4 == 3 {
                // DiLoCo-like outer step on the delta from the anchor.
                let delta: Vec<f32> = anchor
                    .iter()
                    .zip(set.params())
                    .map(|(a, p)| a - p)
                    .collect();
                outer.step(anchor, &delta).unwrap();
                set.params_mut().copy_from_slice(anchor);
            }
        }
    };
    let new_state = || {
        let set = model(5);
        let inner = AdamW::new(AdamWConfig::new(1e-2).weight_decay(0.05), set.len()).unwrap();
        let outer = Sgd::new(SgdConfig::new(0.7).momentum(0.9).nesterov(true), set.len()).unwrap();
        let anchor = set.params().to_vec();
        (set, inner, outer, anchor)
    };

    let (mut set_a, mut inner_a, mut outer_a, mut anchor_a) = new_state();
    run(&mut set_a, &mut inner_a, &mut outer_a, &mut anchor_a, 0..20);

    let (mut set_b, mut inner_b, mut outer_b, mut anchor_b) = new_state();
    run(&mut set_b, &mut inner_b, &mut outer_b, &mut anchor_b, 0..7);
    StateView::new(7, &set_b)
        .counter("samples", 7 * 64)
        .optimizer("inner", &inner_b)
        .optimizer("outer", &outer_b)
        .buffer("anchor", &anchor_b)
        .save(dir.path())
        .unwrap();
    drop((set_b, inner_b, outer_b, anchor_b));

    // Fresh objects with other values and hyper-parameters: everything comes from the checkpoint.
    let mut set_c = model(99);
    let mut inner_c = AdamW::new(AdamWConfig::default(), set_c.len()).unwrap();
    let mut outer_c = Sgd::new(SgdConfig::new(0.1).momentum(0.5), set_c.len()).unwrap();
    let mut anchor_c = vec![0.0; set_c.len()];
    set_c.grads_mut().fill(9.0);
    let meta = StateTarget::new(&mut set_c)
        .optimizer("inner", &mut inner_c)
        .optimizer("outer", &mut outer_c)
        .buffer("anchor", &mut anchor_c)
        .load(dir.path())
        .unwrap();
    assert_eq!((meta.epoch, meta.counters["samples"]), (7, 448));
    assert!(set_c.grads().iter().all(|&g| g == 0.0));
    run(&mut set_c, &mut inner_c, &mut outer_c, &mut anchor_c, 7..20);

    assert_eq!(bits(set_c.params()), bits(set_a.params()));
    assert_eq!(bits(&anchor_c), bits(&anchor_a));
    assert_eq!(inner_c.steps(), inner_a.steps());
    assert_eq!(inner_c.config(), inner_a.config());
    assert_eq!(outer_c.config(), outer_a.config());
    for (opt_c, opt_a) in [
        (&inner_c as &dyn Optimizer, &inner_a as &dyn Optimizer),
        (&outer_c, &outer_a),
    ] {
        for ((nc, sc), (na, sa)) in opt_c.state().into_iter().zip(opt_a.state()) {
            assert_eq!((nc, bits(sc)), (na, bits(sa)));
        }
    }
}

fn saved(dir: &Path) -> (ParamSet, AdamW) {
    let mut set = model(1);
    fill_grads(&mut set, &mut StdRng::seed_from_u64(2));
    let mut opt = AdamW::new(AdamWConfig::new(1e-3), set.len()).unwrap();
    opt.step_set(&mut set).unwrap();
    StateView::new(1, &set)
        .optimizer("opt", &opt)
        .save(dir)
        .unwrap();
    (set, opt)
}

/// Loads into a fresh model and optimizer; asserts that on error neither changed.
fn load_fails(dir: &Path, mut set: ParamSet) -> CheckpointError {
    let mut opt = AdamW::new(AdamWConfig::default(), set.len()).unwrap();
    let (params_before, opt_before) = (set.clone(), opt.clone());
    let err = StateTarget::new(&mut set)
        .optimizer("opt", &mut opt)
        .load(dir)
        .unwrap_err();
    assert_eq!(
        set, params_before,
        "parameters changed by a failed load ({err})"
    );
    assert_eq!(
        opt, opt_before,
        "optimizer changed by a failed load ({err})"
    );
    err
}

fn tensors_path(dir: &Path) -> std::path::PathBuf {
    dir.join(read_meta(dir).unwrap().tensors_file)
}

#[test]
fn flipped_bit_in_the_tensors_is_reported_as_corrupt() {
    let dir = tempfile::tempdir().unwrap();
    saved(dir.path());
    let path = tensors_path(dir.path());
    let mut bytes = fs::read(&path).unwrap();
    let n = bytes.len();
    bytes[n - 5] ^= 0x10; // inside the last tensor's data
    fs::write(&path, &bytes).unwrap();
    let err = load_fails(dir.path(), model(1));
    assert!(matches!(err, CheckpointError::Corrupt { .. }), "{err}");
    assert!(err.to_string().contains("content hash"), "{err}");
}

#[test]
fn truncated_tensors_file_is_reported_as_corrupt() {
    let dir = tempfile::tempdir().unwrap();
    saved(dir.path());
    let path = tensors_path(dir.path());
    let bytes = fs::read(&path).unwrap();
    fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    let err = load_fails(dir.path(), model(1));
    assert!(matches!(err, CheckpointError::Corrupt { .. }), "{err}");
}

#[test]
fn missing_tensors_file_is_an_io_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    saved(dir.path());
    let path = tensors_path(dir.path());
    fs::remove_file(&path).unwrap();
    let err = load_fails(dir.path(), model(1));
    assert!(matches!(err, CheckpointError::Io { .. }), "{err}");
    assert!(err.to_string().contains("tensors-1-"), "{err}");
}

#[test]
fn schema_mismatches_name_the_tensor() {
    let dir = tempfile::tempdir().unwrap();
    saved(dir.path());

    let mut wider = ParamSet::new();
    wider.add_zeros("l1.weight", &[16, 9]).unwrap();
    let err = load_fails(dir.path(), wider);
    match &err {
        CheckpointError::ShapeMismatch {
            tensor,
            model,
            checkpoint,
        } => {
            assert_eq!(
                (tensor.as_str(), &model[..], &checkpoint[..]),
                ("l1.weight", &[16, 9][..], &[16, 8][..])
            );
        }
        other => panic!("expected a shape mismatch, got {other}"),
    }
    assert_eq!(
        err.to_string(),
        "tensor \"l1.weight\" has shape [16, 9] in the model but [16, 8] in the checkpoint"
    );

    let mut renamed = model(1);
    renamed.add_zeros("l3.weight", &[2]).unwrap();
    let err = load_fails(dir.path(), renamed);
    assert!(
        matches!(&err, CheckpointError::NotInCheckpoint { tensor } if tensor == "l3.weight"),
        "{err}"
    );

    let mut fewer = ParamSet::new();
    fewer.add_zeros("l1.weight", &[16, 8]).unwrap();
    let err = load_fails(dir.path(), fewer);
    assert!(
        matches!(&err, CheckpointError::NotInModel { tensor } if tensor == "l1.bias"),
        "{err}"
    );

    let mut reordered = ParamSet::new();
    reordered.add_zeros("l1.bias", &[16]).unwrap();
    reordered.add_zeros("l1.weight", &[16, 8]).unwrap();
    reordered.add_zeros("l2.weight", &[4, 16]).unwrap();
    reordered.add_zeros("l2.bias", &[4]).unwrap();
    let err = load_fails(dir.path(), reordered);
    assert!(
        matches!(&err, CheckpointError::OrderMismatch { position: 0, .. }),
        "{err}"
    );
}

#[test]
fn optimizer_mismatches_are_named() {
    let dir = tempfile::tempdir().unwrap();
    saved(dir.path());
    let mut set = model(1);
    let before = set.clone();
    let mut sgd = Sgd::new(SgdConfig::default(), set.len()).unwrap();
    let err = StateTarget::new(&mut set)
        .optimizer("opt", &mut sgd)
        .load(dir.path())
        .unwrap_err();
    assert!(
        matches!(
            err,
            CheckpointError::OptimizerKind {
                model: "sgd",
                checkpoint: "adamw",
                ..
            }
        ),
        "{err}"
    );
    let mut adam = AdamW::new(AdamWConfig::default(), set.len()).unwrap();
    let err = StateTarget::new(&mut set)
        .optimizer("inner", &mut adam)
        .load(dir.path())
        .unwrap_err();
    assert!(
        matches!(&err, CheckpointError::MissingOptimizer { name, available } if name == "inner" && available == &["opt"]),
        "{err}"
    );
    let mut anchor = vec![0.0; set.len()];
    let err = StateTarget::new(&mut set)
        .buffer("anchor", &mut anchor)
        .load(dir.path())
        .unwrap_err();
    assert!(
        matches!(err, CheckpointError::MissingBuffer { .. }),
        "{err}"
    );
    assert_eq!(set, before);
}

/// Edits checkpoint.json as JSON and expects a format error mentioning `needle`.
fn tampered_meta(edit: impl FnOnce(&mut serde_json::Value), needle: &str) {
    let dir = tempfile::tempdir().unwrap();
    saved(dir.path());
    let path = dir.path().join(META_FILE);
    let mut meta: serde_json::Value = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
    edit(&mut meta);
    fs::write(&path, serde_json::to_vec(&meta).unwrap()).unwrap();
    let err = load_fails(dir.path(), model(1));
    assert!(
        err.to_string().contains(needle),
        "{err} should mention {needle:?}"
    );
}

#[test]
fn tampered_metadata_is_refused() {
    tampered_meta(
        |m| m["version"] = 2.into(),
        "version Some(2) is not supported",
    );
    tampered_meta(
        |m| m["format"] = "other".into(),
        "format is Some(\"other\")",
    );
    tampered_meta(
        |m| m["schema"][0]["shape"][1] = 9.into(),
        "does not match its schema",
    );
    tampered_meta(
        |m| m["tensors_file"] = "../../etc/passwd".into(),
        "not a plain file name",
    );
    tampered_meta(
        |m| m["tensors_bytes"] = 10.into(),
        "tensors_bytes 10 cannot hold",
    );
    tampered_meta(
        |m| m["optimizers"]["opt"]["state"] = serde_json::json!(["exp_avg"]),
        "keeps [\"exp_avg\", \"exp_avg_sq\"]",
    );
    tampered_meta(
        |m| m["optimizers"]["opt"]["config"]["beta1"] = 1.5.into(),
        "beta1 1.5 must be in [0, 1)",
    );
    tampered_meta(
        |m| m["optimizers"]["opt"]["config"]["kind"] = "lion".into(),
        "malformed metadata",
    );
    tampered_meta(
        |m| {
            m.as_object_mut().unwrap().remove("epoch");
        },
        "missing field `epoch`",
    );
    fn not_json(dir: &Path) {
        fs::write(dir.join(META_FILE), b"{ not json").unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    saved(dir.path());
    not_json(dir.path());
    let err = load_fails(dir.path(), model(1));
    assert!(err.to_string().contains("not JSON"), "{err}");
}

#[test]
fn a_tensors_file_from_another_checkpoint_is_caught() {
    // Two checkpoints of different models; swap their tensors files (and fix up names, sizes and
    // hashes so only the content disagrees with the metadata).
    let dir_a = tempfile::tempdir().unwrap();
    let dir_b = tempfile::tempdir().unwrap();
    saved(dir_a.path());
    let mut other = ParamSet::new();
    other.add_zeros("l1.weight", &[8, 16]).unwrap();
    other.add_zeros("l1.bias", &[16]).unwrap();
    other.add_zeros("l2.weight", &[4, 16]).unwrap();
    other.add_zeros("l2.bias", &[4]).unwrap();
    let opt = AdamW::new(AdamWConfig::new(1e-3), other.len()).unwrap();
    let meta_b = StateView::new(0, &other)
        .optimizer("opt", &opt)
        .save(dir_b.path())
        .unwrap();
    let path_a = tensors_path(dir_a.path());
    fs::copy(dir_b.path().join(&meta_b.tensors_file), &path_a).unwrap();
    let meta_path = dir_a.path().join(META_FILE);
    let mut meta: serde_json::Value =
        serde_json::from_slice(&fs::read(&meta_path).unwrap()).unwrap();
    meta["tensors_bytes"] = meta_b.tensors_bytes.into();
    meta["tensors_hash"] = meta_b.tensors_hash.clone().into();
    fs::write(&meta_path, serde_json::to_vec(&meta).unwrap()).unwrap();
    let err = load_fails(dir_a.path(), model(1));
    match err {
        CheckpointError::BadTensor { key, detail } => {
            assert_eq!(key, "optim/opt/exp_avg/l1.weight");
            assert!(
                detail.contains("[8, 16]") && detail.contains("[16, 8]"),
                "{detail}"
            );
        }
        other => panic!("expected a bad tensor, got {other}"),
    }
}

#[test]
fn saving_again_replaces_the_checkpoint_and_removes_old_files() {
    let dir = tempfile::tempdir().unwrap();
    let (mut set, mut opt) = saved(dir.path());
    let first = read_meta(dir.path()).unwrap().tensors_file;
    // Leftovers of a crash in the middle of an earlier save are harmless.
    fs::write(dir.path().join("tensors.safetensors.partial"), b"garbage").unwrap();
    fs::write(dir.path().join("checkpoint.json.partial"), b"garbage").unwrap();
    opt.step_set(&mut set).unwrap();
    let meta = StateView::new(2, &set)
        .optimizer("opt", &opt)
        .save(dir.path())
        .unwrap();
    assert_ne!(meta.tensors_file, first);
    let mut names: Vec<String> = fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, [META_FILE.to_string(), meta.tensors_file.clone()]);
    let mut loaded = model(3);
    let mut opt2 = AdamW::new(AdamWConfig::default(), loaded.len()).unwrap();
    StateTarget::new(&mut loaded)
        .optimizer("opt", &mut opt2)
        .load(dir.path())
        .unwrap();
    assert_eq!(bits(loaded.params()), bits(set.params()));
    assert_eq!(opt2.steps(), 2);
}

#[test]
fn invalid_names_and_lengths_are_refused_on_save() {
    let dir = tempfile::tempdir().unwrap();
    let set = model(1);
    let opt = Sgd::new(SgdConfig::default(), set.len()).unwrap();
    let short = vec![0.0; 3];
    let err = StateView::new(0, &set)
        .buffer("anchor", &short)
        .save(dir.path())
        .unwrap_err();
    assert!(
        matches!(
            err,
            CheckpointError::Length {
                expected: 212,
                actual: 3,
                ..
            }
        ),
        "{err}"
    );
    let err = StateView::new(0, &set)
        .optimizer("a/b", &opt)
        .save(dir.path())
        .unwrap_err();
    assert!(matches!(err, CheckpointError::InvalidName { .. }), "{err}");
    let err = StateView::new(0, &set)
        .optimizer("x", &opt)
        .optimizer("x", &opt)
        .save(dir.path())
        .unwrap_err();
    assert!(matches!(err, CheckpointError::InvalidName { .. }), "{err}");
    assert!(
        fs::read_dir(dir.path()).unwrap().next().is_none(),
        "nothing written"
    );
}

#[test]
fn empty_model_round_trips() {
    let dir = tempfile::tempdir().unwrap();
    let set = ParamSet::new();
    StateView::new(3, &set).save(dir.path()).unwrap();
    let mut loaded = ParamSet::new();
    assert_eq!(
        StateTarget::new(&mut loaded)
            .load(dir.path())
            .unwrap()
            .epoch,
        3
    );
}

#[test]
fn no_checkpoint_is_an_io_error() {
    let dir = tempfile::tempdir().unwrap();
    let err = load_fails(dir.path(), model(1));
    assert!(matches!(err, CheckpointError::Io { .. }), "{err}");
    assert!(err.to_string().contains(META_FILE), "{err}");
}
