//! MNIST's IDX file format: reading a directory of image and label files (gzip or not; plain
//! image files mapped rather than read), and the [`Pixels`] that hold the images.

use std::fs::File;
use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, ensure, Context, Result};

use super::{Images, MAX_FILE_BYTES};

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::digits;
    use rand::{rngs::StdRng, Rng, SeedableRng};

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
}
