//! Runs as signed manifests: what a training run is (model, data kind, optimizer,
//! hyper-parameters, mode, codec, the tensor schema), signed by its creator's identity and kept
//! in the DHT by every peer of the run.
//!
//! The manifest's JSON text is what the creator signs (ed25519, domain
//! [`SIGN_DOMAIN`]); a [`SignedManifest`] carries that exact text, the creator's public key and
//! the signature. Every peer of the run re-publishes the signed manifest under `starling.run.NAME`
//! in a sub-key only it may write, so the run stays findable after its creator leaves, and
//! nobody but the creator can change what it says.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use anyhow::{anyhow, bail, ensure, Context, Result};
use serde::{Deserialize, Serialize};
use starling_dht::{now_ms, owner::verify_document, Entry, OwnerKey, VerifyingKey};
use starling_node::{peer_id_of_owner, Node, PeerId};

/// The manifest format this binary writes and the newest it reads.
pub const MANIFEST_FORMAT: u32 = 1;
/// What a creator's signature over a manifest is for.
pub const SIGN_DOMAIN: &str = "starling-run-manifest-v1";
/// The models this binary can build.
pub const KNOWN_MODELS: [&str; 2] = ["mlp", "charlm"];
/// How long a published copy lives in the DHT; peers re-publish well before.
pub const PUBLISH_TTL: Duration = Duration::from_secs(3600);
/// How often a peer of the run re-publishes the manifest.
pub const REPUBLISH_EVERY: Duration = Duration::from_secs(600);
/// Largest signed manifest accepted, in bytes (the DHT bounds values at 16 KiB).
const MAX_MANIFEST_BYTES: usize = 12 * 1024;

/// The DHT key a run's manifest is published under.
///
/// ```
/// # use starling_run::manifest::run_key;
/// assert_eq!(run_key("digits"), "starling.run.digits");
/// ```
pub fn run_key(name: &str) -> String {
    format!("starling.run.{name}")
}

/// The aggregation of manifests that do not name one.
fn mean() -> String {
    "mean".into()
}

/// Everything a peer needs to train in a run, identically to the others.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunManifest {
    /// [`MANIFEST_FORMAT`] when written.
    pub format: u32,
    /// The run's name.
    pub name: String,
    /// The model and its sizes.
    pub model: ModelSpec,
    /// What the model trains on.
    pub data: DataSpec,
    /// The (gradient mode: shared; DiLoCo: inner) optimizer.
    pub optimizer: OptimizerSpec,
    /// How the peers train together.
    pub mode: ModeSpec,
    /// The averaging codec (`none`, `f16`, `u8`, ...).
    pub codec: String,
    /// How reducers combine contributions (`mean`, `median`, `trimmed-mean[:F]`,
    /// `centered-clip[:iters=N][,tau=T][,reject=K]`); manifests written before it existed mean `mean`.
    #[serde(default = "mean")]
    pub aggregation: String,
    /// Probability that a peer checks one random block of another reducer's result after each
    /// round (`AveragerConfig::verify`; 0: off). Manifests written before it existed mean 0.
    #[serde(default)]
    pub verify: f64,
    /// Gradient mode: each peer averages its gradients' momentum with this factor instead of
    /// the gradients (`CollaborativeConfig::worker_momentum`), and the optimizer has none of its
    /// own. Left out of manifests without it (so older peers still read them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker_momentum: Option<f64>,
    /// Samples per local batch.
    pub batch_size: u64,
    /// Samples per global step (gradient mode).
    pub target_batch_size: u64,
    /// Epochs (global or outer steps) the run lasts.
    pub epochs: u64,
    /// Evaluate every this many epochs.
    pub eval_every: u64,
    /// Seed of the initial parameters (every peer of a new run starts from the same ones).
    pub seed: u64,
    /// [`starling_training::schema_hash`] of the model's tensors, hex.
    pub schema_hash: String,
    /// When the run was created, unix ms.
    pub created_ms: u64,
}

/// The built-in models.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum ModelSpec {
    /// Image classifier: inputs -> hidden -> relu -> classes.
    Mlp {
        /// Hidden units.
        hidden: usize,
    },
    /// Character-level transformer language model.
    Charlm {
        /// Characters of context.
        context: usize,
        /// Model width.
        dim: usize,
        /// Transformer blocks.
        layers: usize,
        /// Attention heads (divide `dim`).
        heads: usize,
        /// A remote mixture-of-experts layer after the blocks.
        moe: Option<MoeSpec>,
    },
}

