//! Peers that lie on purpose (`starling train --byzantine`), as a lab would test its swarm's
//! defences before opening it: separate processes on 127.0.0.1 training the embedded digits MLP,
//! one of them lying as a sender (robust aggregation must hold it off) or as a reducer
//! (`--verify` must catch and refuse it).
//!
//! The tests run one at a time (each starts four training processes on a 2-core machine).

mod procs;

use std::time::Duration;

use procs::{address, events, serial, train};

/// Bound on one training process (a hang guard, not a speed bar).
const LIMIT: Duration = Duration::from_secs(600);

/// A creator of a digits MLP run (plain SGD, lr 0.05, `epochs`, seed 1, and `run_flags`), two
/// honest joiners and one joiner started with `--byzantine attack`, all with `--min-peers 4`,
/// run to the end: each one's name, whether it exited successfully, and its output.
fn four_with_a_liar(
    name: &str,
    epochs: &str,
    run_flags: &[&str],
    attack: &str,
) -> Vec<(&'static str, bool, Vec<String>)> {
    let mut creator = vec![
        "--new-run",
        name,
        "--model",
        "mlp",
        "--optimizer",
        "sgd",
        "--lr",
        "0.05",
        "--epochs",
        epochs,
        "--seed",
        "1",
        "--min-peers",
        "4",
    ];
    creator.extend_from_slice(run_flags);
    let a = train(&creator);
    let (addr, _) = address(&a);
    let joiner = |extra: &[&str]| {
        // All four start together (a run of 120 epochs of the digits MLP takes a second or two:
        // a creator that began alone could finish it before its joiners had started).
        let mut args = vec!["--run", name, "--bootstrap", &addr, "--min-peers", "4"];
        args.extend_from_slice(extra);
        train(&args)
    };
    let (b, c) = (joiner(&[]), joiner(&[]));
    let liar = joiner(&["--byzantine", attack]);
    [
        (a, "creator"),
        (b, "joiner 1"),
        (c, "joiner 2"),
        (liar, "liar"),
    ]
    .into_iter()
    .map(|(p, who)| {
        let (ok, lines) = p.finish(who, LIMIT);
        if !ok {
            let tail = lines.iter().rev().take(3).cloned().collect::<Vec<_>>();
            println!("{name}: {who} failed: {tail:?}");
        }
        (who, ok, lines)
    })
    .collect()
}

/// Four `starling train` processes on the digits MLP (plain SGD, lr 0.05), one of them started
/// with `--byzantine scale:100`: under the run's `--aggregation mean` the lie wrecks every
/// peer's model (or the training diverges), under `centered-clip` the honest peers end as
/// accurate as an honest swarm and identical. What a lab would run before opening its swarm.
#[test]
fn a_lying_process_wrecks_the_mean_but_not_centered_clipping() {
    let _one = serial();
    // Each peer: who, its accuracy and parameter digest (None if it failed), and how many of
    // its rounds had all four peers (so a pass is not a liar that never got in).
    type Peer = (String, Option<(f64, String)>, usize);
    let swarm = |aggregation: &str, name: &str| -> Vec<Peer> {
        four_with_a_liar(name, "150", &["--aggregation", aggregation], "scale:100")
            .into_iter()
            .map(|(who, ok, lines)| {
                let end = ok.then(|| {
                    let f = &events(&lines, "finished")[0];
                    (
                        f["test_accuracy"].as_f64().unwrap(),
                        f["params_sha256"].as_str().unwrap().to_string(),
                    )
                });
                let full = events(&lines, "step")
                    .iter()
                    .filter(|s| s["group_size"] == 4)
                    .count();
                (who.to_string(), end, full)
            })
            .collect()
    };
    let clipped = swarm("centered-clip", "byz-cc");
    println!("centered-clip: {clipped:?}");
    for (who, _, full) in &clipped {
        assert!(
            *full >= 50,
            "{who} averaged with all four in only {full} rounds"
        );
    }
    let honest: Vec<&(f64, String)> = clipped[..3]
        .iter()
        .map(|(who, end, _)| end.as_ref().unwrap_or_else(|| panic!("{who} failed")))
        .collect();
    for (acc, sha) in &honest {
        assert!(
            *acc >= 0.9,
            "an honest peer under centered-clip: accuracy {acc}"
        );
        assert_eq!(sha, &honest[0].1, "the honest peers end identical");
    }
    let averaged = swarm("mean", "byz-mean");
    println!("mean: {averaged:?}");
    assert!(averaged[3].2 >= 50, "the liar got into the mean's rounds");
    for (who, end, _) in &averaged[..3] {
        // Wrecked: near chance (0.1 on ten digits), or the loss left the finite numbers and
        // the process stopped with "training diverged".
        if let Some((acc, _)) = end {
            assert!(*acc < 0.5, "{who} under mean with a liar: accuracy {acc}");
        }
    }
}

