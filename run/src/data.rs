//! The data a built-in model trains on: the embedded digits, IDX files (MNIST's format, gzip or
//! not), or a UTF-8 text file. Every reader checks sizes before it allocates and names what is
//! wrong with a file.

use std::collections::BTreeSet;
use std::fs::File;
use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, ensure, Context, Result};
use rand::{rngs::StdRng, seq::SliceRandom, SeedableRng};

use crate::manifest::DataSpec;

/// Largest file read, in bytes (after decompression).
const MAX_FILE_BYTES: u64 = 1 << 31;
/// Seed of the digits' fixed train/test shuffle (the same split on every peer).
const DIGITS_SPLIT_SEED: u64 = 20_240_601;

/// Labelled images, pixels scaled to [0, 1].
#[derive(Debug, Clone)]
pub struct Images {
    /// Values per image.
    pub inputs: usize,
    /// Label classes.
    pub classes: usize,
    /// Training images, `inputs` pixels each, as stored (one byte a pixel, a quarter of the
    /// memory of f32 values; [`Images::value`] gives a pixel's value in [0, 1]).
    pub train_x: Pixels,
    /// Training labels.
    pub train_y: Vec<u32>,
    /// Test images, as stored.
    pub test_x: Pixels,
    /// What a stored pixel is divided by for its value: 255 for IDX files, 16 for the digits.
    pub levels: f32,
    /// Test labels.
    pub test_y: Vec<u32>,
}

/// Stored pixels, one byte each: read into memory, or mapped from an uncompressed IDX file
/// ([`read_idx_images`]). Dereferences to the bytes.
///
/// ```
/// use starling_run::data::Pixels;
/// let p = Pixels::from(vec![0u8, 128, 255]);
/// assert_eq!(&p[1..], &[128, 255]);
/// assert!(!p.is_mapped());
/// ```
#[derive(Clone)]
pub struct Pixels(Stored);

#[derive(Clone)]
enum Stored {
    Owned(Vec<u8>),
    /// `len` bytes from `start` of a read-only mapping of the file.
    Mapped {
        map: Arc<memmap2::Mmap>,
        start: usize,
        len: usize,
    },
}

impl Pixels {
    /// Whether the bytes are the file's pages, mapped (not a copy in memory).
    pub fn is_mapped(&self) -> bool {
        matches!(self.0, Stored::Mapped { .. })
    }

    /// The bytes of `range`: a narrower view of the same mapping when mapped (no copy), a copy
    /// otherwise. Panics, like slicing, when `range` is out of bounds.
    ///
    /// ```
    /// use starling_run::data::Pixels;
    /// let p = Pixels::from(vec![1u8, 2, 3, 4]);
    /// assert_eq!(&p.slice(1..3)[..], &[2, 3]);
    /// ```
    pub fn slice(&self, range: std::ops::Range<usize>) -> Pixels {
        match &self.0 {
            Stored::Owned(v) => Pixels::from(v[range].to_vec()),
            Stored::Mapped { map, start, len } => {
                assert!(
                    range.start <= range.end && range.end <= *len,
                    "range {range:?} out of {len} bytes"
                );
                Pixels(Stored::Mapped {
                    map: map.clone(),
                    start: start + range.start,
                    len: range.len(),
                })
            }
        }
    }
}

impl From<Vec<u8>> for Pixels {
    fn from(v: Vec<u8>) -> Self {
        Pixels(Stored::Owned(v))
    }
}

impl std::ops::Deref for Pixels {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match &self.0 {
            Stored::Owned(v) => v,
            Stored::Mapped { map, start, len } => &map[*start..*start + *len],
        }
    }
}

impl PartialEq for Pixels {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl std::fmt::Debug for Pixels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let how = if self.is_mapped() {
            "mapped"
        } else {
            "in memory"
        };
        write!(f, "Pixels({} bytes, {how})", self.len())
    }
}

impl Images {
    /// Training images.
    pub fn train_len(&self) -> usize {
        self.train_y.len()
    }

    /// A stored pixel's value, in [0, 1].
    #[inline]
    pub fn value(&self, pixel: u8) -> f32 {
        f32::from(pixel) / self.levels
    }

    /// Stored pixels' values, in [0, 1].
    ///
    /// ```
    /// let d = starling_run::data::digits();
    /// let first = d.values(&d.train_x[..d.inputs]);
    /// assert!(first.iter().all(|v| (0.0..=1.0).contains(v)));
    /// ```
    pub fn values(&self, pixels: &[u8]) -> Vec<f32> {
        pixels.iter().map(|&p| self.value(p)).collect()
    }