impl ModelSpec {
    /// The model's name on the command line.
    pub fn name(&self) -> &'static str {
        match self {
            ModelSpec::Mlp { .. } => "mlp",
            ModelSpec::Charlm { .. } => "charlm",
        }
    }
}

/// A remote mixture-of-experts layer served by `starling experts serve` peers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MoeSpec {
    /// The grid's prefix (`--moe-grid`).
    pub grid: String,
    /// Experts in the grid's one row (`prefix.0.[0:experts]`).
    pub experts: usize,
    /// Experts each token goes to.
    pub k_best: usize,
}

/// What a model trains on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum DataSpec {
    /// scikit-learn's 8x8 digits, embedded (through smartcore).
    Digits,
    /// IDX files (MNIST's format) of `rows` x `cols` images in `classes` classes.
    Idx {
        /// Image rows.
        rows: usize,
        /// Image columns.
        cols: usize,
        /// Label classes.
        classes: usize,
    },
    /// A UTF-8 text file over this vocabulary (every character the creator's text holds).
    Text {
        /// The characters, in token order.
        vocab: String,
    },
}

/// The optimizer every peer builds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OptimizerSpec {
    /// `adamw`, `sgd` or `sign`.
    pub kind: OptimizerKind,
    /// Learning rate.
    pub lr: f64,
    /// Decoupled weight decay (AdamW) or L2 (SGD).
    pub weight_decay: f64,
    /// SGD momentum (ignored by AdamW).
    pub momentum: f64,
    /// The learning rate over the run (absent: `lr` throughout).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schedule: Option<ScheduleSpec>,
}

/// A learning-rate schedule over the run's epochs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum ScheduleSpec {
    /// Linear warmup to `lr` over `warmup_epochs`, then a half cosine from `lr` down to 0 at
    /// the run's last epoch.
    Cosine {
        /// Epochs of warmup (0: start at `lr`).
        warmup_epochs: u64,
    },
}

/// The optimizer kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OptimizerKind {
    /// AdamW (PyTorch's definition).
    Adamw,
    /// SGD with (Nesterov) momentum.
    Sgd,
    /// Steps by the sign of the (averaged) gradient, or of its momentum; decoupled weight
    /// decay. With `--codec dct-topk:C:K:momentum=B` (the momentum in the compressor) it is
    /// DeMo.
    Sign,
}

impl FromStr for OptimizerKind {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "adamw" => Ok(OptimizerKind::Adamw),
            "sgd" => Ok(OptimizerKind::Sgd),
            "sign" => Ok(OptimizerKind::Sign),
            other => bail!("unknown optimizer {other:?}: adamw, sgd or sign"),
        }
    }
}

/// How the peers train together.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum ModeSpec {
    /// Average gradients over each global batch, one shared step.
    Gradients,
    /// DiLoCo: `inner_steps` local steps, then an outer Nesterov step on the averaged deltas.
    Diloco {
        /// Local steps per outer step.
        inner_steps: u64,
        /// Outer learning rate.
        outer_lr: f64,
        /// Outer Nesterov momentum.
        outer_momentum: f64,
    },
}

impl RunManifest {
    /// What the run's settings leave unchecked, for its creator to read. None of it is an error:
    /// the run trains as asked. Today one: `--verify` with a lossy value codec (`f16`, `u8`,
    /// ...), where each peer receives its reducers' results as deltas from its own values, not
    /// the results themselves, and cannot check them against the result seals: a reducer's
    /// result is checked where it keeps it, but one that sends a single peer a wrong delta is
    /// not caught (see `starling_averager::verify`).
    ///
    /// ```
    /// use starling_run::{manifest::DataSpec, setup::{new_manifest, Hyper}};
    /// let checked = Hyper { verify: Some(1.0), ..Hyper::default() };
    /// let m = new_manifest("r", "mlp", &checked, DataSpec::Digits)?;
    /// assert!(m.caveats().is_empty());
    /// let lossy = Hyper { codec: Some("f16".into()), ..checked };
    /// let m = new_manifest("r", "mlp", &lossy, DataSpec::Digits)?;
    /// assert!(m.caveats()[0].contains("--codec none"));
    /// # Ok::<(), anyhow::Error>(())
    /// ```
    pub fn caveats(&self) -> Vec<String> {
        let mut out = Vec::new();
        let lossy_values = matches!(
            starling_training::GradientCompression::parse_codec(&self.codec),
            Ok((codec, starling_training::GradientCompression::Codec)) if !codec.is_lossless()
        );
        if self.verify > 0.0 && lossy_values {
            out.push(format!(
                "--verify with --codec {}: each peer receives its reducers' results as deltas it cannot check, so a reducer that sends one peer a wrong delta goes uncaught (its own result is still checked); use --codec none for fully checked rounds",
                self.codec
            ));
        }
        out
    }

