//! The tensor schema of a step (sizes, codec, aggregation), its hash, and the announcements
//! under the run's schema key that let a peer left alone tell a schema mismatch from an empty
//! swarm.
//!
//! (Not to be confused with `starling_training::schema_hash`, the hash of a model's named
//! tensors that a run's manifest carries: this one is what a group's members must agree on.)

use std::time::Duration;

use serde::{Deserialize, Serialize};
use starling_node::lock::lock;
use tokio::time::{timeout, Instant};
use tracing::Instrument;

use super::Averager;
use crate::{AveragerConfig, AveragerError};

/// The tensor schema of a step: what peers must agree on to average together.
pub(super) struct Schema {
    pub hash: u64,
    pub summary: String,
}

impl Schema {
    /// The schema of tensors of `sizes` averaged with `codec` (the wire label).
    pub fn of(sizes: &[usize], codec: &str) -> Self {
        let hash = group_schema_hash(sizes, codec);
        let total: usize = sizes.iter().sum();
        Schema {
            hash,
            summary: format!(
                "{} tensors of {total} elements in all, codec {codec} (schema {hash:016x})",
                sizes.len()
            ),
        }
    }
}

/// What a peer announces under a run's schema key, so that a peer left alone can tell a schema
/// mismatch from an empty swarm.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct SchemaNote {
    hash: u64,
    summary: String,
}

impl Averager {
    /// The run's schema key: where peers announce their schema.
    fn schema_key(&self) -> String {
        format!("{}.averager.schemas", self.config.prefix)
    }

    /// Announces this peer's schema under the run's schema key, in the background (nothing
    /// waits for it), when the last announcement is about to expire or named another schema.
    pub(super) fn announce(&self, schema: &Schema) {
        let cfg = &self.config;
        let lasts = cfg.matchmaking_time * 2 + cfg.request_timeout;
        {
            let mut last = lock(&self.announced);
            let fresh = last.is_some_and(|(hash, until)| {
                hash == schema.hash && until > Instant::now() + cfg.matchmaking_time
            });
            if fresh {
                return;
            }
            *last = Some((schema.hash, Instant::now() + lasts));
        }
        let node = self.transport.node().clone();
        let key = self.schema_key();
        let note = SchemaNote {
            hash: schema.hash,
            summary: schema.summary.clone(),
        };
        let expires = starling_dht::now_ms() + lasts.as_millis() as u64;
        let t = cfg.request_timeout;
        let store = async move {
            let subkey = node.peer_id().to_string();
            match timeout(t, node.store(&key, &subkey, &note, expires)).await {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => tracing::debug!("announcing the tensor schema: {e}"),
                Err(_) => tracing::debug!("announcing the tensor schema timed out"),
            }
        };
        tokio::spawn(store.in_current_span());
    }

    /// Turns a lone peer's `NoGroup` into `SchemaMismatch` when other peers of the run were
    /// searching with another schema, and none with this one.
    pub(super) async fn explain_loneliness(
        &self,
        schema: &Schema,
        no_group: AveragerError,
    ) -> AveragerError {
        let node = self.transport.node();
        let me = node.peer_id().to_string();
        let t = self.config.request_timeout.min(Duration::from_secs(2));
        let Ok(Ok(notes)) = timeout(t, node.get::<SchemaNote>(&self.schema_key())).await else {
            return no_group;
        };
        let others: Vec<SchemaNote> = notes
            .into_iter()
            .filter(|(peer, _, _)| *peer != me)
            .map(|(_, note, _)| note)
            .collect();
        if others.is_empty() || others.iter().any(|n| n.hash == schema.hash) {
            return no_group;
        }
        let mut summaries: Vec<String> = others.into_iter().map(|n| n.summary).collect();
        summaries.sort();
        summaries.dedup();
        AveragerError::SchemaMismatch {
            mine: schema.summary.clone(),
            others: summaries,
        }
    }
}

/// What besides the tensor sizes peers must agree on: the codec, the aggregation unless it is
/// the mean, and whether rounds are verified (so that the schema of a plain mean round stays
/// what it always was).
pub(super) fn wire_label(cfg: &AveragerConfig) -> String {
    let mut label = if cfg.aggregation.is_mean() {
        cfg.codec.to_string()
    } else {
        format!("{} with {}", cfg.codec, cfg.aggregation)
    };
    if cfg.verify > 0.0 {
        label.push_str(", verified");
    }
    label
}

/// FNV-1a over the tensor sizes and the codec name: stable across platforms and versions.
pub(crate) fn group_schema_hash(sizes: &[usize], codec: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for b in bytes {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    };
    eat(&(sizes.len() as u64).to_le_bytes());
    for s in sizes {
        eat(&(*s as u64).to_le_bytes());
    }
    eat(codec.as_bytes());
    h
}
