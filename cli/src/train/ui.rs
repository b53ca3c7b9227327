//! What a person (or a script) sees of a training peer: progress bars and concise lines, or one
//! JSON object per event with `--json`.

use std::sync::Mutex;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use starling_run::event::{Event, Reporter};

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
            Event::Waiting { peers, wanted } => {
                self.line(format!(
                    "waiting for peers before the first batch: {peers} of {wanted} in the run"
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
                audit,
                ..
            } => {
                self.bar.set_position(*epoch);
                if let Some(a) = audit
                    .as_ref()
                    .filter(|a| a.outcome == starling_run::event::AuditFinding::Caught)
                {
                    self.line(format!(
                        "epoch {epoch}: caught reducer {} lying (its span was not applied; refused from now on): {}",
                        a.reducer,
                        a.detail.as_deref().unwrap_or("")
                    ));
                }
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
                refused_peers,
                ..
            } => {
                self.bar.set_position(*epoch);
                self.bar.finish();
                self.line(format!(
                    "finished at epoch {epoch}: {} ({samples} samples here in {seconds:.1} s)",
                    eval_text(*test_accuracy, *val_loss_nats)
                ));
                if !refused_peers.is_empty() {
                    self.line(format!("refused for lying: {}", refused_peers.join(", ")));
                }
            }
            Event::Left { epoch, reason } => {
                self.bar.abandon();
                self.line(format!("left the run at epoch {epoch}: {reason}"));
            }
        }
    }
}