    /// Checks every field against what this binary can train with, naming the first one out of
    /// range (the message uses the command-line flag names).
    pub fn validate(&self) -> Result<()> {
        ensure!(
            self.format >= 1 && self.format <= MANIFEST_FORMAT,
            "manifest format {} is not supported (this binary reads 1 to {MANIFEST_FORMAT}): upgrade starling",
            self.format
        );
        validate_name(&self.name)?;
        in_range("--batch-size", self.batch_size as f64, 1.0, 4096.0)?;
        in_range(
            "--target-batch-size",
            self.target_batch_size as f64,
            self.batch_size as f64,
            1e7,
        )?;
        in_range("--epochs", self.epochs as f64, 1.0, 1e6)?;
        in_range("--eval-every", self.eval_every as f64, 1.0, 1e6)?;
        positive_at_most("--lr", self.optimizer.lr, 10.0)?;
        in_range("--weight-decay", self.optimizer.weight_decay, 0.0, 1.0)?;
        in_range("--momentum", self.optimizer.momentum, 0.0, 0.999)?;
        if let Some(ScheduleSpec::Cosine { warmup_epochs }) = self.optimizer.schedule {
            in_range(
                "--warmup-epochs",
                warmup_epochs as f64,
                0.0,
                self.epochs as f64,
            )?;
        }
        starling_training::GradientCompression::parse_codec(&self.codec)
            .map_err(|e| anyhow!("--codec {:?}: {e}", self.codec))?;
        let aggregation = starling_averager::Aggregation::from_str(&self.aggregation)
            .map_err(|e| anyhow!("--aggregation {:?}: {e}", self.aggregation))?;
        in_range("--verify", self.verify, 0.0, 1.0)?;
        if let Some(beta) = self.worker_momentum {
            ensure!(
                beta.is_finite() && beta > 0.0 && beta < 1.0,
                "--worker-momentum must be above 0 and below 1, got {beta}"
            );
            ensure!(
                matches!(self.mode, ModeSpec::Gradients),
                "--worker-momentum is for gradient mode (DiLoCo's outer optimizer has its own momentum)"
            );
            ensure!(
                self.optimizer.momentum == 0.0,
                "--worker-momentum replaces the optimizer's momentum: give --momentum 0 (or leave it out)"
            );
        }
        if self.verify > 0.0 && !aggregation.is_coordinatewise() {
            bail!(
                "--verify needs a coordinate-wise --aggregation (mean, median, trimmed-mean), not {}",
                self.aggregation
            );
        }
        if let ModeSpec::Diloco {
            inner_steps,
            outer_lr,
            outer_momentum,
        } = &self.mode
        {
            in_range("--inner-steps", *inner_steps as f64, 1.0, 1e5)?;
            positive_at_most("--outer-lr", *outer_lr, 10.0)?;
            in_range("--outer-momentum", *outer_momentum, 0.0, 0.999)?;
        }
        match &self.model {
            ModelSpec::Mlp { hidden } => {
                in_range("--hidden", *hidden as f64, 1.0, 8192.0)?;
                ensure!(
                    !matches!(self.data, DataSpec::Text { .. }),
                    "model mlp classifies images: its data is digits or IDX files, not text"
                );
            }
            ModelSpec::Charlm {
                context,
                dim,
                layers,
                heads,
                moe,
            } => {
                in_range("--context", *context as f64, 2.0, 1024.0)?;
                in_range("--dim", *dim as f64, 4.0, 2048.0)?;
                in_range("--layers", *layers as f64, 1.0, 24.0)?;
                in_range("--heads", *heads as f64, 1.0, 64.0)?;
                ensure!(dim % heads == 0, "--heads {heads} must divide --dim {dim}");
                ensure!(
                    matches!(self.data, DataSpec::Text { .. }),
                    "model charlm trains on text: give --data FILE (UTF-8)"
                );
                if let Some(m) = moe {
                    ensure!(!m.grid.is_empty(), "--moe-grid must not be empty");
                    in_range("--moe-experts", m.experts as f64, 1.0, 4096.0)?;
                    in_range("--moe-k", m.k_best as f64, 1.0, m.experts as f64)?;
                }
            }
        }
        match &self.data {
            DataSpec::Digits => {}
            DataSpec::Idx {
                rows,
                cols,
                classes,
            } => {
                in_range("image rows", *rows as f64, 1.0, 4096.0)?;
                in_range("image columns", *cols as f64, 1.0, 4096.0)?;
                in_range("classes", *classes as f64, 2.0, 65536.0)?;
            }
            DataSpec::Text { vocab } => {
                let n = vocab.chars().count();
                in_range("the text's distinct characters", n as f64, 2.0, 4096.0)?;
            }
        }
        u64::from_str_radix(&self.schema_hash, 16)
            .map_err(|_| anyhow!("schema hash {:?} is not hex", self.schema_hash))?;
        Ok(())
    }

