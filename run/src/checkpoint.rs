//! Which run a checkpoint directory belongs to: the run's signed manifest, kept beside the
//! checkpoint ([`CHECKPOINT_MANIFEST`]), claims the directory for that run, so that a session
//! never resumes from, or overwrites, another run's state.

use std::path::Path;

use anyhow::{Context, Result};

use crate::manifest::{RunManifest, SignedManifest};

/// The file a checkpoint directory keeps the run's signed manifest in.
pub const CHECKPOINT_MANIFEST: &str = "run-manifest.json";

/// The run a checkpoint directory was claimed for (its signed manifest, verified), if any.
///
/// ```
/// let dir = std::env::temp_dir().join("starling-doc-unclaimed-checkpoint");
/// assert!(starling_run::checkpoint::saved_manifest(&dir)?.is_none());
/// # Ok::<(), anyhow::Error>(())
/// ```
pub fn saved_manifest(dir: &Path) -> Result<Option<(RunManifest, SignedManifest)>> {
    let path = dir.join(CHECKPOINT_MANIFEST);
    let Some(signed) = read_signed(&path)? else {
        return Ok(None);
    };
    let (manifest, _) = signed
        .verify()
        .with_context(|| format!("verifying {}", path.display()))?;
    Ok(Some((manifest, signed)))
}

/// Checks that a checkpoint directory belongs to this run (`signed`): whether it holds a
/// checkpoint to resume from. A directory of another run is an error; an unclaimed one is
/// `false` (see [`claim`]).
pub fn check_checkpoint_dir(dir: &Path, signed: &SignedManifest) -> Result<bool> {
    let Some(theirs) = read_signed(&dir.join(CHECKPOINT_MANIFEST))? else {
        return Ok(false);
    };
    anyhow::ensure!(
        theirs.manifest == signed.manifest && theirs.creator == signed.creator,
        "--checkpoint-dir {} holds a checkpoint of another run (or another manifest of it): use another directory",
        dir.display()
    );
    Ok(dir.join("checkpoint.json").exists())
}

/// Claims `dir` for the run `signed` (creating it): its checkpoints are that run's from now on.
pub fn claim(dir: &Path, signed: &SignedManifest) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    std::fs::write(dir.join(CHECKPOINT_MANIFEST), signed.to_json())?;
    Ok(())
}

/// The signed manifest at `path`, unverified (`None` when there is no such file).
fn read_signed(path: &Path) -> Result<Option<SignedManifest>> {
    match std::fs::read(path) {
        Ok(bytes) => SignedManifest::from_json(&bytes)
            .map(Some)
            .with_context(|| format!("reading {}", path.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
    }
}
