//! What a person (or a script) sees of a training peer: progress bars and concise lines, or one
//! JSON object per event with `--json`.

use std::sync::Mutex;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::Serialize;

use super::model::Eval;

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

/// One JSON object per line on stdout.
pub struct JsonLines;

impl Reporter for JsonLines {
    fn event(&self, event: &Event) {
        if let Ok(line) = serde_json::to_string(event) {
            println!("{line}");
        }
    }
}

/// A progress bar over the run's epochs, with notable events as lines above it (plain lines when
/// stdout is not a terminal).
pub struct Bar {
    bar: ProgressBar,
    label: String,
    last_eval: Mutex<String>,
}

impl Bar {
    /// A bar labelled `label` (empty for a lone peer), drawn to stdout, or into a
    /// `MultiProgress` when the caller adds it to one.
    pub fn new(label: &str, epochs: u64) -> Self {
        let bar = ProgressBar::with_draw_target(Some(epochs), ProgressDrawTarget::stdout());
        bar.set_style(
            ProgressStyle::with_template(
                "{prefix}[{elapsed_precise}] {bar:24.cyan/blue} epoch {pos}/{len} {msg}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        if !label.is_empty() {
            bar.set_prefix(format!("{label} "));
        }
        bar.enable_steady_tick(Duration::from_millis(250));
        Bar {
            bar,
            label: label.to_string(),
            last_eval: Mutex::new(String::new()),
        }
    }

    /// The bar, to add to a `MultiProgress`.
    pub fn bar(&self) -> &ProgressBar {
        &self.bar
    }

    fn line(&self, text: String) {
        let text = if self.label.is_empty() {
            text
        } else {
            format!("{}: {text}", self.label)
        };
        if self.bar.is_hidden() {
            println!("{text}");
        } else {
            self.bar.println(text);
        }
    }
}

fn eval_text(test_accuracy: Option<f64>, val_loss: Option<f64>) -> String {
    match (test_accuracy, val_loss) {
        (Some(a), _) => format!("test accuracy {:.1}%", 100.0 * a),
        (_, Some(l)) => format!("validation loss {l:.3} nats/char"),
        _ => String::new(),
    }
}

impl Reporter for Bar {
    fn event(&self, event: &Event) {
        match event {
            Event::Started {
                peer,
                run,
                model,
                params,
                epoch,
                epochs,
                unigram_entropy_nats,
                bigram_entropy_nats,
            } => {
                self.bar.set_position(*epoch);
                let entropy = match (unigram_entropy_nats, bigram_entropy_nats) {
                    (Some(u), Some(b)) => format!(
                        "; the text's unigram entropy is {u:.3} nats/char, its bigram entropy {b:.3}"
                    ),
                    _ => String::new(),
                };
                self.line(format!(
                    "peer {peer} trains {model} ({params} parameters) in run {run}, epoch {epoch} of {epochs}{entropy}"
                ));
            }
            Event::Synced {
                epoch,
                bytes,
                donors,
                seconds,
            } => {
                self.bar.set_position(*epoch);
                self.line(format!(
                    "synced state at epoch {epoch} from {donors} peers ({:.1} MB in {seconds:.1} s)",
                    *bytes as f64 / 1e6
                ));
            }
            Event::Resumed { epoch, dir } => {
                self.bar.set_position(*epoch);
                self.line(format!("resumed from {dir} at epoch {epoch}"));
            }
            Event::Step {
                epoch,
                loss,
                samples_per_second,
                swarm_samples_per_second,
                peers,
                group_size,
                averaging_error,
                ..
            } => {
                self.bar.set_position(*epoch);
                let eval = self.last_eval.lock().map(|e| e.clone()).unwrap_or_default();
                let group = match (group_size, averaging_error) {
                    (_, Some(_)) => " | alone this step".to_string(),
                    (Some(g), None) => format!(" | averaged with {}", g.saturating_sub(1)),
                    _ => String::new(),
                };
                self.bar.set_message(format!(
                    "| loss {loss:.3} | {samples_per_second:.0} samples/s (swarm {swarm_samples_per_second:.0}) | {peers} peers{group}{eval}"
                ));
            }
            Event::Eval {
                epoch,
                test_accuracy,
                val_loss_nats,
            } => {
                let text = eval_text(*test_accuracy, *val_loss_nats);
                if let Ok(mut e) = self.last_eval.lock() {
                    *e = format!(" | {text}");
                }
                self.line(format!("epoch {epoch}: {text}"));
            }
            Event::Checkpoint { epoch, dir } => {
                self.line(format!("epoch {epoch}: checkpoint saved in {dir}"));
            }
            Event::Finished {
                epoch,
                test_accuracy,
                val_loss_nats,
                samples,
                seconds,
                ..
            } => {
                self.bar.set_position(*epoch);
                self.bar.finish();
                self.line(format!(
                    "finished at epoch {epoch}: {} ({samples} samples here in {seconds:.1} s)",
                    eval_text(*test_accuracy, *val_loss_nats)
                ));
            }
            Event::Left { epoch, reason } => {
                self.bar.abandon();
                self.line(format!("left the run at epoch {epoch}: {reason}"));
            }
        }
    }
}