    /// Checks that images and labels agree in number and neither part is empty.
    fn check(&self) -> Result<()> {
        ensure!(
            self.train_x.len() == self.train_y.len() * self.inputs
                && self.test_x.len() == self.test_y.len() * self.inputs,
            "internal: image and label counts differ"
        );
        ensure!(!self.train_y.is_empty(), "no training images");
        ensure!(!self.test_y.is_empty(), "no test images");
        Ok(())
    }
}

/// A text as token ids over a vocabulary, split into training and validation parts.
#[derive(Debug, Clone)]
pub struct Text {
    /// The characters, in token order.
    pub vocab: Vec<char>,
    /// Training tokens (the first 90%).
    pub train: Vec<u32>,
    /// Validation tokens (the last 10%).
    pub val: Vec<u32>,
}

impl Text {
    /// The training part's unigram entropy in nats per character: the loss of a model that
    /// knows only character frequencies (what a language model must beat).
    pub fn unigram_entropy(&self) -> f64 {
        let mut counts = vec![0u64; self.vocab.len()];
        for &t in &self.train {
            counts[t as usize] += 1;
        }
        let n = self.train.len() as f64;
        counts
            .iter()
            .filter(|&&c| c > 0)
            .map(|&c| {
                let p = c as f64 / n;
                -p * p.ln()
            })
            .sum()
    }

    /// The training part's bigram entropy in nats per character, H(next | current): the loss of
    /// a model that sees only the previous character. A language model that beats it uses more
    /// context than one character (a trained output head alone cannot).
    pub fn bigram_entropy(&self) -> f64 {
        let v = self.vocab.len();
        let mut pairs = vec![0u64; v * v];
        let mut firsts = vec![0u64; v];
        for w in self.train.windows(2) {
            pairs[w[0] as usize * v + w[1] as usize] += 1;
            firsts[w[0] as usize] += 1;
        }
        let n = self.train.len().saturating_sub(1).max(1) as f64;
        pairs
            .iter()
            .enumerate()
            .filter(|&(_, &c)| c > 0)
            .map(|(i, &c)| {
                let p_pair = c as f64 / n;
                let p_next = c as f64 / firsts[i / v] as f64;
                -p_pair * p_next.ln()
            })
            .sum()
    }
}

/// What a peer trains on, loaded for a run's [`DataSpec`].
#[derive(Debug, Clone)]
pub enum Dataset {
    /// Images for the `mlp`.
    Images(Images),
    /// Text for the `charlm`.
    Text(Text),
}

/// The 1797 embedded 8x8 digits (scikit-learn's, through smartcore), scaled to [0, 1], split
/// 80/20 with a fixed shuffle.
pub fn digits() -> Images {
    let d = smartcore::dataset::digits::load_dataset();
    let inputs = d.num_features;
    let mut order: Vec<usize> = (0..d.num_samples).collect();
    order.shuffle(&mut StdRng::seed_from_u64(DIGITS_SPLIT_SEED));
    let n_train = d.num_samples * 4 / 5;
    let take = |idx: &[usize]| {
        // The digits are whole numbers 0..=16: a byte holds each exactly.
        let x: Vec<u8> = idx
            .iter()
            .flat_map(|&i| {
                d.data[i * inputs..(i + 1) * inputs]
                    .iter()
                    .map(|v| v.clamp(0.0, 16.0).round() as u8)
            })
            .collect();
        let y = idx.iter().map(|&i| d.target[i] as u32).collect();
        (Pixels::from(x), y)
    };
    let (train_x, train_y) = take(&order[..n_train]);
    let (test_x, test_y) = take(&order[n_train..]);
    Images {
        inputs,
        classes: 10,
        train_x,
        train_y,
        test_x,
        test_y,
        levels: 16.0,
    }
}

/// An IDX directory being read on a blocking thread before the run's [`DataSpec`] is known: a
/// joiner reads its run's manifest from the network meanwhile, and [`load_prefetched`] takes
/// the images from here. A glyphs MLP joiner (55 MB of IDX files) read them for 60-90 ms after
/// its manifest arrived, while its partner trained alone.
pub struct Prefetch(Option<tokio::task::JoinHandle<Result<Images>>>);

