//! The codec catalogue: names, wire ids and the byte layout each codec gives a frame.

use std::fmt;
use std::str::FromStr;

use crate::codecs::blockwise::BLOCK_SIZE;
use crate::error::Error;
use crate::format::HEADER_LEN;
use crate::options::AdaptivePolicy;

/// A tensor codec, chosen by name (`"u8"`, `"blockwise8"`, ...) through [`FromStr`] and printed back by [`Display`].
///
/// | name         | variant          | bytes per element      | lossy | per-frame parameters              |
/// |--------------|------------------|------------------------|-------|-----------------------------------|
/// | `none`       | `None`           | 4                      | no    | —                                 |
/// | `f16`        | `Float16`        | 2                      | yes   | —                                 |
/// | `bf16`       | `BFloat16`       | 2                      | yes   | —                                 |
/// | `scaled-f16` | `ScaledFloat16`  | 2                      | yes   | mean, std (8 bytes)               |
/// | `u8`         | `Uniform8Bit`    | 1                      | yes   | 256-entry codebook (1024 bytes)   |
/// | `quantile8`  | `Quantile8Bit`   | 1                      | yes   | 256-entry codebook (1024 bytes)   |
/// | `blockwise8` | `Blockwise8Bit`  | 1 + 4 per 4096 values  | yes   | —                                 |
/// | `u4`         | `Uniform4Bit`    | 0.5                    | yes   | 16-entry codebook (64 bytes)      |
/// | `adaptive`   | `Adaptive`       | per [`AdaptivePolicy`] |       | never on the wire                 |
///
/// `Adaptive` is a policy, not a wire codec: the encoder resolves it by tensor size with [`Codec::resolve`] and the
/// frame records the codec actually used.
///
/// ```
/// use starling_compression::Codec;
/// let codec: Codec = "blockwise8".parse()?;
/// assert_eq!(codec, Codec::Blockwise8Bit);
/// assert_eq!(codec.to_string(), "blockwise8");
/// # Ok::<(), starling_compression::Error>(())
/// ```
///
/// [`Display`]: std::fmt::Display
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(into = "String", try_from = "String")]
pub enum Codec {
    /// Raw little-endian f32: exact.
    None,
    /// IEEE half precision, round to nearest even; finite values beyond ±65504 saturate.
    Float16,
    /// bfloat16 (the top half of an f32), round to nearest even: f32's range with 8 significant bits.
    BFloat16,
    /// Subtract the mean, divide by the standard deviation, store f16; decoding multiplies back.
    ScaledFloat16,
    /// 256 uniform bins over mean ± 3σ; each code decodes to the mean of the values in its bin.
    Uniform8Bit,
    /// 256 bins at quantiles of the data (estimated from a sample); each code decodes to its bin's mean.
    Quantile8Bit,
    /// Blocks of [`BLOCK_SIZE`](crate::BLOCK_SIZE) values scaled by their absolute maximum, mapped to a dynamic
    /// (decade exponent + linear fraction) 8-bit code in the style of bitsandbytes.
    Blockwise8Bit,
    /// 16 uniform bins over mean ± 2.8σ, two codes per byte; each code decodes to its bin's mean.
    Uniform4Bit,
    /// Size-adaptive policy: small tensors go uncompressed, large ones use [`AdaptivePolicy::large`].
    Adaptive,
}

impl Codec {
    /// Every codec, in wire-id order, `Adaptive` last.
    pub const ALL: [Codec; 9] = [
        Codec::None,
        Codec::Float16,
        Codec::BFloat16,
        Codec::ScaledFloat16,
        Codec::Uniform8Bit,
        Codec::Quantile8Bit,
        Codec::Blockwise8Bit,
        Codec::Uniform4Bit,
        Codec::Adaptive,
    ];

    /// Every codec that can appear on the wire (all but `Adaptive`).
    pub const WIRE: [Codec; 8] = [
        Codec::None,
        Codec::Float16,
        Codec::BFloat16,
        Codec::ScaledFloat16,
        Codec::Uniform8Bit,
        Codec::Quantile8Bit,
        Codec::Blockwise8Bit,
        Codec::Uniform4Bit,
    ];

