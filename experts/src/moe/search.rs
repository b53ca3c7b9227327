//! Beam search over the DHT's grid prefixes: per sample, the `k_best` live experts with the
//! highest summed gate scores, skipping replicas that failed lately. Prefix listings are cached
//! for `dht_cache`.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use tokio::time::Instant;
use tracing::debug;

use super::MoeConfig;
use crate::client::{ExpertClient, RemoteExpert};
use crate::grid::{ExpertHost, ExpertUid};
use crate::Result;
use starling_node::lock::lock;

/// Live next coordinates under a prefix, with the servers that declared each.
type Hosts = HashMap<u32, Vec<ExpertHost>>;
/// DHT prefix listings by prefix, with the time they were fetched.
pub(super) type PrefixCache = Arc<Mutex<HashMap<Vec<u32>, (Instant, Hosts)>>>;
/// Replicas (see [`ban_key`]) that failed, and until when they are skipped.
pub(super) type Bans = Arc<Mutex<HashMap<String, Instant>>>;
/// Per sample, the experts chosen for it (uid and a handle on the replica to call), best first.
pub(super) type Choices = Vec<Vec<(ExpertUid, RemoteExpert)>>;
/// A partial path through the grid: coordinates so far, summed score, who declared it.
type Beam = Vec<(Vec<u32>, f32, Option<ExpertHost>)>;

/// Failures are remembered per replica: `uid@peer`.
pub(super) fn ban_key(uid: &str, peer: &starling_node::PeerId) -> String {
    format!("{uid}@{peer}")
}

/// What a search needs, detached from the layer so it can run on the tokio runtime.
pub(super) struct Searcher {
    pub(super) cfg: MoeConfig,
    pub(super) client: ExpertClient,
    pub(super) cache: PrefixCache,
    pub(super) banned: Bans,
}

impl Searcher {
    /// The live children of `prefix`, from the cache when fresh enough; a failed lookup counts
    /// as none (and is cached as such for `dht_cache`).
    async fn children(&self, prefix: &[u32]) -> Hosts {
        if let Some((at, hosts)) = lock(&self.cache).get(prefix) {
            if at.elapsed() < self.cfg.dht_cache {
                return hosts.clone();
            }
        }
        let hosts = match self.client.children(&self.cfg.name, prefix).await {
            Ok(h) => h,
            Err(e) => {
                debug!("DHT lookup of {}{prefix:?} failed: {e}", self.cfg.name);
                Hosts::new()
            }
        };
        lock(&self.cache).insert(prefix.to_vec(), (Instant::now(), hosts.clone()));
        hosts
    }

    /// Per sample, up to `k_best` live experts with the highest summed gate scores, best first.
    pub(super) async fn beam_search(&self, scores: &[Vec<Vec<f32>>]) -> Result<Choices> {
        let b = scores.first().map_or(0, |s| s.len());
        let k = self.cfg.k_best;
        let levels = self.cfg.grid.len();
        let now = Instant::now();
        let banned: HashSet<String> = {
            let mut m = lock(&self.banned);
            m.retain(|_, until| *until > now);
            m.keys().cloned().collect()
        };
        let mut beams: Vec<Beam> = vec![vec![(vec![], 0.0, None)]; b];
        for (level, level_scores) in scores.iter().enumerate().take(levels) {
            let prefixes: HashSet<Vec<u32>> =
                beams.iter().flatten().map(|(p, _, _)| p.clone()).collect();
            let lookups = prefixes.into_iter().map(|p| async move {
                let hosts = self.children(&p).await;
                (p, hosts)
            });
            let children: HashMap<Vec<u32>, Hosts> = futures::future::join_all(lookups)
                .await
                .into_iter()
                .collect();
            for (row, beam) in beams.iter_mut().enumerate() {
                let mut next = Vec::new();
                for (prefix, score, _) in beam.iter() {
                    let Some(hosts) = children.get(prefix) else {
                        continue;
                    };
                    for (&c, replicas) in hosts {
                        if c as usize >= self.cfg.grid[level] {
                            continue;
                        }
                        let mut p = prefix.clone();
                        p.push(c);
                        // At the last level, the freshest replica that has not failed lately.
                        let host = if level + 1 == levels {
                            let uid = ExpertUid {
                                name: self.cfg.name.clone(),
                                coords: p.clone(),
                            }
                            .to_string();
                            replicas.iter().find(|h| {
                                h.peer_id()
                                    .is_some_and(|peer| !banned.contains(&ban_key(&uid, &peer)))
                            })
                        } else {
                            replicas.first()
                        };
                        let Some(host) = host else { continue };
                        next.push((p, score + level_scores[row][c as usize], Some(host.clone())));
                    }
                }
                next.sort_by(|a, b| b.1.total_cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
                next.truncate(k);
                *beam = next;
            }
        }
        Ok(beams
            .into_iter()
            .map(|beam| {
                beam.into_iter()
                    .filter_map(|(coords, _, host)| {
                        let host = host?;
                        let uid = ExpertUid {
                            name: self.cfg.name.clone(),
                            coords,
                        };
                        let expert = self.client.expert(
                            &uid.to_string(),
                            host.peer_id()?,
                            host.multiaddrs(),
                        );
                        Some((uid, expert))
                    })
                    .collect()
            })
            .collect())
    }
}
