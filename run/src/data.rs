//! The data a built-in model trains on: the embedded digits, IDX files (MNIST's format, gzip or
//! not), or a UTF-8 text file. Every reader checks sizes before it allocates and names what is
//! wrong with a file.

use std::collections::BTreeSet;
use std::path::Path;

use anyhow::{bail, ensure, Context, Result};
use rand::{rngs::StdRng, seq::SliceRandom, SeedableRng};

use crate::manifest::DataSpec;

mod idx;

#[cfg(test)]
pub use idx::write_idx;
pub use idx::{read_idx_dir, read_idx_images, read_idx_labels, Pixels};

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
