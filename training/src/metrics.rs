//! Training's Prometheus metrics, in its node's registry ([`starling_node::Node::metrics`])
//! under `starling_training_*`: the epoch, this peer's samples per second, samples processed,
//! global (or outer) steps taken, and the loss when the training loop reports one
//! ([`crate::CollaborativeOptimizer::report_loss`]). The run's progress also goes on the node's
//! board, which its heartbeat publishes.

use std::sync::atomic::AtomicU64;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use starling_node::Node;

/// Training's metrics on one node (cheap to clone; clones share values).
#[derive(Clone, Default)]
pub(crate) struct TrainingMetrics {
    pub epoch: Gauge,
    pub samples_per_second: Gauge<f64, AtomicU64>,
    pub samples: Counter,
    pub steps: Counter,
    pub loss: Gauge<f64, AtomicU64>,
}

impl TrainingMetrics {
    /// The training metrics of `node` (registered on first use).
    pub fn of(node: &Node) -> Self {
        node.metrics().component(|r: &mut Registry| {
            let m = TrainingMetrics::default();
            r.register(
                "training_epoch",
                "The run's epoch (global or outer steps) this peer is at",
                m.epoch.clone(),
            );
            r.register(
                "training_samples_per_second",
                "This peer's training rate",
                m.samples_per_second.clone(),
            );
            r.register(
                "training_samples",
                "Samples this peer has processed",
                m.samples.clone(),
            );
            r.register(
                "training_steps",
                "Global (or outer) steps this peer took",
                m.steps.clone(),
            );
            r.register(
                "training_loss",
                "The last training loss reported",
                m.loss.clone(),
            );
            m
        })
    }
}
