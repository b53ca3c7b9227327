//! The manifest's unit tests: validation, signatures, choosing among copies.

use super::*;

fn manifest(name: &str, created_ms: u64) -> RunManifest {
    RunManifest {
        name: name.into(),
        created_ms,
        ..test_manifest(ModelSpec::Mlp { hidden: 64 }, DataSpec::Digits)
    }
}

fn key(seed: u8) -> OwnerKey {
    OwnerKey::from_secret_bytes(&[seed; 32])
}

#[test]
fn a_signed_manifest_verifies_and_an_altered_one_is_refused() {
    let alice = key(1);
    let signed = SignedManifest::sign(&manifest("r", 5), &alice).unwrap();
    let parsed = SignedManifest::from_json(&signed.to_json()).unwrap();
    let (m, k) = parsed.verify().unwrap();
    assert_eq!((m, k), (manifest("r", 5), alice.public()));
    let mut forged = signed.clone();
    forged.manifest = forged.manifest.replace("0.01", "0.02");
    let err = forged.verify().unwrap_err().to_string();
    assert!(err.contains("does not verify"), "{err}");
    let mut resigned = forged.clone();
    resigned.creator = hex::encode(key(2).public().as_bytes());
    assert!(resigned.verify().is_err(), "another creator's key");
}

#[test]
fn unknown_models_newer_formats_and_bad_values_are_named() {
    let text = serde_json::to_string(&manifest("r", 1)).unwrap();
    let err = RunManifest::from_json(&text.replace("\"mlp\"", "\"resnet\""))
        .unwrap_err()
        .to_string();
    assert!(err.contains("unknown model \"resnet\""), "{err}");
    let err = RunManifest::from_json(&text.replace("\"format\":1", "\"format\":7"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("upgrade"), "{err}");
    let mut m = manifest("r", 1);
    m.optimizer.lr = f64::NAN;
    assert!(m.validate().unwrap_err().to_string().contains("--lr"));
    let mut m = manifest("r", 1);
    m.target_batch_size = 8;
    assert!(m
        .validate()
        .unwrap_err()
        .to_string()
        .contains("--target-batch-size"));
    let mut m = manifest("r", 1);
    m.codec = "zip".into();
    assert!(m.validate().unwrap_err().to_string().contains("--codec"));
    m.codec = "none".into();
    m.aggregation = "centered-clip:iters=0".into();
    assert!(m
        .validate()
        .unwrap_err()
        .to_string()
        .contains("--aggregation"));
    let mut m = manifest("r", 1);
    m.verify = 1.5;
    assert!(m.validate().unwrap_err().to_string().contains("--verify"));
    m.verify = 0.5;
    m.validate().unwrap();
    m.aggregation = "centered-clip".into();
    let err = m.validate().unwrap_err().to_string();
    assert!(
        err.contains("--verify") && err.contains("coordinate-wise"),
        "{err}"
    );
    let mut m = manifest("r", 1);
    m.data = DataSpec::Text { vocab: "ab".into() };
    assert!(m.validate().is_err(), "an mlp on text");
    // Worker momentum: in (0, 1), gradient mode, no momentum of the optimizer's own; a
    // manifest without it does not name it (older peers still read it).
    let mut m = manifest("r", 1);
    assert!(!serde_json::to_string(&m)
        .unwrap()
        .contains("worker_momentum"));
    m.worker_momentum = Some(0.9);
    m.validate().unwrap();
    let back = RunManifest::from_json(&serde_json::to_string(&m).unwrap()).unwrap();
    assert_eq!(back.worker_momentum, Some(0.9));
    for beta in [0.0, 1.0, f64::NAN] {
        m.worker_momentum = Some(beta);
        let err = m.validate().unwrap_err().to_string();
        assert!(err.contains("--worker-momentum"), "{beta}: {err}");
    }
    m.worker_momentum = Some(0.9);
    m.optimizer.momentum = 0.9;
    assert!(m
        .validate()
        .unwrap_err()
        .to_string()
        .contains("--momentum 0"));
    m.optimizer.momentum = 0.0;
    m.mode = ModeSpec::Diloco {
        inner_steps: 4,
        outer_lr: 0.7,
        outer_momentum: 0.9,
    };
    assert!(m
        .validate()
        .unwrap_err()
        .to_string()
        .contains("gradient mode"));
}

#[test]
fn choose_honours_pins_and_refuses_ambiguity_and_forgeries() {
    let alice = key(1);
    let mallory = key(2);
    let a = SignedManifest::sign(&manifest("r", 1), &alice).unwrap();
    let a_newer = SignedManifest::sign(&manifest("r", 9), &alice).unwrap();
    let m = SignedManifest::sign(&manifest("r", 5), &mallory).unwrap();
    let mut forged = a.clone();
    forged.manifest = forged.manifest.replace("\"epochs\":10", "\"epochs\":11");

    let plain: RunRef = "r".parse().unwrap();
    let (chosen, _) = choose(&plain, &[a.clone(), a_newer.clone(), forged.clone()]).unwrap();
    assert_eq!(chosen.created_ms, 9, "the newest of one creator's copies");
    let err = choose(&plain, &[a.clone(), m.clone()])
        .unwrap_err()
        .to_string();
    assert!(err.contains("2 creators"), "{err}");

    let alice_id = creator_label(&alice.public());
    let pinned: RunRef = format!("r@{alice_id}").parse().unwrap();
    assert_eq!(
        choose(&pinned, &[m.clone(), a.clone()])
            .unwrap()
            .0
            .created_ms,
        1
    );
    let err = choose(&pinned, std::slice::from_ref(&m))
        .unwrap_err()
        .to_string();
    assert!(err.contains("pinned to"), "{err}");
    let hex_pin: RunRef = format!("r@{}", hex::encode(alice.public().as_bytes()))
        .parse()
        .unwrap();
    assert!(choose(&hex_pin, std::slice::from_ref(&a)).is_ok());

    let err = choose(&plain, &[forged]).unwrap_err().to_string();
    assert!(err.contains("does not verify"), "{err}");
    let err = choose(&"other".parse().unwrap(), &[a])
        .unwrap_err()
        .to_string();
    assert!(err.contains("refused"), "{err}");
    assert!("bad name!".parse::<RunRef>().is_err());
    assert!("r@notakey".parse::<RunRef>().is_err());
}

#[test]
fn a_cosine_schedule_travels_in_the_manifest_and_a_constant_rate_leaves_it_as_before() {
    // A constant rate writes no `schedule` field: manifests of runs without one read as before.
    let text = serde_json::to_string(&manifest("r", 1)).unwrap();
    assert!(!text.contains("schedule"), "{text}");
    let mut m = manifest("r", 1);
    m.optimizer.schedule = Some(ScheduleSpec::Cosine { warmup_epochs: 3 });
    let text = serde_json::to_string(&m).unwrap();
    assert!(
        text.contains(r#""schedule":{"kind":"cosine","warmup_epochs":3}"#),
        "{text}"
    );
    assert_eq!(RunManifest::from_json(&text).unwrap(), m);
    m.optimizer.schedule = Some(ScheduleSpec::Cosine {
        warmup_epochs: m.epochs + 1,
    });
    let err = m.validate().unwrap_err().to_string();
    assert!(err.contains("--warmup-epochs"), "{err}");
}