    /// The codec's name, as accepted by [`FromStr`] and printed by [`Display`](std::fmt::Display).
    pub const fn name(self) -> &'static str {
        match self {
            Codec::None => "none",
            Codec::Float16 => "f16",
            Codec::BFloat16 => "bf16",
            Codec::ScaledFloat16 => "scaled-f16",
            Codec::Uniform8Bit => "u8",
            Codec::Quantile8Bit => "quantile8",
            Codec::Blockwise8Bit => "blockwise8",
            Codec::Uniform4Bit => "u4",
            Codec::Adaptive => "adaptive",
        }
    }

    /// The id byte this codec has in a frame header; `None` for `Adaptive`, which never goes on the wire.
    pub const fn wire_id(self) -> Option<u8> {
        match self {
            Codec::None => Some(0),
            Codec::Float16 => Some(1),
            Codec::BFloat16 => Some(2),
            Codec::ScaledFloat16 => Some(3),
            Codec::Uniform8Bit => Some(4),
            Codec::Quantile8Bit => Some(5),
            Codec::Blockwise8Bit => Some(6),
            Codec::Uniform4Bit => Some(7),
            Codec::Adaptive => None,
        }
    }

    /// The codec with this wire id.
    pub fn from_wire_id(id: u8) -> Result<Codec, Error> {
        Codec::WIRE
            .get(usize::from(id))
            .copied()
            .ok_or(Error::UnknownCodecId(id))
    }

    /// Whether decoding gives back exactly the encoded values (only `None`).
    pub const fn is_lossless(self) -> bool {
        matches!(self, Codec::None)
    }

    /// Whether the codec encodes each value on its own (`None`, `Float16`, `BFloat16`): a value
    /// decodes the same wherever it sits in a chunk, so [`Codec::round_trip`] can round values
    /// in place exactly as encoding and decoding them would.
    pub const fn is_elementwise(self) -> bool {
        matches!(self, Codec::None | Codec::Float16 | Codec::BFloat16)
    }

    /// Replaces every value with what this codec's decoder gives back for it, without a frame:
    /// afterwards encoding the values loses nothing, so peers that decode them hold the same bits
    /// as the peer that rounded them. Only for [`elementwise`](Codec::is_elementwise) codecs.
    ///
    /// ```
    /// use starling_compression::Codec;
    /// let mut v = [1.0f32 + 1.0 / 1024.0, 0.1, 7.25];
    /// Codec::BFloat16.round_trip(&mut v)?;
    /// assert_eq!(v, [1.0, 0.10009765625, 7.25]); // 8 significant bits, round to nearest even
    /// assert!(Codec::Uniform8Bit.round_trip(&mut v).is_err());
    /// # Ok::<(), starling_compression::Error>(())
    /// ```
    pub fn round_trip(self, values: &mut [f32]) -> Result<(), Error> {
        match self {
            Codec::None => Ok(()),
            Codec::Float16 | Codec::BFloat16 => {
                crate::codecs::float::round_trip(self, values);
                Ok(())
            }
            other => Err(Error::InvalidArgument(format!(
                "{other} does not encode each value on its own: it cannot round values in place"
            ))),
        }
    }

    /// The codec used for a tensor of `elements` values: `Adaptive` resolves through `policy` (a policy whose
    /// `large` is itself `Adaptive` means `Uniform8Bit`); every other codec is itself.
    ///
    /// ```
    /// use starling_compression::{AdaptivePolicy, Codec};
    /// let policy = AdaptivePolicy::default();
    /// assert_eq!(Codec::Adaptive.resolve(10, &policy), Codec::None);
    /// assert_eq!(Codec::Adaptive.resolve(1 << 20, &policy), Codec::Uniform8Bit);
    /// ```
    pub fn resolve(self, elements: usize, policy: &AdaptivePolicy) -> Codec {
        match self {
            Codec::Adaptive if elements < policy.threshold => Codec::None,
            Codec::Adaptive => match policy.large {
                Codec::Adaptive => Codec::Uniform8Bit,
                large => large,
            },
            other => other,
        }
    }

    /// Bytes of per-frame codec parameters (codebook, mean and std) that precede the payload.
    /// `None` for `Adaptive`, whose layout is that of the codec it resolves to.
    pub const fn params_len(self) -> Option<usize> {
        match self {
            Codec::None | Codec::Float16 | Codec::BFloat16 | Codec::Blockwise8Bit => Some(0),
            Codec::ScaledFloat16 => Some(8),
            Codec::Uniform8Bit | Codec::Quantile8Bit => Some(256 * 4),
            Codec::Uniform4Bit => Some(16 * 4),
            Codec::Adaptive => None,
        }
    }

    /// Bytes of payload for `elements` values (before the optional zstd stage); `None` for `Adaptive` or on overflow.
    pub const fn payload_len(self, elements: usize) -> Option<usize> {
        match self {
            Codec::None => elements.checked_mul(4),
            Codec::Float16 | Codec::BFloat16 | Codec::ScaledFloat16 => elements.checked_mul(2),
            Codec::Uniform8Bit | Codec::Quantile8Bit => Some(elements),
            Codec::Blockwise8Bit => match (elements.div_ceil(BLOCK_SIZE)).checked_mul(4) {
                Some(scales) => elements.checked_add(scales),
                None => None,
            },
            Codec::Uniform4Bit => Some(elements.div_ceil(2)),
            Codec::Adaptive => None,
        }
    }

    /// Bytes of a whole frame (header, parameters, payload) of `elements` values without zstd; `None` for
    /// `Adaptive` or on overflow. The zstd stage only ever makes a frame smaller.
    ///
    /// ```
    /// use starling_compression::{Codec, HEADER_LEN};
    /// assert_eq!(Codec::Float16.frame_len(1000), Some(HEADER_LEN + 2000));
    /// ```
    pub const fn frame_len(self, elements: usize) -> Option<usize> {
        match (self.params_len(), self.payload_len(elements)) {
            (Some(params), Some(payload)) => match (HEADER_LEN + params).checked_add(payload) {
                Some(len) => Some(len),
                None => None,
            },
            _ => None,
        }
    }
}

