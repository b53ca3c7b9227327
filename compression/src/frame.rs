//! Encoding a tensor into one frame and decoding frames: the crate's main entry points.

use std::borrow::Cow;

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use crate::codec::Codec;
use crate::codecs::{encode_body, DecodeView, Op};
use crate::error::{Error, Result};
use crate::format::{ChunkHeader, HEADER_LEN, MAX_ELEMENTS, MAX_TOTAL_ELEMENTS};
use crate::options::{DecodeOptions, EncodeOptions, NonFinite};
use crate::stats;

/// Bodies larger than this are probed before the zstd stage compresses them whole.
const ZSTD_PROBE_MIN_BYTES: usize = 256 * 1024;
/// Bytes of the zstd probe.
const ZSTD_PROBE_BYTES: usize = 64 * 1024;

/// Encodes `data` with `codec` into one self-describing frame (header, parameters, payload).
///
/// `Codec::Adaptive` resolves by `data.len()` through `opts.adaptive`. NaN and ±Inf are rejected unless
/// `opts.nonfinite` is [`NonFinite::Allow`].
///
/// ```
/// use starling_compression::{decode, encode, Codec, DecodeOptions, EncodeOptions};
/// let x: Vec<f32> = (0..10_000).map(|i| (i as f32 * 0.01).sin()).collect();
/// let frame = encode(Codec::Uniform8Bit, &x, &EncodeOptions::default())?;
/// assert!(frame.len() < x.len() * 4 / 3);
/// let y = decode(&frame, &DecodeOptions::default())?;
/// assert_eq!(y.len(), x.len());
/// # Ok::<(), starling_compression::Error>(())
/// ```
pub fn encode(codec: Codec, data: &[f32], opts: &EncodeOptions) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    encode_into(codec, data, opts, &mut out)?;
    Ok(out)
}

/// Like [`encode`], into `out` (replacing its contents), reusing its allocation: the hot-path form. Returns the
/// frame's header. On error `out` is left empty.
///
/// ```
/// use starling_compression::{encode_into, Codec, EncodeOptions};
/// let mut buf = Vec::new();
/// for step in 0..3 {
///     let grad = vec![step as f32; 1000];
///     let header = encode_into(Codec::Float16, &grad, &EncodeOptions::default(), &mut buf)?;
///     assert_eq!(header.frame_len(), buf.len());
/// }
/// # Ok::<(), starling_compression::Error>(())
/// ```
pub fn encode_into(
    codec: Codec,
    data: &[f32],
    opts: &EncodeOptions,
    out: &mut Vec<u8>,
) -> Result<ChunkHeader> {
    let codec = codec.resolve(data.len(), &opts.adaptive);
    encode_frame(codec, data, 0, data.len() as u64, opts, out)
}

/// Whether a chunk of `count` elements at `offset` fits the format's limits and its tensor.
fn check_chunk_bounds(count: usize, offset: u64, total: u64) -> Result<()> {
    if count > MAX_ELEMENTS {
        return Err(Error::TooManyElements {
            count: count as u64,
            max: MAX_ELEMENTS as u64,
        });
    }
    if total > MAX_TOTAL_ELEMENTS {
        return Err(Error::TooManyElements {
            count: total,
            max: MAX_TOTAL_ELEMENTS,
        });
    }
    if offset
        .checked_add(count as u64)
        .is_none_or(|end| end > total)
    {
        return Err(Error::ChunkOutOfRange {
            offset,
            count: count as u64,
            total,
        });
    }
    Ok(())
}

