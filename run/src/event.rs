//! What a training session reports: one [`Event`] per thing that happened, handed to a
//! [`Reporter`] (the binary draws progress bars or prints JSON lines; an embedding program may
//! collect them).

use serde::Serialize;

use crate::model::Eval;

/// What a check of another reducer's result found (see `starling_averager::verify`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Audit {
    /// The reducer checked (peer id).
    pub reducer: String,
    /// What the check found.
    pub outcome: AuditFinding,
    /// The evidence or the failure, described (not for `clean`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

/// What a check of a reducer found, as events name it (`clean`, `caught`, `unanswered`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum AuditFinding {
    /// The block recomputed to its signed result.
    Clean,
    /// It lied: its span was not applied, it is refused from now on and the evidence is
    /// published.
    Caught,
    /// It did not show the block: its span was not applied, nothing is proven.
    Unanswered,
}

impl Audit {
    /// The event's form of an averager's audit report.
    pub fn of(a: &starling_averager::AuditReport) -> Self {
        use starling_averager::AuditOutcome as O;
        let (outcome, detail) = match &a.outcome {
            O::Clean => (AuditFinding::Clean, None),
            O::Caught(why) => (AuditFinding::Caught, Some(why.clone())),
            O::Unanswered(why) => (AuditFinding::Unanswered, Some(why.clone())),
        };
        Audit {
            reducer: a.reducer.to_string(),
            outcome,
            detail,
        }
    }
}

/// Something that happened in a training session.
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Event {
    /// The session joined the run.
    Started {
        /// This peer.
        peer: String,
        /// The run.
        run: String,
        /// The model.
        model: String,
        /// Parameters.
        params: usize,
        /// The epoch it starts in.
        epoch: u64,
        /// The run's last epoch.
        epochs: u64,
        /// The text's unigram entropy, nats per character (language models).
        #[serde(skip_serializing_if = "Option::is_none")]
        unigram_entropy_nats: Option<f64>,
        /// The text's bigram entropy (next character given the current one), nats per character.
        #[serde(skip_serializing_if = "Option::is_none")]
        bigram_entropy_nats: Option<f64>,
    },
    /// Waiting before the first batch for the run to have `wanted` peers (`--min-peers`):
    /// sent when the count changes.
    Waiting {
        /// Live peers in the run now (this one included).
        peers: usize,
        /// Peers it waits for.
        wanted: usize,
    },
    /// State came from the swarm.
    Synced {
        /// The epoch synced to.
        epoch: u64,
        /// Bytes received.
        bytes: u64,
        /// Donors that sent chunks.
        donors: usize,
        /// Seconds it took.
        seconds: f64,
    },
    /// A checkpoint was restored.
    Resumed {
        /// Its epoch.
        epoch: u64,
        /// Its directory.
        dir: String,
    },
    /// A global (or outer) step.
    Step {
        /// The epoch after it.
        epoch: u64,
        /// The last batch's loss.
        loss: f64,
        /// This peer's samples per second.
        samples_per_second: f64,
        /// The swarm's samples per second, as reported.
        swarm_samples_per_second: f64,
        /// Live peers in the run.
        peers: usize,
        /// Samples this peer contributed to the step's global batch.
        samples: u64,
        /// Seconds from the epoch's first batch to the step (compute and waiting for the swarm).
        waiting_seconds: f64,
        /// Seconds of averaging (matchmaking and all-reduce).
        averaging_seconds: f64,
        /// The learning rate of the step just taken (`--lr`, or where `--lr-schedule` put it).
        #[serde(default)]
        lr: f64,
        /// Bytes this peer sent in the step's averaging round (its group's all-reduces; 0
        /// without one).
        #[serde(default)]
        bytes_sent: u64,
        /// Bytes it received in that round.
        #[serde(default)]
        bytes_received: u64,
        /// Whether that round brought its group to one parameters and optimizer state
        /// (compared digests and found them equal, or averaged them).
        #[serde(default)]
        state_checked: bool,
        /// Whether that round averaged the parameters and optimizer state (some member's
        /// differed).
        #[serde(default)]
        state_averaged: bool,
        /// Peers it averaged with (itself included), when it did.
        #[serde(skip_serializing_if = "Option::is_none")]
        group_size: Option<usize>,
        /// Why it stepped on its own values, when it did.
        #[serde(skip_serializing_if = "Option::is_none")]
        averaging_error: Option<String>,
        /// Every failure the step met and went on from (the averaging round, progress
        /// reads and writes).
        #[serde(skip_serializing_if = "Vec::is_empty")]
        errors: Vec<String>,
        /// This peer's check of another reducer in the step's round (runs with `--verify`), when
        /// it made one.
        #[serde(skip_serializing_if = "Option::is_none")]
        audit: Option<Audit>,
    },
    /// An evaluation.
    Eval {
        /// The epoch.
        epoch: u64,
        /// Test accuracy, a fraction (classifiers).
        #[serde(skip_serializing_if = "Option::is_none")]
        test_accuracy: Option<f64>,
        /// Validation loss in nats per character (language models).
        #[serde(skip_serializing_if = "Option::is_none")]
        val_loss_nats: Option<f64>,
    },
    /// A checkpoint was written.
    Checkpoint {
        /// Its epoch.
        epoch: u64,
        /// Its directory.
        dir: String,
    },
    /// The run's last epoch was reached.
    Finished {
        /// The epoch.
        epoch: u64,
        /// Final test accuracy (classifiers).
        #[serde(skip_serializing_if = "Option::is_none")]
        test_accuracy: Option<f64>,
        /// Final validation loss (language models).
        #[serde(skip_serializing_if = "Option::is_none")]
        val_loss_nats: Option<f64>,
        /// Samples this peer trained on.
        samples: u64,
        /// Seconds it trained.
        seconds: f64,
        /// SHA-256 of the final parameters' bits (f32, little-endian, in the model's tensor
        /// order), hex: equal on peers that ended bit-identical.
        params_sha256: String,
        /// Peers refused for the rest of the run because evidence proved they lied (runs with
        /// `--verify`), by peer id.
        #[serde(skip_serializing_if = "Vec::is_empty")]
        refused_peers: Vec<String>,
    },
    /// The session left before the end (Ctrl-C).
    Left {
        /// The epoch.
        epoch: u64,
        /// Why.
        reason: String,
    },
}

impl Event {
    /// An evaluation event for `eval` at `epoch`.
    pub fn eval(epoch: u64, eval: Eval) -> Event {
        let (test_accuracy, val_loss_nats) = split(eval);
        Event::Eval {
            epoch,
            test_accuracy,
            val_loss_nats,
        }
    }
}

/// `(test_accuracy, val_loss_nats)` of an evaluation.
pub fn split(eval: Eval) -> (Option<f64>, Option<f64>) {
    match eval {
        Eval::Accuracy(a) => (Some(a), None),
        Eval::ValLoss(l) => (None, Some(l)),
    }
}

/// Where a session's events go.
pub trait Reporter: Send + Sync {
    /// Shows one event.
    fn event(&self, event: &Event);
}