impl Prefetch {
    /// Starts reading `data` if it is a directory (IDX files); otherwise nothing is read ahead
    /// (a text file is read once the run's vocabulary is known). Call within a Tokio runtime.
    ///
    /// ```no_run
    /// # async fn demo() -> anyhow::Result<()> {
    /// use starling_run::{data::{load_prefetched, Prefetch}, manifest::DataSpec};
    /// let dir = std::path::Path::new("mnist");
    /// let ahead = Prefetch::start(Some(dir));
    /// // ... the run's manifest is fetched meanwhile ...
    /// let spec = DataSpec::Idx { rows: 28, cols: 28, classes: 10 };
    /// let data = load_prefetched(&spec, Some(dir), ahead).await?;
    /// # let _ = data; Ok(()) }
    /// ```
    pub fn start(data: Option<&Path>) -> Prefetch {
        Prefetch(data.filter(|d| d.is_dir()).map(|dir| {
            let dir = dir.to_path_buf();
            tokio::task::spawn_blocking(move || read_idx_dir(&dir))
        }))
    }
}

/// [`load`], with an IDX directory's images taken from `ahead` when it read them (its error,
/// if the read failed: the same as [`load`]'s). What `ahead` read for a run that does not
/// train on IDX files is dropped, and the error is [`load`]'s.
pub async fn load_prefetched(
    spec: &DataSpec,
    data: Option<&Path>,
    ahead: Prefetch,
) -> Result<Dataset> {
    match (spec, ahead.0) {
        (
            &DataSpec::Idx {
                rows,
                cols,
                classes,
            },
            Some(reading),
        ) => {
            let dir = idx_dir(data)?;
            let images = reading.await.context("reading the IDX files")??;
            check_idx(dir, images, (rows, cols), classes)
        }
        _ => load(spec, data),
    }
}

/// Loads what `spec` names: the digits, the IDX files in `data` (checked against the run's
/// image size and classes when the run has them), or the text file `data` mapped onto the
/// run's vocabulary.
pub fn load(spec: &DataSpec, data: Option<&Path>) -> Result<Dataset> {
    match spec {
        DataSpec::Digits => {
            if let Some(p) = data {
                bail!(
                    "this run trains on the embedded digits; --data {} is not used by it",
                    p.display()
                );
            }
            Ok(Dataset::Images(digits()))
        }
        &DataSpec::Idx {
            rows,
            cols,
            classes,
        } => {
            let dir = idx_dir(data)?;
            check_idx(dir, read_idx_dir(dir)?, (rows, cols), classes)
        }
        DataSpec::Text { vocab } => {
            let file = data.context("this run trains on text: give --data FILE")?;
            let vocab: Vec<char> = vocab.chars().collect();
            Ok(Dataset::Text(read_text(file, Some(&vocab))?))
        }
    }
}

/// The `--data` directory of a run that trains on IDX files.
fn idx_dir(data: Option<&Path>) -> Result<&Path> {
    data.context("this run trains on IDX files: give --data DIR")
}

/// IDX images read from `dir`, checked against the run's image size and classes.
fn check_idx(
    dir: &Path,
    images: Images,
    (rows, cols): (usize, usize),
    classes: usize,
) -> Result<Dataset> {
    ensure!(
        images.inputs == rows * cols,
        "{}: images of {} values, but the run's are {rows}x{cols}",
        dir.display(),
        images.inputs
    );
    let max = images.train_y.iter().chain(&images.test_y).max().copied();
    ensure!(
        max.is_none_or(|m| (m as usize) < classes),
        "{}: label {} but the run has {classes} classes",
        dir.display(),
        max.unwrap_or(0)
    );
    Ok(Dataset::Images(Images { classes, ..images }))
}

/// The file `dir/{stem}` or `dir/{stem}.gz`, if either exists.
fn find(dir: &Path, stem: &str) -> Option<PathBuf> {
    [dir.join(stem), dir.join(format!("{stem}.gz"))]
        .into_iter()
        .find(|p| p.is_file())
}