/// The header of an uncompressed ([`Codec::None`]) frame of `count` elements at `offset` in a
/// tensor of `total`, for a sender that writes the payload itself (the `count` values as f32
/// little-endian, right after the header) instead of copying it through [`encode_into`]. Header
/// plus payload is exactly the frame `encode_into` makes for that chunk without zstd, so one copy
/// of every element is saved.
///
/// ```
/// use starling_compression::{decode, raw_frame_header, DecodeOptions};
/// let values = [1.5f32, -2.0, 3.25];
/// let mut frame = raw_frame_header(3, 0, 3)?.to_vec();
/// values.iter().for_each(|v| frame.extend_from_slice(&v.to_le_bytes()));
/// assert_eq!(decode(&frame, &DecodeOptions::default())?, values);
/// # Ok::<(), starling_compression::Error>(())
/// ```
pub fn raw_frame_header(count: usize, offset: u64, total: u64) -> Result<[u8; HEADER_LEN]> {
    check_chunk_bounds(count, offset, total)?;
    let header = ChunkHeader {
        codec: Codec::None,
        count,
        offset,
        total,
        zstd: false,
        body_len: count * 4,
    };
    let mut out = [0u8; HEADER_LEN];
    header.write(&mut out);
    Ok(out)
}

/// Encodes `data` as the frame of elements `offset..offset + data.len()` of a tensor of `total` elements with the
/// resolved `codec`.
pub(crate) fn encode_frame(
    codec: Codec,
    data: &[f32],
    offset: u64,
    total: u64,
    opts: &EncodeOptions,
    out: &mut Vec<u8>,
) -> Result<ChunkHeader> {
    let result = encode_frame_inner(codec, data, offset, total, opts, out);
    if result.is_err() {
        out.clear();
    }
    result
}

fn encode_frame_inner(
    codec: Codec,
    data: &[f32],
    offset: u64,
    total: u64,
    opts: &EncodeOptions,
    out: &mut Vec<u8>,
) -> Result<ChunkHeader> {
    let count = data.len();
    check_chunk_bounds(count, offset, total)?;
    let (Some(params_len), Some(payload_len)) = (codec.params_len(), codec.payload_len(count))
    else {
        return Err(Error::InvalidParameter("codec has no wire layout"));
    };
    let statistical = !matches!(codec, Codec::None | Codec::Float16 | Codec::BFloat16);
    let data: Cow<'_, [f32]> = match opts.nonfinite {
        NonFinite::Allow if statistical && stats::has_nonfinite(data) => {
            Cow::Owned(stats::sanitized(data))
        }
        _ => Cow::Borrowed(data),
    };
    let check = opts.nonfinite == NonFinite::Reject;
    let raw_len = params_len + payload_len;
    // Resize without clearing: bytes already there are overwritten, so a reused buffer is not memset again.
    out.resize(HEADER_LEN + raw_len, 0);
    encode_body(codec, &data, &mut out[HEADER_LEN..], check, opts.parallel)?;
    let mut header = ChunkHeader {
        codec,
        count,
        offset,
        total,
        zstd: false,
        body_len: raw_len,
    };
    finish_frame(out, &mut header, opts)?;
    Ok(header)
}

/// The compressed body, when zstd makes it smaller (after a cheap probe for large bodies).
fn zstd_if_smaller(body: &[u8], level: i32) -> Result<Option<Vec<u8>>> {
    let zerr = |e: std::io::Error| Error::Zstd(e.to_string());
    if body.len() > ZSTD_PROBE_MIN_BYTES {
        let probe = zstd::bulk::compress(&body[..ZSTD_PROBE_BYTES], level).map_err(zerr)?;
        if probe.len() * 10 > ZSTD_PROBE_BYTES * 9 {
            return Ok(None);
        }
    }
    let compressed = zstd::bulk::compress(body, level).map_err(zerr)?;
    Ok((compressed.len() < body.len()).then_some(compressed))
}

