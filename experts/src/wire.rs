//! The expert protocol: messages and their framing.
//!
//! A client opens a stream on [`EXPERTS_PROTOCOL`], sends [`Request::Hello`] and waits for
//! [`Response::Ready`] (libp2p-stream drops inbound streams that arrive while the server's
//! accept loop is busy; the handshake tells the client its stream was taken, so a request is
//! never sent into a stream nobody reads, and a backward is never applied twice). The stream
//! then carries any number of request/response pairs, one at a time, until either side closes
//! it. Messages travel in the node's shared framing ([`starling_node::framing`], re-exported
//! here as [`read_msg`] / [`write_msg`]): a little-endian `u32` length and that many bytes of
//! postcard. Tensors inside are `starling_compression` frames.
//!
//! ```
//! # futures::executor::block_on(async {
//! use starling_compression::Codec;
//! use starling_experts::wire::{read_msg, write_msg, Request, WireTensor};
//! let x = WireTensor::encode(&[1, 3], &[0.5, -1.0, 2.0], Codec::None).unwrap();
//! let mut wire = Vec::new();
//! write_msg(&mut wire, &Request::Forward { uid: "ffn.0.3".into(), inputs: vec![x] }).await.unwrap();
//! let mut r = futures::io::Cursor::new(wire);
//! match read_msg::<_, Request>(&mut r, 1 << 20).await.unwrap() {
//!     Request::Forward { uid, inputs } => {
//!         assert_eq!(uid, "ffn.0.3");
//!         assert_eq!(inputs[0].decode().unwrap(), vec![0.5, -1.0, 2.0]);
//!     }
//!     other => panic!("{other:?}"),
//! }
//! # });
//! ```

use serde::{Deserialize, Serialize};
use starling_compression::{ChunkHeader, Codec, DecodeOptions, EncodeOptions};
use starling_node::StreamProtocol;

pub use starling_node::framing::{read_msg, write_msg, FrameError};

use crate::backend::ExpertSpec;
use crate::error::{RemoteError, RemoteErrorKind};
use crate::schema::{DType, ExpertSchema};
use crate::{ExpertError, Result};

/// Protocol name of expert calls.
pub const EXPERTS_PROTOCOL: StreamProtocol = StreamProtocol::new("/starling/experts/1");

/// A client's request.
#[derive(Debug, Serialize, Deserialize)]
pub enum Request {
    /// First message on a new stream.
    Hello,
    /// Describe an expert.
    Info {
        /// The expert's uid.
        uid: String,
    },
    /// Run the expert forward.
    Forward {
        /// The expert's uid.
        uid: String,
        /// Its inputs, `[batch, ..]`.
        inputs: Vec<WireTensor>,
    },
    /// Backward: input gradients back, and one optimizer step on the expert.
    Backward {
        /// The expert's uid.
        uid: String,
        /// The inputs of the forward pass.
        inputs: Vec<WireTensor>,
        /// Gradients of the loss with respect to the outputs.
        grad_outputs: Vec<WireTensor>,
    },
}

/// A server's answer.
#[derive(Debug, Serialize, Deserialize)]
pub enum Response {
    /// Answer to `Hello`: the stream is served.
    Ready,
    /// Answer to `Info`.
    Info(ExpertInfo),
    /// Outputs of a forward, or input gradients of a backward.
    Tensors(Vec<WireTensor>),
    /// The request failed: a [`RemoteError`] in its wire form (kept as named fields so the
    /// variant reads the same in matches). The stream stays usable unless the frame itself was
    /// bad.
    Error {
        /// Class of error.
        kind: RemoteErrorKind,
        /// Human-readable reason.
        message: String,
    },
}

impl From<RemoteError> for Response {
    fn from(e: RemoteError) -> Response {
        Response::Error {
            kind: e.kind,
            message: e.message,
        }
    }
}

/// What a server says about one of its experts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExpertInfo {
    /// The uid.
    pub uid: String,
    /// Architecture and sizes.
    pub spec: ExpertSpec,
    /// Input and output shapes.
    pub schema: ExpertSchema,
    /// Optimizer steps taken so far.
    pub steps: u64,
    /// Largest request (samples) the server accepts.
    pub max_request_rows: usize,
}

/// A tensor on the wire: its full shape and one compression frame holding its values.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WireTensor {
    /// Full shape, batch dimension first.
    pub shape: Vec<u32>,
    /// Element type.
    pub dtype: DType,
    /// The values in the `starling_compression` wire format.
    #[serde(with = "serde_bytes")]
    pub frame: Vec<u8>,
}

impl WireTensor {
    /// Encodes `values` (row-major, `shape`) with `codec`. NaN/Inf are refused.
    pub fn encode(shape: &[usize], values: &[f32], codec: Codec) -> Result<WireTensor> {
        let n: usize = shape.iter().product();
        if n != values.len() {
            return Err(ExpertError::Invalid(format!(
                "shape {shape:?} holds {n} values, got {}",
                values.len()
            )));
        }
        let shape = shape
            .iter()
            .map(|&d| {
                u32::try_from(d).map_err(|_| ExpertError::Invalid("dimension too large".into()))
            })
            .collect::<Result<Vec<u32>>>()?;
        Ok(WireTensor {
            shape,
            dtype: DType::F32,
            frame: starling_compression::encode(codec, values, &EncodeOptions::default())?,
        })
    }