impl fmt::Display for Codec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Codec {
    type Err = Error;

    /// Parses a codec name (case-insensitive); a few long aliases are accepted too
    /// (`float16`, `bfloat16`, `uniform8`, `uniform4`, `scaled_f16`).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let lower = s.trim().to_ascii_lowercase();
        let codec = match lower.as_str() {
            "none" | "raw" | "f32" => Codec::None,
            "f16" | "float16" => Codec::Float16,
            "bf16" | "bfloat16" => Codec::BFloat16,
            "scaled-f16" | "scaled_f16" | "scaledfloat16" => Codec::ScaledFloat16,
            "u8" | "uniform8" | "uniform8bit" => Codec::Uniform8Bit,
            "quantile8" | "quantile8bit" => Codec::Quantile8Bit,
            "blockwise8" | "blockwise8bit" => Codec::Blockwise8Bit,
            "u4" | "uniform4" | "uniform4bit" => Codec::Uniform4Bit,
            "adaptive" => Codec::Adaptive,
            _ => return Err(Error::UnknownCodecName(s.to_owned())),
        };
        Ok(codec)
    }
}

impl From<Codec> for String {
    fn from(codec: Codec) -> String {
        codec.name().to_owned()
    }
}

impl TryFrom<String> for Codec {
    type Error = Error;

    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for codec in Codec::ALL {
            assert_eq!(codec.name().parse::<Codec>().ok(), Some(codec));
            assert_eq!(codec.to_string(), codec.name());
        }
        assert!(matches!(
            "u9".parse::<Codec>(),
            Err(Error::UnknownCodecName(_))
        ));
        assert_eq!("U8".parse::<Codec>().ok(), Some(Codec::Uniform8Bit));
    }

    #[test]
    fn wire_ids_round_trip() {
        for codec in Codec::WIRE {
            let id = codec.wire_id().expect("wire codec has an id");
            assert_eq!(Codec::from_wire_id(id).ok(), Some(codec));
        }
        assert_eq!(Codec::Adaptive.wire_id(), None);
        assert!(matches!(
            Codec::from_wire_id(8),
            Err(Error::UnknownCodecId(8))
        ));
        assert!(matches!(
            Codec::from_wire_id(255),
            Err(Error::UnknownCodecId(255))
        ));
    }

    #[test]
    fn layouts() {
        assert_eq!(Codec::Blockwise8Bit.payload_len(4097), Some(4097 + 8));
        assert_eq!(Codec::Uniform4Bit.payload_len(7), Some(4));
        assert_eq!(Codec::None.payload_len(usize::MAX), None);
        assert_eq!(Codec::Adaptive.frame_len(1), None);
    }

    #[test]
    fn serde_uses_names() {
        let json = serde_json::to_string(&Codec::ScaledFloat16).expect("serialize");
        assert_eq!(json, "\"scaled-f16\"");
        let back: Codec = serde_json::from_str("\"u4\"").expect("deserialize");
        assert_eq!(back, Codec::Uniform4Bit);
    }
}