/// Encodes f16 input. With a codec resolving to `Float16` the values are copied bit for bit (no rounding);
/// other codecs widen to f32 first.
///
/// ```
/// use half::f16;
/// use starling_compression::{decode, encode_f16, Codec, DecodeOptions, EncodeOptions};
/// let x = [f16::from_f32(1.5), f16::from_f32(-0.25)];
/// let frame = encode_f16(Codec::Float16, &x, &EncodeOptions::default())?;
/// assert_eq!(decode(&frame, &DecodeOptions::default())?, vec![1.5, -0.25]);
/// # Ok::<(), starling_compression::Error>(())
/// ```
pub fn encode_f16(codec: Codec, data: &[f16], opts: &EncodeOptions) -> Result<Vec<u8>> {
    let resolved = codec.resolve(data.len(), &opts.adaptive);
    if resolved == Codec::Float16 {
        return encode_half_bits(resolved, bytemuck::cast_slice(data), 0x7c00, opts);
    }
    let mut wide = vec![0f32; data.len()];
    data.convert_to_f32_slice(&mut wide);
    encode(resolved, &wide, opts)
}

/// Encodes bf16 input. With a codec resolving to `BFloat16` the values are copied bit for bit; other codecs
/// widen to f32 first (exactly).
///
/// ```
/// use half::bf16;
/// use starling_compression::{decode, encode_bf16, Codec, DecodeOptions, EncodeOptions};
/// let x = [bf16::from_f32(3.0), bf16::from_f32(-1e30)];
/// let frame = encode_bf16(Codec::BFloat16, &x, &EncodeOptions::default())?;
/// assert_eq!(decode(&frame, &DecodeOptions::default())?, vec![3.0, bf16::from_f32(-1e30).to_f32()]);
/// # Ok::<(), starling_compression::Error>(())
/// ```
pub fn encode_bf16(codec: Codec, data: &[bf16], opts: &EncodeOptions) -> Result<Vec<u8>> {
    let resolved = codec.resolve(data.len(), &opts.adaptive);
    if resolved == Codec::BFloat16 {
        return encode_half_bits(resolved, bytemuck::cast_slice(data), 0x7f80, opts);
    }
    let mut wide = vec![0f32; data.len()];
    data.convert_to_f32_slice(&mut wide);
    encode(resolved, &wide, opts)
}

/// Frames 16-bit floats as they are; `exp_mask` selects the exponent bits (all ones = NaN/Inf).
fn encode_half_bits(
    codec: Codec,
    bits: &[u16],
    exp_mask: u16,
    opts: &EncodeOptions,
) -> Result<Vec<u8>> {
    let count = bits.len();
    if count > MAX_ELEMENTS {
        return Err(Error::TooManyElements {
            count: count as u64,
            max: MAX_ELEMENTS as u64,
        });
    }
    if opts.nonfinite == NonFinite::Reject {
        if let Some(index) = bits.iter().position(|&b| b & exp_mask == exp_mask) {
            let value = if exp_mask == 0x7c00 {
                f16::from_bits(bits[index]).to_f32()
            } else {
                f32::NAN
            };
            return Err(Error::NonFiniteInput { index, value });
        }
    }
    let mut out = vec![0u8; HEADER_LEN + 2 * count];
    for (o, b) in out[HEADER_LEN..].chunks_exact_mut(2).zip(bits) {
        o.copy_from_slice(&b.to_le_bytes());
    }
    let mut header = ChunkHeader {
        codec,
        count,
        offset: 0,
        total: count as u64,
        zstd: false,
        body_len: 2 * count,
    };
    finish_frame(&mut out, &mut header, opts)?;
    Ok(out)
}

/// Decodes a whole frame into a new vector, after checking every field against `opts` (see
/// [`DecodeOptions::max_elements`] for the allocation bound).
///
/// ```
/// use starling_compression::{decode, encode, Codec, DecodeOptions, EncodeOptions, Error};
/// let frame = encode(Codec::None, &[1.0, 2.0], &EncodeOptions::default())?;
/// assert_eq!(decode(&frame, &DecodeOptions::default())?, vec![1.0, 2.0]);
/// assert!(matches!(decode(&frame[..10], &DecodeOptions::default()), Err(Error::Truncated { .. })));
/// # Ok::<(), starling_compression::Error>(())
/// ```
pub fn decode(bytes: &[u8], opts: &DecodeOptions) -> Result<Vec<f32>> {
    Decoder::new(*opts).decode(bytes)
}

