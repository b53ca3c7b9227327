//! Training's Prometheus metrics, in its node's registry ([`starling_node::Node::metrics`])
//! under `starling_training_*`: the epoch, this peer's samples per second, samples processed,
//! global (or outer) steps taken, and the loss when the training loop reports one
//! ([`crate::CollaborativeOptimizer::report_loss`]). The run's progress also goes on the node's
//! board as the [`TrainingBoard`] section, which its heartbeat publishes, and every reported
//! loss into the node's journal of [`LossPoint`]s (a dashboard's loss curve).

use std::sync::atomic::AtomicU64;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use serde::{Deserialize, Serialize};
use starling_node::board::Section;
use starling_node::Node;

/// Longest run name the board carries, in bytes (longer names are cut).
pub const MAX_BOARD_RUN_LEN: usize = 128;

/// One point of the loss curve this node's training reported, kept in the node's journal
/// (`node.metrics().journal::<LossPoint>()`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LossPoint {
    /// When it was reported (unix ms).
    pub time_ms: u64,
    /// The run's epoch (global step) at the time.
    pub epoch: u64,
    /// The training loss.
    pub loss: f64,
}

/// Training's section of its node's board (see [`starling_node::board`]): the run this peer
/// trains in and how far it is, as its heartbeat tells the swarm.
///
/// ```
/// use starling_training::TrainingBoard;
/// let m = starling_node::metrics::Metrics::new();
/// m.set_section(&TrainingBoard::new("x".repeat(500), 3, f64::NAN, Some(0.5)));
/// let t = m.board().get::<TrainingBoard>().unwrap();
/// assert_eq!((t.run.len(), t.epoch, t.samples_per_second), (128, 3, 0.0));
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainingBoard {
    /// The run's name (at most [`MAX_BOARD_RUN_LEN`] bytes).
    pub run: String,
    /// The run's epoch this peer is at.
    pub epoch: u64,
    /// This peer's training rate (0 when not finite).
    pub samples_per_second: f64,
    /// The last loss this peer reported (`None` until there is a finite one).
    pub loss: Option<f64>,
}

impl TrainingBoard {
    /// The section for `run` at `epoch`, with the name cut to [`MAX_BOARD_RUN_LEN`] bytes and
    /// non-finite numbers left out.
    pub fn new(run: String, epoch: u64, samples_per_second: f64, loss: Option<f64>) -> Self {
        TrainingBoard {
            run: starling_node::board::cut(&run, MAX_BOARD_RUN_LEN),
            epoch,
            samples_per_second: if samples_per_second.is_finite() {
                samples_per_second
            } else {
                0.0
            },
            loss: loss.filter(|l| l.is_finite()),
        }
    }
}

impl Section for TrainingBoard {
    const NAME: &'static str = "training";
    const VERSION: u32 = 1;
}

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
