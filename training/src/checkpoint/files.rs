//! The file side of checkpoints: atomic writes, content hashes, and parsing with every check.

use std::borrow::Cow;
use std::fs::{self, File};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensorError, SafeTensors, View};

use super::{check_meta, expected_keys, CheckpointError, CheckpointMeta, META_FILE};

/// `checkpoint.json` larger than this is refused before it is read.
const MAX_META_BYTES: u64 = 64 << 20;

/// safetensors refuses headers above 100 MB; with the 8-byte length that bounds the overhead.
const MAX_HEADER_BYTES: u64 = 100_000_000 + 8;

/// Name of the tensors file while it is written.
const PARTIAL_TENSORS: &str = "tensors.safetensors.partial";

/// What [`write_tensors`] produced.
pub(super) struct Written {
    pub(super) file_name: String,
    pub(super) bytes: u64,
    pub(super) hash: u64,
}

/// A borrowed `f32` tensor for safetensors.
struct F32View<'a> {
    shape: Vec<usize>,
    data: &'a [f32],
}

impl View for F32View<'_> {
    fn dtype(&self) -> Dtype {
        Dtype::F32
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        if cfg!(target_endian = "little") {
            Cow::Borrowed(bytemuck::cast_slice(self.data))
        } else {
            Cow::Owned(self.data.iter().flat_map(|v| v.to_le_bytes()).collect())
        }
    }

    fn data_len(&self) -> usize {
        self.data.len() * 4
    }
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn st_err(path: &Path) -> impl FnOnce(SafeTensorError) -> CheckpointError + '_ {
    move |source| match source {
        SafeTensorError::IoError(source) => CheckpointError::Io {
            path: path.to_path_buf(),
            source,
        },
        source => CheckpointError::Safetensors {
            path: path.to_path_buf(),
            source,
        },
    }
}

/// Writes the tensors to a new, synced file named after the epoch and the content hash.
pub(super) fn write_tensors(
    dir: &Path,
    epoch: u64,
    tensors: Vec<(String, &[usize], &[f32])>,
) -> Result<Written, CheckpointError> {
    fs::create_dir_all(dir).map_err(io_err(dir))?;
    let partial = dir.join(PARTIAL_TENSORS);
    let views = tensors.into_iter().map(|(key, shape, data)| {
        let view = F32View {
            shape: shape.to_vec(),
            data,
        };
        (key, view)
    });
    safetensors::serialize_to_file(views, None, &partial).map_err(st_err(&partial))?;
    let (bytes, hash) = hash_and_sync(&partial)?;
    let file_name = format!("tensors-{epoch}-{hash:016x}.safetensors");
    let path = dir.join(&file_name);
    fs::rename(&partial, &path).map_err(io_err(&path))?;
    sync_dir(dir)?;
    Ok(Written {
        file_name,
        bytes,
        hash,
    })
}

/// Replaces `checkpoint.json` atomically, then removes tensors files it no longer names.
pub(super) fn write_meta(dir: &Path, meta: &CheckpointMeta) -> Result<(), CheckpointError> {
    let path = dir.join(META_FILE);
    let partial = dir.join(format!("{META_FILE}.partial"));
    let json = serde_json::to_vec_pretty(meta).map_err(|e| CheckpointError::Format {
        path: path.clone(),
        detail: format!("cannot encode metadata: {e}"),
    })?;
    {
        let mut file = File::create(&partial).map_err(io_err(&partial))?;
        file.write_all(&json).map_err(io_err(&partial))?;
        file.sync_all().map_err(io_err(&partial))?;
    }
    fs::rename(&partial, &path).map_err(io_err(&path))?;
    sync_dir(dir)?;
    remove_stale(dir, &meta.tensors_file);
    Ok(())
}

/// Best effort: older tensors files are garbage once `checkpoint.json` names a new one.
fn remove_stale(dir: &Path, keep: &str) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if name != keep && name.starts_with("tensors-") && name.ends_with(".safetensors") {
            if let Err(e) = fs::remove_file(entry.path()) {
                tracing::warn!(file = %entry.path().display(), error = %e, "cannot remove an old checkpoint tensors file");
            }
        }
    }
}

#[cfg(unix)]
fn sync_dir(dir: &Path) -> Result<(), CheckpointError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_err(dir))
}

#[cfg(not(unix))]
fn sync_dir(_dir: &Path) -> Result<(), CheckpointError> {
    Ok(())
}

/// Reads back a written file: its length and content hash; then syncs it to disk.
fn hash_and_sync(path: &Path) -> Result<(u64, u64), CheckpointError> {
    let mut file = File::open(path).map_err(io_err(path))?;
    let mut hasher = ContentHash::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).map_err(io_err(path))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    file.sync_all().map_err(io_err(path))?;
    Ok((hasher.total, hasher.finish()))
}