    /// Reads a manifest's JSON text: first what this binary must support (format, model), with
    /// a message that says so, then every field strictly, then [`Self::validate`].
    pub fn from_json(text: &str) -> Result<Self> {
        let value: serde_json::Value =
            serde_json::from_str(text).context("the manifest is not JSON")?;
        if let Some(format) = value.get("format").and_then(|f| f.as_u64()) {
            ensure!(
                format <= MANIFEST_FORMAT as u64,
                "the run's manifest has format {format}; this binary reads up to {MANIFEST_FORMAT}: upgrade starling"
            );
        }
        if let Some(kind) = value
            .get("model")
            .and_then(|m| m.get("kind"))
            .and_then(|k| k.as_str())
        {
            ensure!(
                KNOWN_MODELS.contains(&kind),
                "unknown model {kind:?}: this binary builds {}",
                KNOWN_MODELS.join(", ")
            );
        }
        let manifest: RunManifest =
            serde_json::from_value(value).context("the manifest's fields do not parse")?;
        manifest.validate()?;
        Ok(manifest)
    }
}

fn validate_name(name: &str) -> Result<()> {
    ensure!(
        !name.is_empty()
            && name.len() <= 64
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)),
        "run name {name:?}: use 1 to 64 of A-Z a-z 0-9 - _ ."
    );
    Ok(())
}

fn in_range(what: &str, v: f64, lo: f64, hi: f64) -> Result<()> {
    ensure!(
        v.is_finite() && v >= lo && v <= hi,
        "{what} must be between {lo} and {hi}, got {v}"
    );
    Ok(())
}

fn positive_at_most(what: &str, v: f64, hi: f64) -> Result<()> {
    ensure!(
        v.is_finite() && v > 0.0 && v <= hi,
        "{what} must be above 0 and at most {hi}, got {v}"
    );
    Ok(())
}

/// A manifest as its creator signed it. This is also the manifest file's format
/// (`--save-manifest`, `--manifest`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SignedManifest {
    /// The manifest's JSON text, exactly as signed.
    pub manifest: String,
    /// The creator's ed25519 public key, hex.
    pub creator: String,
    /// The signature, hex.
    pub signature: String,
}

impl SignedManifest {
    /// Signs `manifest` with `key` (the creator's node identity).
    pub fn sign(manifest: &RunManifest, key: &OwnerKey) -> Result<Self> {
        let text = serde_json::to_string(manifest)?;
        let signature = key.sign_document(SIGN_DOMAIN, text.as_bytes());
        Ok(SignedManifest {
            manifest: text,
            creator: hex::encode(key.public().as_bytes()),
            signature: hex::encode(signature),
        })
    }

    /// Parses a signed manifest's JSON (a file, or a DHT value).
    pub fn from_json(bytes: &[u8]) -> Result<Self> {
        ensure!(
            bytes.len() <= MAX_MANIFEST_BYTES,
            "the signed manifest is {} bytes; at most {MAX_MANIFEST_BYTES} are accepted",
            bytes.len()
        );
        serde_json::from_slice(bytes)
            .context("not a signed run manifest (JSON with manifest, creator, signature)")
    }

