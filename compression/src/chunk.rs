//! Splitting a flat tensor into frames of bounded size, and assembling them back in any order.

use std::collections::BTreeMap;
use std::ops::Range;

use crate::codec::Codec;
use crate::codecs::blockwise::BLOCK_SIZE;
use crate::error::{Error, Result};
use crate::format::{ChunkHeader, MAX_ELEMENTS, MAX_TOTAL_ELEMENTS};
use crate::frame::{encode_frame, Decoder};
use crate::options::{DecodeOptions, EncodeOptions};

/// The most elements of (resolved) `codec` one frame of at most `max_chunk_bytes` bytes can carry, capped at
/// [`MAX_ELEMENTS`]. Blockwise8Bit rounds down to whole blocks when at least one fits, so chunk boundaries are
/// block boundaries.
///
/// ```
/// use starling_compression::{elements_per_chunk, Codec, HEADER_LEN};
/// assert_eq!(elements_per_chunk(Codec::None, HEADER_LEN + 4000)?, 1000);
/// assert_eq!(elements_per_chunk(Codec::Uniform4Bit, HEADER_LEN + 64 + 10)?, 20);
/// # Ok::<(), starling_compression::Error>(())
/// ```
pub fn elements_per_chunk(codec: Codec, max_chunk_bytes: usize) -> Result<usize> {
    let fits = |n: usize| codec.frame_len(n).is_some_and(|len| len <= max_chunk_bytes);
    let needed = codec.frame_len(1).ok_or(Error::InvalidParameter(
        "adaptive must be resolved before chunking",
    ))?;
    if !fits(1) {
        return Err(Error::ChunkTooSmall {
            codec,
            max_chunk_bytes,
            needed,
        });
    }
    // frame_len is monotone in n: binary search the largest n that fits.
    let (mut lo, mut hi) = (1usize, MAX_ELEMENTS);
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if fits(mid) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    if codec == Codec::Blockwise8Bit && lo >= BLOCK_SIZE {
        lo -= lo % BLOCK_SIZE;
    }
    Ok(lo)
}

/// Splits `data` into frames of at most `max_chunk_bytes` bytes each, every frame carrying its element offset and
/// the tensor's total length so a receiver can place it. `Codec::Adaptive` resolves by the whole tensor's length.
/// Frames are encoded lazily, one per `next()`; an empty tensor gives no frames.
///
/// ```
/// use starling_compression::{split_chunks, ChunkAssembler, Codec, EncodeOptions};
/// let x: Vec<f32> = (0..10_000).map(|i| i as f32).collect();
/// let chunks: Vec<Vec<u8>> =
///     split_chunks(Codec::None, &x, 4096, &EncodeOptions::default())?.collect::<Result<_, _>>()?;
/// assert!(chunks.iter().all(|c| c.len() <= 4096));
/// let mut assembler = ChunkAssembler::new(x.len())?;
/// for c in chunks.iter().rev() {
///     assembler.accept(c)?;
/// }
/// assert_eq!(assembler.finish()?, x);
/// # Ok::<(), starling_compression::Error>(())
/// ```
pub fn split_chunks<'a>(
    codec: Codec,
    data: &'a [f32],
    max_chunk_bytes: usize,
    opts: &EncodeOptions,
) -> Result<SplitChunks<'a>> {
    if data.len() as u64 > MAX_TOTAL_ELEMENTS {
        return Err(Error::TooManyElements {
            count: data.len() as u64,
            max: MAX_TOTAL_ELEMENTS,
        });
    }
    let codec = codec.resolve(data.len(), &opts.adaptive);
    let per_chunk = elements_per_chunk(codec, max_chunk_bytes)?;
    Ok(SplitChunks {
        codec,
        data,
        per_chunk,
        next: 0,
        opts: *opts,
    })
}

/// The iterator of [`split_chunks`]: one encoded frame per item.
#[derive(Debug, Clone)]
pub struct SplitChunks<'a> {
    codec: Codec,
    data: &'a [f32],
    per_chunk: usize,
    next: usize,
    opts: EncodeOptions,
}

impl SplitChunks<'_> {
    /// The codec every frame uses (`Adaptive` resolved).
    pub fn codec(&self) -> Codec {
        self.codec
    }

    /// Elements per frame (the last frame may hold fewer).
    pub fn elements_per_chunk(&self) -> usize {
        self.per_chunk
    }

    /// Encodes the next frame into `out` (reusing its allocation); `None` when done.
    pub fn next_into(&mut self, out: &mut Vec<u8>) -> Option<Result<ChunkHeader>> {
        if self.next >= self.data.len() {
            return None;
        }
        let end = (self.next + self.per_chunk).min(self.data.len());
        let total = self.data.len() as u64;
        let result = encode_frame(
            self.codec,
            &self.data[self.next..end],
            self.next as u64,
            total,
            &self.opts,
            out,
        );
        self.next = end;
        Some(result)
    }
}