/// Four `starling train` processes on the digits MLP, one of them a lying *reducer*
/// (`--byzantine reducer:1`: the results it returns for its span are 1.0 too high, well-formed
/// values). With the run's `--verify 1` the liar is caught within ten rounds of its first (in
/// practice its first), no check of it ever passes, no honest reducer fails one, every honest
/// peer refuses it by the end (its `finished` event names it) and the honest peers end accurate
/// and identical; with `--verify 0` the same lie wrecks every model.
#[test]
fn a_lying_reducer_process_is_caught_refused_and_harmless_with_verify() {
    let _one = serial();
    struct Peer {
        who: &'static str,
        id: String,
        /// Accuracy and parameter digest (None if it failed).
        end: Option<(f64, String)>,
        refused: Vec<String>,
        /// (epoch, reducer, outcome) of each check of another reducer it made.
        audits: Vec<(u64, String, String)>,
        /// Epochs of the rounds it averaged in with at least one other peer.
        grouped: Vec<u64>,
    }
    let swarm = |verify: &str, name: &str| -> Vec<Peer> {
        four_with_a_liar(name, "120", &["--verify", verify], "reducer:1")
            .into_iter()
            .map(|(who, ok, lines)| {
                let steps = events(&lines, "step");
                let fin = events(&lines, "finished");
                let id = events(&lines, "started")
                    .first()
                    .and_then(|e| e["peer"].as_str())
                    .unwrap_or_default()
                    .to_string();
                Peer {
                    who,
                    id,
                    end: fin.first().filter(|_| ok).map(|f| {
                        (
                            f["test_accuracy"].as_f64().unwrap(),
                            f["params_sha256"].as_str().unwrap().to_string(),
                        )
                    }),
                    refused: fin
                        .first()
                        .and_then(|f| f["refused_peers"].as_array())
                        .map(|a| {
                            a.iter()
                                .filter_map(|p| p.as_str().map(String::from))
                                .collect()
                        })
                        .unwrap_or_default(),
                    audits: steps
                        .iter()
                        .filter(|s| s["audit"].is_object())
                        .map(|s| {
                            (
                                s["epoch"].as_u64().unwrap(),
                                s["audit"]["reducer"].as_str().unwrap().to_string(),
                                s["audit"]["outcome"].as_str().unwrap().to_string(),
                            )
                        })
                        .collect(),
                    grouped: steps
                        .iter()
                        .filter(|s| s["group_size"].as_u64().is_some_and(|g| g > 1))
                        .map(|s| s["epoch"].as_u64().unwrap())
                        .collect(),
                }
            })
            .collect()
    };
    let checked = swarm("1", "lying-reducer-verified");
    for p in &checked {
        println!(
            "verify 1: {} end {:?} refused {:?} rounds {:?} checks not clean {:?}",
            p.who,
            p.end,
            p.refused,
            p.grouped,
            p.audits
                .iter()
                .filter(|a| a.2 != "clean")
                .collect::<Vec<_>>()
        );
    }
    let liar = &checked[3].id;
    let honest = &checked[..3];
    // The liar's rounds: it reduces a span in each (groups form while the peers start, so the
    // first may hold two or three of them).
    let first_round = *checked[3]
        .grouped
        .first()
        .expect("the liar never got into a round with the honest peers");
    // Its lie is in every value, so every check of it fails; honest reducers pass theirs.
    let audits: Vec<&(u64, String, String)> = honest.iter().flat_map(|p| &p.audits).collect();
    for (epoch, reducer, outcome) in &audits {
        if reducer == liar {
            assert_ne!(outcome, "clean", "epoch {epoch}: the lie passed a check");
        } else {
            assert_eq!(outcome, "clean", "epoch {epoch}: an honest reducer failed");
        }
    }
    let caught: Vec<u64> = audits
        .iter()
        .filter(|a| a.2 == "caught")
        .map(|a| a.0)
        .collect();
    let first_caught = *caught
        .iter()
        .min()
        .expect("nobody caught the lying reducer");
    assert!(
        first_caught < first_round + 10,
        "caught at epoch {first_caught}, ten rounds after its first ({first_round})"
    );
    for p in honest {
        let (acc, sha) = p.end.as_ref().unwrap_or_else(|| panic!("{} failed", p.who));
        assert!(*acc >= 0.9, "{}: accuracy {acc} with a caught liar", p.who);
        assert_eq!(
            sha,
            &honest[0].end.as_ref().unwrap().1,
            "honest peers end identical"
        );
        assert!(
            p.refused.contains(liar),
            "{} does not refuse the liar",
            p.who
        );
        assert!(
            !p.refused.iter().any(|r| r != liar),
            "{} refuses an honest peer",
            p.who
        );
    }
    let unchecked = swarm("0", "lying-reducer-unchecked");
    for p in &unchecked {
        println!(
            "verify 0: {} end {:?} rounds {}",
            p.who,
            p.end,
            p.grouped.len()
        );
    }
    assert!(
        unchecked[3].grouped.len() >= 50,
        "the liar got into the rounds"
    );
    for p in &unchecked[..3] {
        if let Some((acc, _)) = &p.end {
            assert!(*acc < 0.5, "{} without verification: accuracy {acc}", p.who);
        }
    }
}