/// Decodes a frame into `out`, which must hold exactly the frame's element count, with default
/// [`DecodeOptions`]. Returns the frame's header (its `offset` says where the chunk belongs in the whole
/// tensor). On error `out` is untouched.
///
/// ```
/// use starling_compression::{decode_into, encode, Codec, EncodeOptions};
/// let frame = encode(Codec::BFloat16, &[0.5, 4.0], &EncodeOptions::default())?;
/// let mut out = [0.0f32; 2];
/// decode_into(&frame, &mut out)?;
/// assert_eq!(out, [0.5, 4.0]);
/// # Ok::<(), starling_compression::Error>(())
/// ```
pub fn decode_into(bytes: &[u8], out: &mut [f32]) -> Result<ChunkHeader> {
    Decoder::default().decode_into(bytes, out)
}

/// Adds `weight` times the decoded frame to `out` (`out[i] += weight * decoded[i]`), without a temporary: the
/// reducer's accumulate step. `out` must hold exactly the frame's element count; on error it is untouched.
///
/// ```
/// use starling_compression::{decode_add, encode, Codec, EncodeOptions};
/// let mut acc = vec![0.0f32; 3];
/// for peer in [[1.0f32, 2.0, 3.0], [3.0, 2.0, 1.0]] {
///     let frame = encode(Codec::None, &peer, &EncodeOptions::default())?;
///     decode_add(&frame, &mut acc, 0.5)?;
/// }
/// assert_eq!(acc, vec![2.0, 2.0, 2.0]);
/// # Ok::<(), starling_compression::Error>(())
/// ```
pub fn decode_add(bytes: &[u8], out: &mut [f32], weight: f32) -> Result<ChunkHeader> {
    Decoder::default().decode_add(bytes, out, weight)
}

/// A reusable decoder: options plus the scratch buffer and zstd context that zstd frames need, so that decoding
/// many frames allocates nothing after the first.
///
/// ```
/// use starling_compression::{encode, Codec, DecodeOptions, Decoder, EncodeOptions};
/// let mut decoder = Decoder::new(DecodeOptions::default().with_max_elements(1 << 20));
/// let frame = encode(Codec::None, &vec![0.0f32; 100_000], &EncodeOptions::default().with_zstd(3))?;
/// assert!(frame.len() < 1000);
/// let mut out = vec![1.0f32; 100_000];
/// decoder.decode_into(&frame, &mut out)?;
/// assert!(out.iter().all(|&v| v == 0.0));
/// # Ok::<(), starling_compression::Error>(())
/// ```
#[derive(Default)]
pub struct Decoder {
    opts: DecodeOptions,
    scratch: Vec<u8>,
    zstd: Option<zstd::bulk::Decompressor<'static>>,
}

impl std::fmt::Debug for Decoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Decoder")
            .field("opts", &self.opts)
            .finish_non_exhaustive()
    }
}

impl Decoder {
    /// A decoder with these options.
    pub fn new(opts: DecodeOptions) -> Decoder {
        Decoder {
            opts,
            scratch: Vec::new(),
            zstd: None,
        }
    }

    /// The options in force.
    pub fn options(&self) -> &DecodeOptions {
        &self.opts
    }

    /// Decodes a whole frame into a new vector (see [`decode`]).
    pub fn decode(&mut self, bytes: &[u8]) -> Result<Vec<f32>> {
        let header = self.header(bytes)?;
        let opts = self.opts;
        let view = self.view(&header, bytes)?;
        // Everything is validated: only now allocate the output.
        let mut out = vec![0f32; header.count];
        view.decode(&mut out, Op::Store, opts.parallel);
        Ok(out)
    }