impl Iterator for SplitChunks<'_> {
    type Item = Result<Vec<u8>>;

    fn next(&mut self) -> Option<Self::Item> {
        let mut out = Vec::new();
        self.next_into(&mut out).map(|r| r.map(|_| out))
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = (self.data.len() - self.next).div_ceil(self.per_chunk);
        (left, Some(left))
    }
}

impl ExactSizeIterator for SplitChunks<'_> {}

/// Reassembles a tensor of known length from frames arriving in any order. Frames for another total length,
/// outside the tensor, or overlapping (including repeating) frames already accepted are rejected with an error and
/// change nothing.
///
/// ```
/// use starling_compression::{encode, split_chunks, ChunkAssembler, Codec, EncodeOptions, Error};
/// let x = vec![1.0f32; 3000];
/// let chunks: Vec<Vec<u8>> =
///     split_chunks(Codec::Float16, &x, 2048, &EncodeOptions::default())?.collect::<Result<_, _>>()?;
/// let mut assembler = ChunkAssembler::new(3000)?;
/// assembler.accept(&chunks[1])?;
/// assert!(matches!(assembler.accept(&chunks[1]), Err(Error::ChunkOverlap { .. })));
/// assert!(!assembler.is_complete());
/// for c in &chunks {
///     let _ = assembler.accept(c);
/// }
/// assert_eq!(assembler.finish()?, x);
/// # Ok::<(), starling_compression::Error>(())
/// ```
#[derive(Debug)]
pub struct ChunkAssembler {
    data: Vec<f32>,
    /// Accepted ranges, start -> end, adjacent ranges merged.
    ranges: BTreeMap<usize, usize>,
    received: usize,
    decoder: Decoder,
}

impl ChunkAssembler {
    /// An assembler for a tensor of `total` elements (allocated up front, zero-filled) with default decode options.
    pub fn new(total: usize) -> Result<ChunkAssembler> {
        Self::with_options(total, DecodeOptions::default())
    }

    /// An assembler with these decode options (its `max_elements` limits each frame, not the tensor).
    pub fn with_options(total: usize, opts: DecodeOptions) -> Result<ChunkAssembler> {
        let too_many = Error::TooManyElements {
            count: total as u64,
            max: MAX_TOTAL_ELEMENTS,
        };
        if total as u64 > MAX_TOTAL_ELEMENTS {
            return Err(too_many);
        }
        let mut data = Vec::new();
        // A total the machine cannot hold is an error, not an abort.
        data.try_reserve_exact(total).map_err(|_| too_many)?;
        data.resize(total, 0.0);
        Ok(ChunkAssembler {
            data,
            ranges: BTreeMap::new(),
            received: 0,
            decoder: Decoder::new(opts),
        })
    }

    /// Decodes one frame into its place. Returns its header.
    pub fn accept(&mut self, frame: &[u8]) -> Result<ChunkHeader> {
        let header = ChunkHeader::parse(frame)?;
        let total = self.data.len();
        if header.total != total as u64 {
            return Err(Error::LengthMismatch {
                field: "tensor total",
                expected: total as u64,
                actual: header.total,
            });
        }
        // The header guarantees offset + count <= total, which fits usize because total does.
        let (start, end) = (
            header.offset as usize,
            header.offset as usize + header.count,
        );
        let overlap = |(&s, &e): (&usize, &usize)| s < end && start < e;
        let clash = self.ranges.range(..end).next_back().is_some_and(overlap);
        if clash {
            return Err(Error::ChunkOverlap {
                offset: header.offset,
                count: header.count as u64,
            });
        }
        self.decoder
            .decode_into(frame, &mut self.data[start..end])?;
        self.insert(start, end);
        self.received += header.count;
        Ok(header)
    }

    fn insert(&mut self, mut start: usize, mut end: usize) {
        if start == end {
            return;
        }
        if let Some((&s, &e)) = self.ranges.range(..=start).next_back() {
            if e == start {
                self.ranges.remove(&s);
                start = s;
            }
        }
        if let Some(e) = self.ranges.remove(&end) {
            end = e;
        }
        self.ranges.insert(start, end);
    }

    /// Elements in the tensor.
    pub fn total(&self) -> usize {
        self.data.len()
    }

    /// Elements received so far.
    pub fn received(&self) -> usize {
        self.received
    }

    /// Whether every element has been received.
    pub fn is_complete(&self) -> bool {
        self.received == self.data.len()
    }