/// Reads and checks `dir/checkpoint.json`: format, version, and that its fields agree.
///
/// ```
/// use starling_training::{checkpoint::read_meta, state::StateView, ParamSet};
/// let dir = tempfile::tempdir().unwrap();
/// let mut params = ParamSet::new();
/// params.add("w", &[2], &[1.0, 2.0])?;
/// StateView::new(4, &params).save(dir.path())?;
/// let meta = read_meta(dir.path())?;
/// assert_eq!((meta.epoch, meta.schema[0].name.as_str()), (4, "w"));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn read_meta(dir: impl AsRef<Path>) -> Result<CheckpointMeta, CheckpointError> {
    let path = dir.as_ref().join(META_FILE);
    let format_err = |detail: String| CheckpointError::Format {
        path: path.clone(),
        detail,
    };
    let size = fs::metadata(&path).map_err(io_err(&path))?.len();
    if size > MAX_META_BYTES {
        return Err(format_err(format!(
            "{size} bytes, more than the {MAX_META_BYTES} a checkpoint's metadata may have"
        )));
    }
    let text = fs::read_to_string(&path).map_err(io_err(&path))?;
    let value: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| format_err(format!("not JSON: {e}")))?;
    // Say "wrong format" or "wrong version" before any field-level complaint.
    let format = value.get("format").and_then(|f| f.as_str());
    if format != Some(super::FORMAT) {
        return Err(format_err(format!(
            "format is {format:?}, expected {:?}",
            super::FORMAT
        )));
    }
    let version = value.get("version").and_then(|v| v.as_u64());
    if version != Some(u64::from(super::FORMAT_VERSION)) {
        return Err(format_err(format!(
            "format version {version:?} is not supported (this build reads version {})",
            super::FORMAT_VERSION
        )));
    }
    let meta: CheckpointMeta = serde_json::from_value(value)
        .map_err(|e| format_err(format!("malformed metadata: {e}")))?;
    check_meta(&meta).map_err(format_err)?;
    if !is_plain_file_name(&meta.tensors_file) {
        return Err(format_err(format!(
            "tensors_file {:?} is not a plain file name",
            meta.tensors_file
        )));
    }
    Ok(meta)
}

/// A name without directories, `..` or hidden-file dot: the metadata may come from a peer.
fn is_plain_file_name(name: &str) -> bool {
    !name.is_empty()
        && !name.starts_with('.')
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_'))
}

/// Reads the tensors file after checking its size against the metadata, then its content hash.
pub(super) fn read_tensors(
    dir: &Path,
    meta: &CheckpointMeta,
    len: usize,
) -> Result<Vec<u8>, CheckpointError> {
    let path = dir.join(&meta.tensors_file);
    // One value per parameter in the parameters, each optimizer state and each buffer.
    let groups = 1
        + meta.buffers.len()
        + meta
            .optimizers
            .values()
            .map(|o| o.state.len())
            .sum::<usize>();
    let data = (len as u64).saturating_mul(4).saturating_mul(groups as u64);
    if meta.tensors_bytes < data.saturating_add(8)
        || meta.tensors_bytes > data.saturating_add(MAX_HEADER_BYTES)
    {
        return Err(CheckpointError::Format {
            path: dir.join(META_FILE),
            detail: format!(
                "tensors_bytes {} cannot hold {data} bytes of tensors plus a header",
                meta.tensors_bytes
            ),
        });
    }
    let corrupt = |detail: String| CheckpointError::Corrupt {
        path: path.clone(),
        detail,
    };
    let size = fs::metadata(&path).map_err(io_err(&path))?.len();
    if size != meta.tensors_bytes {
        return Err(corrupt(format!(
            "{size} bytes, checkpoint.json says {}",
            meta.tensors_bytes
        )));
    }
    let bytes = fs::read(&path).map_err(io_err(&path))?;
    if bytes.len() as u64 != meta.tensors_bytes {
        return Err(corrupt(format!(
            "{} bytes read, checkpoint.json says {}",
            bytes.len(),
            meta.tensors_bytes
        )));
    }
    let mut hasher = ContentHash::new();
    hasher.update(&bytes);
    let hash = format!("{:016x}", hasher.finish());
    if hash != meta.tensors_hash {
        return Err(corrupt(format!(
            "content hash {hash}, checkpoint.json says {}",
            meta.tensors_hash
        )));
    }
    Ok(bytes)
}