    /// The creator's key, if the field is one.
    pub fn creator_key(&self) -> Result<VerifyingKey> {
        let bytes: [u8; 32] = hex::decode(&self.creator)
            .ok()
            .and_then(|b| b.try_into().ok())
            .ok_or_else(|| anyhow!("the manifest's creator is not a 32-byte hex key"))?;
        VerifyingKey::from_bytes(&bytes)
            .map_err(|_| anyhow!("the manifest's creator is not an ed25519 key"))
    }

    /// Checks the signature, then reads and validates the manifest it covers.
    pub fn verify(&self) -> Result<(RunManifest, VerifyingKey)> {
        let key = self.creator_key()?;
        let sig = hex::decode(&self.signature)
            .map_err(|_| anyhow!("the manifest's signature is not hex"))?;
        verify_document(&key, SIGN_DOMAIN, self.manifest.as_bytes(), &sig).map_err(|_| {
            anyhow!(
                "the manifest's signature does not verify with its creator's key {}: refusing a forged or altered manifest",
                creator_label(&key)
            )
        })?;
        Ok((RunManifest::from_json(&self.manifest)?, key))
    }

    /// The JSON bytes published and saved.
    pub fn to_json(&self) -> Vec<u8> {
        let mut v = serde_json::to_vec_pretty(self).unwrap_or_default();
        v.push(b'\n');
        v
    }
}

/// A creator's key as people see it: the peer id of that identity (what `--run NAME@KEY` takes).
pub fn creator_label(key: &VerifyingKey) -> String {
    peer_id_of_owner(key).map_or_else(|| hex::encode(key.as_bytes()), |p| p.to_string())
}

/// `NAME` or `NAME@KEY`: a run, optionally pinned to its creator (a peer id, or a 64-digit hex
/// ed25519 key).
#[derive(Debug, Clone, PartialEq)]
pub struct RunRef {
    /// The run's name.
    pub name: String,
    /// The creator the manifest must be signed by.
    pub pin: Option<Pin>,
}

/// Whose signature a pinned run requires.
#[derive(Debug, Clone, PartialEq)]
pub enum Pin {
    /// The identity with this peer id.
    Peer(PeerId),
    /// This ed25519 key.
    Key(VerifyingKey),
}

impl Pin {
    fn matches(&self, key: &VerifyingKey) -> bool {
        match self {
            Pin::Peer(p) => peer_id_of_owner(key).as_ref() == Some(p),
            Pin::Key(k) => k == key,
        }
    }
}

impl fmt::Display for Pin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Pin::Peer(p) => write!(f, "{p}"),
            Pin::Key(k) => write!(f, "{}", hex::encode(k.as_bytes())),
        }
    }
}

impl FromStr for RunRef {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<Self> {
        let (name, pin) = match s.split_once('@') {
            None => (s, None),
            Some((name, key)) => {
                let pin = if key.len() == 64 && key.chars().all(|c| c.is_ascii_hexdigit()) {
                    let bytes: [u8; 32] = hex::decode(key)?
                        .try_into()
                        .map_err(|_| anyhow!("bad key"))?;
                    Pin::Key(
                        VerifyingKey::from_bytes(&bytes)
                            .map_err(|_| anyhow!("{key:?} is not an ed25519 key"))?,
                    )
                } else {
                    Pin::Peer(key.parse().map_err(|_| {
                        anyhow!("{key:?} after @ is neither a peer id nor a 64-digit hex key")
                    })?)
                };
                (name, Some(pin))
            }
        };
        validate_name(name)?;
        Ok(RunRef {
            name: name.to_string(),
            pin,
        })
    }
}