/// Reads MNIST-style IDX files from `dir`: `train-images-idx3-ubyte` and
/// `train-labels-idx1-ubyte` (each optionally `.gz`), and `t10k-*` of the same kinds as the
/// test set when present (otherwise the last fifth of the training files).
pub fn read_idx_dir(dir: &Path) -> Result<Images> {
    ensure!(
        dir.is_dir(),
        "--data {}: not a directory of IDX files",
        dir.display()
    );
    let need = |stem: &str| {
        find(dir, stem).with_context(|| {
            format!(
                "--data {}: no {stem} (or {stem}.gz); an IDX directory holds train-images-idx3-ubyte and train-labels-idx1-ubyte, and optionally the t10k-* test files",
                dir.display()
            )
        })
    };
    let (train_x, inputs) = read_idx_images(&need("train-images-idx3-ubyte")?)?;
    let train_y = read_idx_labels(&need("train-labels-idx1-ubyte")?)?;
    ensure!(
        train_x.len() / inputs == train_y.len(),
        "--data {}: {} training images but {} labels",
        dir.display(),
        train_x.len() / inputs,
        train_y.len()
    );
    let test = (
        find(dir, "t10k-images-idx3-ubyte"),
        find(dir, "t10k-labels-idx1-ubyte"),
    );
    let (train_x, train_y, test_x, test_y) = match test {
        (Some(xi), Some(yi)) => {
            let (test_x, test_inputs) = read_idx_images(&xi)?;
            let test_y = read_idx_labels(&yi)?;
            ensure!(
                test_inputs == inputs,
                "--data {}: test images have {test_inputs} values, training images {inputs}",
                dir.display()
            );
            ensure!(
                test_x.len() / inputs == test_y.len(),
                "--data {}: {} test images but {} labels",
                dir.display(),
                test_x.len() / inputs,
                test_y.len()
            );
            (train_x, train_y, test_x, test_y)
        }
        (None, None) => {
            let n = train_y.len();
            ensure!(
                n >= 5,
                "--data {}: too few images to split off a test set",
                dir.display()
            );
            let cut = n - n / 5;
            (
                train_x.slice(0..cut * inputs),
                train_y[..cut].to_vec(),
                train_x.slice(cut * inputs..n * inputs),
                train_y[cut..].to_vec(),
            )
        }
        _ => bail!(
            "--data {}: give both t10k-images-idx3-ubyte and t10k-labels-idx1-ubyte, or neither",
            dir.display()
        ),
    };
    let classes = train_y
        .iter()
        .chain(&test_y)
        .max()
        .map_or(0, |m| *m as usize + 1);
    let images = Images {
        inputs,
        classes: classes.max(2),
        train_x,
        train_y,
        test_x,
        test_y,
        levels: 255.0,
    };
    images.check()?;
    Ok(images)
}

/// Whether a file starts with gzip's magic bytes.
fn gzipped(path: &Path) -> Result<bool> {
    let mut f = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut magic = [0u8; 2];
    let n = f.read(&mut magic)?;
    Ok(n == 2 && magic == [0x1f, 0x8b])
}

/// Opens a file, through gzip when it starts with gzip's magic bytes.
fn open(path: &Path) -> Result<Box<dyn Read>> {
    open_as(path, gzipped(path)?)
}

/// Opens a file, through gzip when `gz` (what [`gzipped`] found).
fn open_as(path: &Path, gz: bool) -> Result<Box<dyn Read>> {
    let f = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    if gz {
        Ok(Box::new(flate2::read::GzDecoder::new(BufReader::new(f))))
    } else {
        Ok(Box::new(BufReader::new(f)))
    }
}

/// Reads an IDX header: the element type must be unsigned bytes (0x08) and the dimension count
/// `dims`. Returns the sizes.
fn idx_header(r: &mut dyn Read, path: &Path, dims: u8, what: &str) -> Result<Vec<usize>> {
    let mut head = [0u8; 4];
    r.read_exact(&mut head)
        .with_context(|| format!("{}: too short for an IDX file", path.display()))?;
    ensure!(
        head[0] == 0 && head[1] == 0 && head[2] == 0x08 && head[3] == dims,
        "{}: not an IDX {what} file (magic {:02x}{:02x}{:02x}{:02x}, expected 000008{dims:02x})",
        path.display(),
        head[0],
        head[1],
        head[2],
        head[3]
    );
    let mut sizes = Vec::new();
    for _ in 0..dims {
        let mut b = [0u8; 4];
        r.read_exact(&mut b)
            .with_context(|| format!("{}: truncated IDX header", path.display()))?;
        sizes.push(u32::from_be_bytes(b) as usize);
    }
    Ok(sizes)
}