    /// Decodes a frame into `out` (see [`decode_into`]).
    pub fn decode_into(&mut self, bytes: &[u8], out: &mut [f32]) -> Result<ChunkHeader> {
        self.decode_op(bytes, out, Op::Store)
    }

    /// Adds `weight` times the decoded frame to `out` (see [`decode_add`]).
    pub fn decode_add(
        &mut self,
        bytes: &[u8],
        out: &mut [f32],
        weight: f32,
    ) -> Result<ChunkHeader> {
        self.decode_op(bytes, out, Op::Add(weight))
    }

    fn decode_op(&mut self, bytes: &[u8], out: &mut [f32], op: Op) -> Result<ChunkHeader> {
        let header = self.header(bytes)?;
        if out.len() != header.count {
            return Err(Error::LengthMismatch {
                field: "output length",
                expected: header.count as u64,
                actual: out.len() as u64,
            });
        }
        let parallel = self.opts.parallel;
        self.view(&header, bytes)?.decode(out, op, parallel);
        Ok(header)
    }

    fn header(&self, bytes: &[u8]) -> Result<ChunkHeader> {
        let header = ChunkHeader::parse(bytes)?;
        if header.count > self.opts.max_elements {
            return Err(Error::TooManyElements {
                count: header.count as u64,
                max: self.opts.max_elements as u64,
            });
        }
        Ok(header)
    }

    /// The validated view of a frame's body (decompressing it into the scratch buffer first if needed).
    fn view<'a>(&'a mut self, header: &ChunkHeader, bytes: &'a [u8]) -> Result<DecodeView<'a>> {
        let body = &bytes[HEADER_LEN..];
        let body: &'a [u8] = if header.zstd {
            let raw_len = header.params_len() + header.payload_len();
            if let Ok(Some(size)) = zstd::zstd_safe::get_frame_content_size(body) {
                if size != raw_len as u64 {
                    return Err(Error::LengthMismatch {
                        field: "zstd content size",
                        expected: raw_len as u64,
                        actual: size,
                    });
                }
            }
            self.scratch.clear();
            // Bounded: raw_len follows from count, which is at most max_elements.
            self.scratch.reserve_exact(raw_len);
            let zstd = match &mut self.zstd {
                Some(z) => z,
                slot => slot.insert(
                    zstd::bulk::Decompressor::new().map_err(|e| Error::Zstd(e.to_string()))?,
                ),
            };
            let n = zstd
                .decompress_to_buffer(body, &mut self.scratch)
                .map_err(|e| Error::Zstd(e.to_string()))?;
            if n != raw_len || self.scratch.len() != raw_len {
                return Err(Error::LengthMismatch {
                    field: "decompressed body length",
                    expected: raw_len as u64,
                    actual: n as u64,
                });
            }
            &self.scratch
        } else {
            body
        };
        let view = DecodeView::new(header.codec, header.count, body)?;
        if self.opts.nonfinite == NonFinite::Reject {
            view.check_finite()?;
        }
        Ok(view)
    }
}

/// Runs the optional zstd stage over the body of the frame in `out` (header space reserved at the
/// front) and writes the final header there.
fn finish_frame(out: &mut Vec<u8>, header: &mut ChunkHeader, opts: &EncodeOptions) -> Result<()> {
    if let Some(level) = opts.zstd_level {
        if let Some(compressed) = zstd_if_smaller(&out[HEADER_LEN..], level)? {
            out.truncate(HEADER_LEN);
            out.extend_from_slice(&compressed);
            header.zstd = true;
            header.body_len = compressed.len();
        }
    }
    let head: &mut [u8; HEADER_LEN] =
        (&mut out[..HEADER_LEN])
            .try_into()
            .map_err(|_| Error::Truncated {
                len: 0,
                need: HEADER_LEN,
            })?;
    header.write(head);
    Ok(())
}