/// Picks the run's manifest among published copies: drops copies that do not verify (counted
/// in the error when nothing else remains), keeps the pinned creator's (or refuses), refuses two
/// different creators when unpinned, and takes the newest of one creator's.
pub fn choose(run: &RunRef, copies: &[SignedManifest]) -> Result<(RunManifest, SignedManifest)> {
    let mut valid: Vec<(RunManifest, VerifyingKey, &SignedManifest)> = Vec::new();
    let mut refused = Vec::new();
    for copy in copies {
        match copy.verify() {
            Ok((m, key)) if m.name == run.name => valid.push((m, key, copy)),
            Ok((m, _)) => refused.push(format!(
                "a manifest for run {:?} published under {:?}",
                m.name, run.name
            )),
            Err(e) => refused.push(format!("{e:#}")),
        }
    }
    if valid.is_empty() {
        if refused.is_empty() {
            bail!("no manifest for run {:?} in the DHT", run.name);
        }
        bail!(
            "run {:?}: every published manifest was refused: {}",
            run.name,
            refused.join("; ")
        );
    }
    let creators = |v: &[(RunManifest, VerifyingKey, &SignedManifest)]| {
        let mut c: Vec<String> = v.iter().map(|(_, k, _)| creator_label(k)).collect();
        c.sort();
        c.dedup();
        c
    };
    if let Some(pin) = &run.pin {
        let all = creators(&valid);
        valid.retain(|(_, k, _)| pin.matches(k));
        ensure!(
            !valid.is_empty(),
            "run {:?} is pinned to {pin}, but its manifest is signed by {}: refusing it",
            run.name,
            all.join(", ")
        );
    } else {
        let all = creators(&valid);
        ensure!(
            all.len() == 1,
            "run {:?} has manifests from {} creators ({}): pin the one you mean with --run {}@KEY",
            run.name,
            all.len(),
            all.join(", "),
            run.name
        );
    }
    valid.sort_by_key(|(m, _, _)| m.created_ms);
    let (m, _, copy) = valid.pop().ok_or_else(|| anyhow!("no manifest"))?;
    Ok((m, copy.clone()))
}

/// Publishes (or re-publishes) `signed` under the run's key in this node's own sub-key.
pub async fn publish(node: &Node, name: &str, signed: &SignedManifest) -> Result<()> {
    let entry = Entry::new(
        node.owner_marker(),
        signed.to_json(),
        now_ms() + PUBLISH_TTL.as_millis() as u64,
    );
    match node.put_entry(&run_key(name), entry).await {
        Ok(_) => Ok(()),
        // A run's first peer has nobody to replicate to yet: its own store serves the manifest
        // to those who join, and every joiner re-publishes it.
        Err(starling_node::NodeError::QuorumFailed { .. }) => Ok(()),
        Err(e) => Err(e).with_context(|| format!("publishing run {name:?}'s manifest")),
    }
}

/// Reads the run's manifest from the DHT, retrying until `timeout` (a node that just joined
/// may not reach the copies at once).
pub async fn fetch(
    node: &Node,
    run: &RunRef,
    timeout: Duration,
) -> Result<(RunManifest, SignedManifest)> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let record = node.get_record(&run_key(&run.name)).await;
        let copies: Vec<SignedManifest> = match &record {
            Ok(Some(r)) => r
                .live_entries(now_ms())
                .filter_map(|e| SignedManifest::from_json(&e.value).ok())
                .collect(),
            _ => Vec::new(),
        };
        let chosen = choose(run, &copies);
        if chosen.is_ok() || !copies.is_empty() || tokio::time::Instant::now() >= deadline {
            return chosen.with_context(|| {
                format!(
                    "looking up run {:?} (is the bootstrap peer in that run?)",
                    run.name
                )
            });
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// A valid manifest for tests: AdamW at 0.01, gradient mode, codec none, batches of 32 of a
/// 128-sample global batch, 10 epochs, seed 1.
#[cfg(test)]
pub(crate) fn test_manifest(model: ModelSpec, data: DataSpec) -> RunManifest {
    RunManifest {
        format: MANIFEST_FORMAT,
        name: "t".into(),
        model,
        data,
        optimizer: OptimizerSpec {
            kind: OptimizerKind::Adamw,
            lr: 0.01,
            weight_decay: 0.0,
            momentum: 0.0,
            schedule: None,
        },
        mode: ModeSpec::Gradients,
        codec: "none".into(),
        aggregation: "mean".into(),
        verify: 0.0,
        worker_momentum: None,
        batch_size: 32,
        target_batch_size: 128,
        epochs: 10,
        eval_every: 5,
        seed: 1,
        schema_hash: "00ff".into(),
        created_ms: 0,
    }
}

#[cfg(test)]
mod tests;