/// Parses the tensors file and checks that it holds exactly the tensors the metadata describes,
/// each `f32` with its schema shape.
pub(super) fn parse_tensors<'b>(
    dir: &Path,
    meta: &CheckpointMeta,
    bytes: &'b [u8],
) -> Result<SafeTensors<'b>, CheckpointError> {
    let path: PathBuf = dir.join(&meta.tensors_file);
    let tensors = SafeTensors::deserialize(bytes).map_err(st_err(&path))?;
    let expected = expected_keys(meta);
    for (key, &shape) in &expected {
        let bad = |detail: String| CheckpointError::BadTensor {
            key: key.clone(),
            detail,
        };
        let view = tensors
            .tensor(key)
            .map_err(|_| bad("missing".to_string()))?;
        if view.dtype() != Dtype::F32 {
            return Err(bad(format!("dtype {:?}, expected F32", view.dtype())));
        }
        if view.shape() != shape {
            return Err(bad(format!(
                "shape {:?}, but checkpoint.json gives the tensor shape {shape:?}",
                view.shape()
            )));
        }
    }
    if let Some(extra) = tensors
        .names()
        .into_iter()
        .find(|k| !expected.contains_key(*k))
    {
        return Err(CheckpointError::BadTensor {
            key: extra.to_string(),
            detail: "not described by checkpoint.json".to_string(),
        });
    }
    Ok(tensors)
}

/// Decodes a checked tensor into `out`.
pub(super) fn copy_tensor(
    tensors: &SafeTensors<'_>,
    key: &str,
    out: &mut [f32],
) -> Result<(), CheckpointError> {
    let view = tensors
        .tensor(key)
        .map_err(|e| CheckpointError::BadTensor {
            key: key.to_string(),
            detail: e.to_string(),
        })?;
    let data = view.data();
    if data.len() != out.len() * 4 {
        return Err(CheckpointError::BadTensor {
            key: key.to_string(),
            detail: format!("{} bytes for {} values", data.len(), out.len()),
        });
    }
    for (v, b) in out.iter_mut().zip(data.chunks_exact(4)) {
        *v = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    }
    Ok(())
}

/// FNV-1a over little-endian 64-bit words (the tail zero-padded), then the byte length: eight times
/// faster than byte-wise FNV, and any change confined to one word always changes the result
/// (each step is a bijection of the state). A check against damage, not against forgery.
pub(super) struct ContentHash {
    state: u64,
    pending: [u8; 8],
    pending_len: usize,
    total: u64,
}

impl ContentHash {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;

    pub(super) fn new() -> Self {
        Self {
            state: Self::OFFSET,
            pending: [0; 8],
            pending_len: 0,
            total: 0,
        }
    }

    fn mix(&mut self, word: u64) {
        self.state = (self.state ^ word).wrapping_mul(Self::PRIME);
    }

    pub(super) fn update(&mut self, mut bytes: &[u8]) {
        self.total += bytes.len() as u64;
        if self.pending_len > 0 {
            let take = (8 - self.pending_len).min(bytes.len());
            self.pending[self.pending_len..self.pending_len + take].copy_from_slice(&bytes[..take]);
            self.pending_len += take;
            bytes = &bytes[take..];
            if self.pending_len < 8 {
                return;
            }
            self.mix(u64::from_le_bytes(self.pending));
            self.pending_len = 0;
        }
        let mut words = bytes.chunks_exact(8);
        for w in &mut words {
            let mut word = [0u8; 8];
            word.copy_from_slice(w);
            self.mix(u64::from_le_bytes(word));
        }
        let rest = words.remainder();
        self.pending[..rest.len()].copy_from_slice(rest);
        self.pending_len = rest.len();
    }

    pub(super) fn finish(mut self) -> u64 {
        if self.pending_len > 0 {
            self.pending[self.pending_len..].fill(0);
            self.mix(u64::from_le_bytes(self.pending));
        }
        let total = self.total;
        self.mix(total);
        self.state
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_hash_does_not_depend_on_chunking() {
        let data: Vec<u8> = (0..1000u32).map(|i| (i * 7 + i / 13) as u8).collect();
        let mut whole = ContentHash::new();
        whole.update(&data);
        let want = whole.finish();
        for split in [1usize, 3, 7, 8, 9, 64, 999] {
            let mut h = ContentHash::new();
            for chunk in data.chunks(split) {
                h.update(chunk);
            }
            assert_eq!(h.finish(), want, "chunks of {split}");
        }
        // Every single-bit flip is seen, and so is a zero byte appended.
        for i in (0..data.len()).step_by(37) {
            let mut flipped = data.clone();
            flipped[i] ^= 1 << (i % 8);
            let mut h = ContentHash::new();
            h.update(&flipped);
            assert_ne!(h.finish(), want);
        }
        let mut longer = data.clone();
        longer.push(0);
        let mut h = ContentHash::new();
        h.update(&longer);
        assert_ne!(h.finish(), want);
    }

    #[test]
    fn plain_file_names_only() {
        assert!(is_plain_file_name("tensors-3-00ff.safetensors"));
        for bad in ["", "../x", "a/b", ".hidden", "/abs", "a\\b", "..", "x y"] {
            assert!(!is_plain_file_name(bad), "{bad:?}");
        }
    }
}