    /// The element ranges still missing, in order.
    pub fn missing(&self) -> Vec<Range<usize>> {
        let mut gaps = Vec::new();
        let mut at = 0;
        for (&s, &e) in &self.ranges {
            if s > at {
                gaps.push(at..s);
            }
            at = e;
        }
        if at < self.data.len() {
            gaps.push(at..self.data.len());
        }
        gaps
    }

    /// The tensor so far (missing elements are 0.0).
    pub fn data(&self) -> &[f32] {
        &self.data
    }

    /// The assembled tensor, or [`Error::Incomplete`] if elements are missing.
    pub fn finish(self) -> Result<Vec<f32>> {
        if !self.is_complete() {
            return Err(Error::Incomplete {
                received: self.received as u64,
                total: self.data.len() as u64,
            });
        }
        Ok(self.data)
    }

    /// The tensor whatever its state, with the ranges that were received (for callers that use partial results).
    pub fn into_parts(self) -> (Vec<f32>, Vec<Range<usize>>) {
        let ranges = self.ranges.iter().map(|(&s, &e)| s..e).collect();
        (self.data, ranges)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::encode;

    #[test]
    fn chunk_sizes_are_maximal() {
        for codec in Codec::WIRE {
            for max in [200usize, 1500, 4096, 65_536, 1 << 20] {
                let Ok(n) = elements_per_chunk(codec, max) else {
                    assert!(codec.frame_len(1).is_some_and(|l| l > max), "{codec} {max}");
                    continue;
                };
                assert!(
                    codec.frame_len(n).is_some_and(|l| l <= max),
                    "{codec} {max} {n}"
                );
                if !(codec == Codec::Blockwise8Bit && n >= BLOCK_SIZE) {
                    assert!(
                        codec.frame_len(n + 1).is_some_and(|l| l > max),
                        "{codec} {max} {n}"
                    );
                }
            }
        }
        assert!(matches!(
            elements_per_chunk(Codec::Uniform8Bit, 100),
            Err(Error::ChunkTooSmall { .. })
        ));
        assert!(elements_per_chunk(Codec::Adaptive, 1 << 20).is_err());
        assert_eq!(
            elements_per_chunk(Codec::Blockwise8Bit, 3 * (BLOCK_SIZE + 4) + 48).ok(),
            Some(3 * BLOCK_SIZE)
        );
    }

    #[test]
    fn assembler_rejects_wrong_total_overlap_and_reports_missing() {
        let x: Vec<f32> = (0..100).map(|i| i as f32).collect();
        let opts = EncodeOptions::default();
        let chunks: Vec<Vec<u8>> = split_chunks(Codec::None, &x, 48 + 4 * 30, &opts)
            .expect("split")
            .collect::<Result<_>>()
            .expect("encode");
        assert_eq!(chunks.len(), 4);
        let mut a = ChunkAssembler::new(100).expect("assembler");
        a.accept(&chunks[2]).expect("chunk 2");
        assert_eq!(a.missing(), vec![0..60, 90..100]);
        a.accept(&chunks[0]).expect("chunk 0");
        assert_eq!(a.missing(), vec![30..60, 90..100]);
        assert!(matches!(
            a.accept(&chunks[2]),
            Err(Error::ChunkOverlap { .. })
        ));
        let whole = encode(Codec::None, &x, &opts).expect("encode");
        assert!(matches!(a.accept(&whole), Err(Error::ChunkOverlap { .. })));
        let other = encode(Codec::None, &x[..10], &opts).expect("encode");
        assert!(matches!(
            a.accept(&other),
            Err(Error::LengthMismatch {
                field: "tensor total",
                ..
            })
        ));
        assert!(matches!(
            ChunkAssembler::new(100).expect("a").finish(),
            Err(Error::Incomplete { .. })
        ));
        a.accept(&chunks[1]).expect("chunk 1");
        a.accept(&chunks[3]).expect("chunk 3");
        assert!(a.is_complete());
        assert_eq!(a.missing(), vec![]);
        let (data, ranges) = a.into_parts();
        assert_eq!(ranges, vec![0..100]);
        assert_eq!(data, x);
    }

    #[test]
    fn empty_tensor_has_no_chunks() {
        let chunks =
            split_chunks(Codec::Uniform8Bit, &[], 4096, &EncodeOptions::default()).expect("split");
        assert_eq!(chunks.len(), 0);
        assert!(ChunkAssembler::new(0)
            .expect("a")
            .finish()
            .expect("complete")
            .is_empty());
        assert!(matches!(
            ChunkAssembler::new((1 << 40) + 1),
            Err(Error::TooManyElements { .. })
        ));
    }
}