/// Refuses a header that declares more than [`MAX_FILE_BYTES`] of data.
fn check_declared(path: &Path, n: u64) -> Result<()> {
    ensure!(
        n <= MAX_FILE_BYTES,
        "{}: the header declares {n} bytes of data, more than the {MAX_FILE_BYTES} accepted",
        path.display()
    );
    Ok(())
}

/// Reads exactly `n` bytes (refusing larger than [`MAX_FILE_BYTES`]), then checks that nothing
/// follows.
fn body(mut r: Box<dyn Read>, path: &Path, n: u64) -> Result<Vec<u8>> {
    check_declared(path, n)?;
    let mut data = Vec::with_capacity(n as usize);
    (&mut r).take(n).read_to_end(&mut data)?;
    ensure!(
        data.len() as u64 == n,
        "{}: the header declares {n} bytes of data but the file holds {}",
        path.display(),
        data.len()
    );
    let mut extra = [0u8; 1];
    ensure!(
        r.read(&mut extra)? == 0,
        "{}: data continues past what the header declares",
        path.display()
    );
    Ok(data)
}

/// An IDX image file (3 dimensions: count, rows, columns): its pixels as stored, and the pixels
/// per image. An uncompressed file is mapped rather than read ([`Pixels::is_mapped`]): reading
/// copied the images into fresh memory, which the kernel zeroes page by page first (the glyphs
/// set's 47 MB took 50-60 ms of a peer's start, most of it zeroing), and each peer on a machine
/// held its own copy. Mapped, the pages are the page cache's, shared by every peer that maps
/// the file, and faulted in together at start (no page faults while training). A file that
/// cannot be mapped is read as before. Like any mapped file, it must not be truncated while a
/// run uses it (the process would be killed by `SIGBUS`); replacing it (a new file under the
/// name) is safe.
pub fn read_idx_images(path: &Path) -> Result<(Pixels, usize)> {
    let gz = gzipped(path)?;
    if !gz {
        if let Some(map) = map_file(path)? {
            return mapped_images(path, map);
        }
    }
    let mut r = open_as(path, gz)?;
    let sizes = idx_header(&mut r, path, 3, "image")?;
    let (inputs, n) = image_shape(path, &sizes)?;
    Ok((body(r, path, n)?.into(), inputs))
}

/// Pixels per image and bytes of data that an image file's header `sizes` declare.
fn image_shape(path: &Path, sizes: &[usize]) -> Result<(usize, u64)> {
    let inputs = sizes[1] * sizes[2];
    ensure!(inputs > 0, "{}: images of size 0", path.display());
    Ok((inputs, (sizes[0] as u64).saturating_mul(inputs as u64)))
}

/// The whole file mapped read-only and faulted in (see [`read_idx_images`]); `None` when it
/// cannot be mapped (it is read instead).
fn map_file(path: &Path) -> Result<Option<memmap2::Mmap>> {
    let file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    // SAFETY: a read-only mapping of a regular file we opened; the bytes are only read through
    // it, and it lives as long as the `Pixels` that hold it. What no Rust code can rule out is
    // another process truncating the file meanwhile (then reads past its new end raise SIGBUS):
    // `read_idx_images` documents it.
    match unsafe { memmap2::MmapOptions::new().populate().map(&file) } {
        Ok(map) => Ok(Some(map)),
        Err(e) => {
            tracing::debug!("{}: not mapped ({e}); reading it", path.display());
            Ok(None)
        }
    }
}

/// An image file's pixels as a view of its mapping: its header and sizes checked as they are
/// when the file is read ([`idx_header`], [`body`]).
fn mapped_images(path: &Path, map: memmap2::Mmap) -> Result<(Pixels, usize)> {
    let (inputs, n, start) = {
        let mut rest = &map[..];
        let sizes = idx_header(&mut rest, path, 3, "image")?;
        let (inputs, n) = image_shape(path, &sizes)?;
        check_declared(path, n)?;
        let holds = rest.len() as u64;
        ensure!(
            holds >= n,
            "{}: the header declares {n} bytes of data but the file holds {holds}",
            path.display()
        );
        ensure!(
            holds == n,
            "{}: data continues past what the header declares",
            path.display()
        );
        (inputs, n as usize, map.len() - rest.len())
    };
    let map = Arc::new(map);
    Ok((Pixels(Stored::Mapped { map, start, len: n }), inputs))
}

