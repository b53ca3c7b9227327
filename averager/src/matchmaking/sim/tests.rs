//! The simulator's scenarios: stable, churning and capped swarms, each checked step by step.

use super::{Scenario, Sim};

/// Seeds 0 to 3, or the one `SIM_SEED` names (to look at one run, with `STARLING_SIM_TRACE`
/// set to a peer's index or `all`).
fn seeds() -> Vec<u64> {
    std::env::var("SIM_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .map_or((0..4).collect(), |s| vec![s])
}

#[test]
fn sixty_four_peers_with_joins_deaths_and_slow_links_never_wait_out_a_window_beside_a_group() {
    let started = std::time::Instant::now();
    let mut totals = (0, 0, 0, 0);
    for seed in seeds() {
        let mut sim = Sim::new(Scenario {
            peers: 64,
            joiners: 8,
            steps: 12,
            deaths_per_step: 2,
            slow_fraction: 0.15,
            target_group_size: 64,
            seed,
            sticky: std::env::var("NOSTICKY").is_err(),
            dropped_fraction: 0.02,
        });
        sim.run();
        if let Some((p, log)) = &sim.trace {
            eprintln!("peer {p}:\n{}", log.join("\n"));
        }
        assert!(
            sim.violations.is_empty(),
            "seed {seed}: {} violations, first: {:#?}",
            sim.violations.len(),
            &sim.violations[..sim.violations.len().min(5)]
        );
        assert!(sim.grouped > 0 && sim.deaths > 0);
        totals.0 += sim.grouped;
        totals.1 += sim.alone;
        totals.2 += sim.waited_out;
        totals.3 += sim.deaths;
    }
    eprintln!(
        "grouped {} peer-steps, alone {}, windows waited out {}, deaths {}, in {:?}",
        totals.0,
        totals.1,
        totals.2,
        totals.3,
        started.elapsed()
    );
}

#[test]
fn groups_capped_below_the_swarm_still_agree_and_cover_everyone() {
    let mut sim = Sim::new(Scenario {
        peers: 40,
        joiners: 0,
        steps: 6,
        deaths_per_step: 0,
        slow_fraction: 0.1,
        target_group_size: 8,
        seed: 7,
        sticky: true,
        dropped_fraction: 0.0,
    });
    sim.run();
    assert!(sim.violations.is_empty(), "{:#?}", sim.violations);
    assert!(sim.grouped > 0);
}

#[test]
fn a_stable_swarm_re_forms_its_group_with_fewer_reads_and_falls_back_when_it_changes() {
    let scenario = |sticky, deaths_per_step, joiners, seed| Scenario {
        peers: 4,
        joiners,
        steps: 40,
        deaths_per_step,
        // Slow links only with churn: a stable swarm on a LAN's links compares the two ways.
        slow_fraction: if joiners > 0 { 0.25 } else { 0.0 },
        target_group_size: 16,
        seed,
        sticky,
        dropped_fraction: 0.0,
    };
    // (grouped peer-steps, reads of the key) without and with re-forming, over the seeds.
    let mut totals = [(0, 0), (0, 0)];
    for seed in seeds() {
        // The same steps with and without: the groups agree and nobody waits out a window
        // beside one either way.
        for (i, sticky) in [false, true].into_iter().enumerate() {
            let mut sim = Sim::new(scenario(sticky, 0, 0, seed));
            sim.run();
            if let Some((p, log)) = sim.trace.as_ref().filter(|_| sticky) {
                eprintln!("peer {p}:\n{}", log.join("\n"));
            }
            assert!(
                sim.violations.is_empty(),
                "seed {seed}, sticky {sticky}: {:#?}",
                &sim.violations[..sim.violations.len().min(5)]
            );
            totals[i].0 += sim.grouped;
            totals[i].1 += sim.reads;
        }
        // Peers dying and joining: whoever re-forms a group that lost its leader, or misses a
        // newcomer, falls back to the usual way; the checks hold.
        let mut sim = Sim::new(scenario(true, 1, 3, seed));
        sim.run();
        assert!(
            sim.violations.is_empty(),
            "seed {seed}, churn: {:#?}",
            &sim.violations[..sim.violations.len().min(5)]
        );
        assert!(sim.grouped > 0 && sim.deaths > 0);
    }
    // Fewer reads (the members of a re-forming group read nothing; the links here are slower
    // than a LAN's, so its leader often reads once), as many peers grouped give or take a late
    // one (over 61 seeds: 9338 grouped with, 9327 without; reads 22849 against 35070).
    let ([(grouped, reads), (grouped_sticky, reads_sticky)], n) = (totals, seeds().len());
    eprintln!("grouped {grouped} / {grouped_sticky}, reads {reads} / {reads_sticky}");
    assert!(reads_sticky * 10 < reads * 9, "{totals:?}");
    assert!(grouped_sticky + 4 * n >= grouped, "{totals:?}");
}

#[test]
fn a_re_forming_group_that_loses_join_requests_still_agrees_and_groups_as_many() {
    // Sixteen peers that re-form one group every step, a tenth of the join requests lost
    // before the leader sees them (16 real peers on two cores lost a few a step: "connection
    // is closed"); a member whose request got no answer asks its leader again
    // ([`Asked::Dropped`]). The checks hold, as many peers group as without losses, and the
    // key is read about as often.
    let scenario = |dropped_fraction, seed| Scenario {
        peers: 16,
        joiners: 0,
        steps: 20,
        deaths_per_step: 0,
        slow_fraction: 0.0,
        target_group_size: 16,
        seed,
        sticky: true,
        dropped_fraction,
    };
    let (mut clean, mut lossy) = ((0, 0, 0), (0, 0, 0));
    for seed in seeds() {
        for (dropped, totals) in [(0.0, &mut clean), (0.1, &mut lossy)] {
            let mut sim = Sim::new(scenario(dropped, seed));
            sim.run();
            if let Some((p, log)) = sim.trace.as_ref().filter(|_| dropped > 0.0) {
                eprintln!("peer {p}:\n{}", log.join("\n"));
            }
            assert!(
                sim.violations.is_empty(),
                "seed {seed}, dropped {dropped}: {:#?}",
                &sim.violations[..sim.violations.len().min(5)]
            );
            totals.0 += sim.grouped;
            totals.1 += sim.reads;
            totals.2 += sim.settle_ms;
        }
    }
    // (Over 40 seeds: grouped 12467 / 12460 peer-steps, reads 27420 / 29770, the step's last
    // group began 1.740 / 1.817 ks after its last search started, summed over the steps. The
    // simulator does not model what a fallen-back member cost the real peers.)
    eprintln!("without losses / with: (grouped, reads, settled ms) {clean:?} / {lossy:?}");
    assert!(
        lossy.0 + 2 * seeds().len() >= clean.0,
        "{lossy:?} against {clean:?}"
    );
    assert!(lossy.1 * 4 <= clean.1 * 5, "{lossy:?} against {clean:?}");
}