    /// The shape as `usize`s.
    pub fn dims(&self) -> Vec<usize> {
        self.shape.iter().map(|&d| d as usize).collect()
    }

    /// Decodes the values after checking that the frame holds exactly the shape's element
    /// count (before allocating anything) and no NaN/Inf.
    pub fn decode(&self) -> Result<Vec<f32>> {
        let n = self
            .shape
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d as usize))
            .ok_or_else(|| ExpertError::Protocol("tensor shape overflows".into()))?;
        let header = ChunkHeader::parse_prefix(&self.frame)?;
        if header.count != n || header.offset != 0 || header.total != n as u64 {
            return Err(ExpertError::Protocol(format!(
                "tensor frame holds {} values at offset {} of {}, shape {:?} needs {n}",
                header.count, header.offset, header.total, self.shape
            )));
        }
        let opts = DecodeOptions {
            max_elements: n.max(1),
            ..DecodeOptions::default()
        };
        Ok(starling_compression::decode(&self.frame, &opts)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn messages_round_trip_and_bad_frames_are_refused() {
        let t = WireTensor::encode(&[2, 3], &[1.0, -2.0, 3.0, 4.5, 5.0, 6.0], Codec::None).unwrap();
        let mut buf = Vec::new();
        write_msg(
            &mut buf,
            &Request::Forward {
                uid: "ffn.0.1".into(),
                inputs: vec![t],
            },
        )
        .await
        .unwrap();
        let mut r = futures::io::Cursor::new(buf.clone());
        match read_msg::<_, Request>(&mut r, 1 << 20).await.unwrap() {
            Request::Forward { uid, inputs } => {
                assert_eq!(uid, "ffn.0.1");
                assert_eq!(inputs[0].dims(), vec![2, 3]);
                assert_eq!(
                    inputs[0].decode().unwrap(),
                    vec![1.0, -2.0, 3.0, 4.5, 5.0, 6.0]
                );
            }
            other => panic!("{other:?}"),
        }
        // The bytes on the wire: a little-endian u32 length, then the postcard body.
        let body = postcard::to_stdvec(&Request::Info { uid: "e.1".into() }).unwrap();
        let mut framed = Vec::new();
        write_msg(&mut framed, &Request::Info { uid: "e.1".into() })
            .await
            .unwrap();
        assert_eq!(framed[..4], (body.len() as u32).to_le_bytes());
        assert_eq!(framed[4..], body[..]);
        // Over the limit: refused from the length prefix alone.
        let mut r = futures::io::Cursor::new(buf.clone());
        let err = read_msg::<_, Request>(&mut r, 8).await.unwrap_err();
        assert!(matches!(err, FrameError::TooLarge { max: 8, .. }));
        assert!(matches!(ExpertError::from(err), ExpertError::Protocol(_)));
        // Garbage of a valid length: malformed, not a panic.
        let mut r = futures::io::Cursor::new(vec![3, 0, 0, 0, 0xff, 0xff, 0xff]);
        let err = read_msg::<_, Request>(&mut r, 64).await.unwrap_err();
        assert!(matches!(err, FrameError::Malformed(_)));
        assert!(matches!(ExpertError::from(err), ExpertError::Protocol(_)));
        // Truncated.
        let mut r = futures::io::Cursor::new(buf[..buf.len() - 3].to_vec());
        let err = read_msg::<_, Request>(&mut r, 1 << 20).await.unwrap_err();
        assert!(matches!(err, FrameError::Io(_)));
        assert!(matches!(ExpertError::from(err), ExpertError::Io(_)));
    }

    #[tokio::test]
    async fn a_remote_error_round_trips_and_names_expert_server_and_cause() {
        let sent = RemoteError::new(RemoteErrorKind::Overloaded, "9000 samples already queued");
        let mut buf = Vec::new();
        write_msg(&mut buf, &Response::from(sent.clone()))
            .await
            .unwrap();
        let mut r = futures::io::Cursor::new(buf);
        let got = match read_msg::<_, Response>(&mut r, 1024).await.unwrap() {
            Response::Error { kind, message } => RemoteError { kind, message },
            other => panic!("{other:?}"),
        };
        assert_eq!(got, sent);
        let peer = starling_node::PeerId::random();
        let e = got.into_expert_error("ffn.0.3", peer);
        let text = e.to_string();
        assert!(text.contains("ffn.0.3"), "{text}");
        assert!(text.contains(&peer.to_string()), "{text}");
        assert!(text.contains("overloaded"), "{text}");
        assert!(text.contains("9000 samples already queued"), "{text}");
        assert!(matches!(
            e,
            ExpertError::Remote {
                kind: RemoteErrorKind::Overloaded,
                ..
            }
        ));
    }

    #[test]
    fn tensor_shape_must_match_frame() {
        let mut t = WireTensor::encode(&[2, 2], &[1.0, 2.0, 3.0, 4.0], Codec::Float16).unwrap();
        t.shape = vec![4, 2];
        assert!(t.decode().is_err());
        t.shape = vec![u32::MAX, u32::MAX, u32::MAX];
        assert!(t.decode().is_err());
        assert!(WireTensor::encode(&[2], &[f32::NAN, 1.0], Codec::None).is_err());
        assert!(WireTensor::encode(&[3], &[1.0, 1.0], Codec::None).is_err());
    }
}