/// An IDX label file (1 dimension).
pub fn read_idx_labels(path: &Path) -> Result<Vec<u32>> {
    let mut r = open(path)?;
    let sizes = idx_header(&mut r, path, 1, "label")?;
    let bytes = body(r, path, sizes[0] as u64)?;
    Ok(bytes.into_iter().map(u32::from).collect())
}

#[cfg(test)]
/// Writes images and labels as IDX files (`{prefix}-images-idx3-ubyte`,
/// `{prefix}-labels-idx1-ubyte`); pixels in [0, 1] become bytes.
pub fn write_idx(
    dir: &Path,
    prefix: &str,
    x: &[f32],
    y: &[u32],
    rows: usize,
    cols: usize,
) -> Result<()> {
    let mut img = vec![0, 0, 8, 3];
    for d in [y.len(), rows, cols] {
        img.extend_from_slice(&(d as u32).to_be_bytes());
    }
    img.extend(x.iter().map(|v| (v.clamp(0.0, 1.0) * 255.0).round() as u8));
    let mut lab = vec![0, 0, 8, 1];
    lab.extend_from_slice(&(y.len() as u32).to_be_bytes());
    lab.extend(y.iter().map(|&l| l as u8));
    std::fs::write(dir.join(format!("{prefix}-images-idx3-ubyte")), img)?;
    std::fs::write(dir.join(format!("{prefix}-labels-idx1-ubyte")), lab)?;
    Ok(())
}

/// Reads a UTF-8 text file as tokens: over `vocab` when given (every character must be in it),
/// otherwise over the text's own sorted characters. The last tenth is the validation part.
pub fn read_text(path: &Path, vocab: Option<&[char]>) -> Result<Text> {
    let len = std::fs::metadata(path)
        .with_context(|| format!("--data {}", path.display()))?
        .len();
    ensure!(
        len <= MAX_FILE_BYTES,
        "--data {}: {len} bytes, more than the {MAX_FILE_BYTES} accepted",
        path.display()
    );
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let text = String::from_utf8(bytes).map_err(|e| {
        anyhow::anyhow!(
            "--data {}: not UTF-8 text (invalid byte at offset {})",
            path.display(),
            e.utf8_error().valid_up_to()
        )
    })?;
    let vocab: Vec<char> = match vocab {
        Some(v) => v.to_vec(),
        None => text
            .chars()
            .collect::<BTreeSet<char>>()
            .into_iter()
            .collect(),
    };
    let index: std::collections::HashMap<char, u32> = vocab
        .iter()
        .enumerate()
        .map(|(i, &c)| (c, i as u32))
        .collect();
    let mut tokens = Vec::with_capacity(text.len());
    let mut unknown = BTreeSet::new();
    for c in text.chars() {
        match index.get(&c) {
            Some(&t) => tokens.push(t),
            None => {
                unknown.insert(c);
            }
        }
    }
    ensure!(
        unknown.is_empty(),
        "--data {}: {} characters are not in the run's vocabulary (for example {:?})",
        path.display(),
        unknown.len(),
        unknown.iter().take(5).collect::<String>()
    );
    ensure!(
        tokens.len() >= 200,
        "--data {}: {} characters; a language model needs at least 200",
        path.display(),
        tokens.len()
    );
    let cut = tokens.len() - tokens.len() / 10;
    let val = tokens.split_off(cut);
    Ok(Text {
        vocab,
        train: tokens,
        val,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::Rng;

    #[test]
    fn digits_split_is_fixed_and_scaled() {
        let a = digits();
        let b = digits();
        assert_eq!(a.train_y, b.train_y);
        assert_eq!((a.inputs, a.classes), (64, 10));
        assert_eq!(a.train_len() + a.test_y.len(), 1797);
        let values = a.values(&a.train_x);
        assert!(values.iter().all(|v| (0.0..=1.0).contains(v)));
        assert!(values.iter().any(|v| *v > 0.5));
        // Every digit pixel is one of the 17 levels smartcore's floats hold.
        let raw = smartcore::dataset::digits::load_dataset().data;
        assert!(raw
            .iter()
            .all(|v| v.fract() == 0.0 && (0.0..=16.0).contains(v)));
    }

    #[tokio::test]
    async fn idx_files_read_ahead_load_as_without_and_other_runs_keep_their_errors() {
        let dir = tempfile::tempdir().unwrap();
        let d = digits();
        let x = d.values(&d.train_x);
        write_idx(dir.path(), "train", &x, &d.train_y, 8, 8).unwrap();
        let idx = |side| DataSpec::Idx {
            rows: side,
            cols: side,
            classes: 10,
        };
        let ahead = |spec: DataSpec| {
            let dir = dir.path().to_path_buf();
            async move {
                let read = Prefetch::start(Some(&dir));
                load_prefetched(&spec, Some(&dir), read).await
            }
        };
        let err = |r: Result<Dataset>| r.unwrap_err().to_string();
        let (Dataset::Images(a), Dataset::Images(b)) = (
            ahead(idx(8)).await.unwrap(),
            load(&idx(8), Some(dir.path())).unwrap(),
        ) else {
            panic!("images expected");
        };
        assert_eq!(
            (a.train_x, a.train_y, a.classes),
            (b.train_x, b.train_y, b.classes)
        );
        // Checked against the run as `load` checks: another image size.
        let e = err(ahead(idx(4)).await);
        assert!(e.contains("but the run's are 4x4"), "{e}");
        // A run on the embedded digits: what was read ahead is dropped, `load`'s error stands.
        let e = err(ahead(DataSpec::Digits).await);
        assert!(e.contains("is not used by it"), "{e}");
        // A read that failed: its error, as `load` gives it.
        std::fs::remove_file(dir.path().join("train-labels-idx1-ubyte")).unwrap();
        let e = err(ahead(idx(8)).await);
        assert!(e.contains("no train-labels-idx1-ubyte"), "{e}");
    }

    #[test]
    fn idx_files_round_trip_plain_and_gzipped_and_bad_ones_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let d = digits();
        let x = d.values(&d.train_x);
        write_idx(dir.path(), "train", &x, &d.train_y, 8, 8).unwrap();
        let back = read_idx_dir(dir.path()).unwrap();
        assert_eq!(back.inputs, 64);
        // No test files: both sets are views of the one mapping of the training images.
        assert!(back.train_x.is_mapped() && back.test_x.is_mapped());
        assert_eq!(back.train_len() + back.test_y.len(), d.train_len());
        assert!(back
            .values(&back.train_x)
            .iter()
            .zip(&x)
            .all(|(a, b)| (a - b).abs() <= 0.5 / 255.0 + 1e-6));

        // gzip the labels: read the same.
        let labels = dir.path().join("train-labels-idx1-ubyte");
        let raw = std::fs::read(&labels).unwrap();
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        std::io::Write::write_all(&mut gz, &raw).unwrap();
        std::fs::remove_file(&labels).unwrap();
        std::fs::write(
            dir.path().join("train-labels-idx1-ubyte.gz"),
            gz.finish().unwrap(),
        )
        .unwrap();
        assert_eq!(read_idx_dir(dir.path()).unwrap().train_y, back.train_y);

        // Inconsistent counts.
        write_idx(dir.path(), "train", &x[..64 * 10], &d.train_y[..10], 8, 8).unwrap();
        std::fs::remove_file(dir.path().join("train-labels-idx1-ubyte.gz")).unwrap();
        write_idx(dir.path(), "tmp", &x[..64 * 9], &d.train_y[..9], 8, 8).unwrap();
        std::fs::rename(
            dir.path().join("tmp-labels-idx1-ubyte"),
            dir.path().join("train-labels-idx1-ubyte"),
        )
        .unwrap();
        let err = read_idx_dir(dir.path()).unwrap_err().to_string();
        assert!(err.contains("10 training images but 9 labels"), "{err}");

        // A labels file where images belong.
        std::fs::copy(
            dir.path().join("train-labels-idx1-ubyte"),
            dir.path().join("train-images-idx3-ubyte"),
        )
        .unwrap();
        let err = read_idx_dir(dir.path()).unwrap_err().to_string();
        assert!(err.contains("not an IDX image file"), "{err}");

        // Truncated data.
        let img = dir.path().join("train-images-idx3-ubyte");
        write_idx(dir.path(), "train", &x[..64 * 10], &d.train_y[..10], 8, 8).unwrap();
        let bytes = std::fs::read(&img).unwrap();
        std::fs::write(&img, &bytes[..bytes.len() - 3]).unwrap();
        let err = read_idx_dir(dir.path()).unwrap_err().to_string();
        assert!(err.contains("declares 640 bytes"), "{err}");
    }

    /// An IDX image file of `count` images of `rows` x `cols` bytes, then `extra`.
    fn idx_image_bytes(count: u32, rows: u32, cols: u32, pixels: &[u8], extra: &[u8]) -> Vec<u8> {
        let mut f = vec![0, 0, 0x08, 3];
        for d in [count, rows, cols] {
            f.extend_from_slice(&d.to_be_bytes());
        }
        f.extend_from_slice(pixels);
        f.extend_from_slice(extra);
        f
    }

    fn gzip(bytes: &[u8]) -> Vec<u8> {
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        std::io::Write::write_all(&mut gz, bytes).unwrap();
        gz.finish().unwrap()
    }

    #[test]
    fn a_plain_image_file_is_mapped_a_gzipped_one_read_and_both_are_checked_alike() {
        let dir = tempfile::tempdir().unwrap();
        let mut rng = StdRng::seed_from_u64(7);
        let pixels: Vec<u8> = (0..37 * 5 * 3).map(|_| rng.gen()).collect();
        let file = idx_image_bytes(37, 5, 3, &pixels, &[]);
        let (plain, gz) = (dir.path().join("plain"), dir.path().join("packed"));
        std::fs::write(&plain, &file).unwrap();
        std::fs::write(&gz, gzip(&file)).unwrap();
        let (mapped, inputs) = read_idx_images(&plain).unwrap();
        assert!(mapped.is_mapped());
        assert_eq!((inputs, &mapped[..]), (15, &pixels[..]));
        let (read, inputs) = read_idx_images(&gz).unwrap();
        assert!(!read.is_mapped());
        assert_eq!((inputs, &read[..]), (15, &pixels[..]));
        assert_eq!(mapped, read);
        // A slice is a view of the same mapping.
        let view = mapped.slice(15..45);
        assert!(view.is_mapped());
        assert_eq!(&view[..], &pixels[15..45]);
        drop(view);
        // A clone shares the mapping and outlives the original.
        let copy = mapped.clone();
        drop(mapped);
        assert_eq!(&copy[..], &pixels[..]);
        // (Unmapped before the file is rewritten below: a mapped file must not shrink under
        // its readers.)
        drop(copy);

        // The same errors either way: data past what the header declares, too little data, a
        // header declaring more than is ever read.
        let cases: [(Vec<u8>, &str); 3] = [
            (
                idx_image_bytes(37, 5, 3, &pixels, &[9]),
                "data continues past what the header declares",
            ),
            (
                idx_image_bytes(37, 5, 3, &pixels[..pixels.len() - 4], &[]),
                "declares 555 bytes of data but the file holds 551",
            ),
            (
                idx_image_bytes(1 << 16, 1 << 8, 1 << 8, &pixels, &[]),
                "more than the",
            ),
        ];
        for (bytes, want) in cases {
            std::fs::write(&plain, &bytes).unwrap();
            std::fs::write(&gz, gzip(&bytes)).unwrap();
            for path in [&plain, &gz] {
                let err = read_idx_images(path).unwrap_err().to_string();
                assert!(err.contains(want), "{}: {err}", path.display());
            }
        }
    }

    #[test]
    fn text_maps_onto_a_vocabulary_and_knows_its_entropy() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.txt");
        std::fs::write(&path, "abab".repeat(100)).unwrap();
        let t = read_text(&path, None).unwrap();
        assert_eq!(t.vocab, vec!['a', 'b']);
        assert_eq!((t.train.len(), t.val.len()), (360, 40));
        assert!((t.unigram_entropy() - std::f64::consts::LN_2).abs() < 1e-9);
        // "abab...": the next character is certain.
        assert!(t.bigram_entropy().abs() < 1e-9);
        // Independent fair coin flips: the previous character tells nothing.
        let mut rng = StdRng::seed_from_u64(1);
        let coin = Text {
            vocab: vec!['a', 'b'],
            train: (0..200_000).map(|_| rng.gen_range(0..2)).collect(),
            val: vec![],
        };
        assert!((coin.bigram_entropy() - std::f64::consts::LN_2).abs() < 1e-3);
        let err = read_text(&path, Some(&['a'])).unwrap_err().to_string();
        assert!(err.contains("not in the run's vocabulary"), "{err}");
        std::fs::write(&path, [0xff, 0xfe, 0x00]).unwrap();
        let err = read_text(&path, None).unwrap_err().to_string();
        assert!(err.contains("not UTF-8"), "{err}");
    }
}
