//! Length-prefixed frames with a hard maximum: the one framing every Starling stream protocol
//! uses (averaging, experts, the fast lane's handshake).
//!
//! A frame is a little-endian `u32` body length followed by that many bytes. A reader is given
//! the largest body it accepts and refuses a longer frame **before allocating** anything for it
//! ([`FrameError::TooLarge`]); after that the stream cannot be resynchronised and should be
//! dropped. A body that arrives whole but does not decode is [`FrameError::Malformed`]: the
//! stream is still in sync and the caller may answer with an error message.
//!
//! Messages are `serde` types encoded with `postcard` ([`write_msg`], [`read_msg`]). Bulk data
//! goes through [`write_frame`] (a body written piece by piece, so callers never concatenate
//! header and payload first) and [`read_frame_into`] (one reusable buffer per stream).
//!
//! ```
//! # futures::executor::block_on(async {
//! use starling_node::framing::{read_msg, write_msg, FrameError};
//! let mut wire = Vec::new();
//! write_msg(&mut wire, &("hello", 7u32)).await.unwrap();
//! let mut r = futures::io::Cursor::new(wire);
//! let (s, n): (String, u32) = read_msg(&mut r, 1024).await.unwrap();
//! assert_eq!((s.as_str(), n), ("hello", 7));
//!
//! // A length word past the limit is refused before anything is allocated.
//! let mut r = futures::io::Cursor::new(vec![0xff, 0xff, 0xff, 0x7f]);
//! let err = read_msg::<_, String>(&mut r, 1024).await.unwrap_err();
//! assert!(matches!(err, FrameError::TooLarge { len: 0x7fff_ffff, max: 1024 }));
//! # });
//! ```

use futures::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use serde::{de::DeserializeOwned, Serialize};

/// Bytes of the length word in front of every frame.
pub const LENGTH_BYTES: usize = 4;

/// Why a frame could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The frame's length is over the limit; nothing was allocated for it, and the stream
    /// cannot be resynchronised.
    #[error("frame of {len} bytes is over the limit of {max} bytes")]
    TooLarge {
        /// The length the frame announced (or the caller tried to write).
        len: usize,
        /// The limit in force.
        max: usize,
    },
    /// The frame arrived whole but its body is not a valid message; the stream is in sync.
    #[error("malformed message: {0}")]
    Malformed(String),
    /// The stream failed or ended (an end in the middle of a frame is `UnexpectedEof`).
    #[error("stream error: {0}")]
    Io(#[from] std::io::Error),
}

impl From<FrameError> for std::io::Error {
    fn from(e: FrameError) -> Self {
        match e {
            FrameError::Io(e) => e,
            other => std::io::Error::new(std::io::ErrorKind::InvalidData, other),
        }
    }
}

/// Writes one frame whose body is the concatenation of `body` (written piece by piece, never
/// copied together) and returns the bytes written, length word included. Does not flush.
pub async fn write_frame<W: AsyncWrite + Unpin>(
    w: &mut W,
    body: &[&[u8]],
) -> Result<usize, FrameError> {
    let body_len: usize = body.iter().map(|b| b.len()).sum();
    let len = u32::try_from(body_len).map_err(|_| FrameError::TooLarge {
        len: body_len,
        max: u32::MAX as usize,
    })?;
    w.write_all(&len.to_le_bytes()).await?;
    for piece in body {
        w.write_all(piece).await?;
    }
    Ok(body_len + LENGTH_BYTES)
}

/// Reads one frame's body into `buf` (replacing its contents; the allocation is kept, so a
/// stream of frames allocates once), refusing a body over `max` bytes before growing `buf`.
/// Returns the bytes read, length word included.
pub async fn read_frame_into<R: AsyncRead + Unpin>(
    r: &mut R,
    max: usize,
    buf: &mut Vec<u8>,
) -> Result<usize, FrameError> {
    let mut len = [0u8; LENGTH_BYTES];
    r.read_exact(&mut len).await?;
    let len = u32::from_le_bytes(len) as usize;
    if len > max {
        return Err(FrameError::TooLarge { len, max });
    }
    if buf.len() < len {
        buf.resize(len, 0);
    }
    buf.truncate(len);
    r.read_exact(buf).await?;
    Ok(len + LENGTH_BYTES)
}

/// Writes one frame whose body is a one-byte `tag` followed by the concatenation of `body`
/// (for protocols that mix message and data frames on one stream). Returns the bytes written.
pub async fn write_tagged_frame<W: AsyncWrite + Unpin>(
    w: &mut W,
    tag: u8,
    body: &[&[u8]],
) -> Result<usize, FrameError> {
    let body_len = 1 + body.iter().map(|b| b.len()).sum::<usize>();
    let len = u32::try_from(body_len).map_err(|_| FrameError::TooLarge {
        len: body_len,
        max: u32::MAX as usize,
    })?;
    let mut head = [0u8; LENGTH_BYTES + 1];
    head[..LENGTH_BYTES].copy_from_slice(&len.to_le_bytes());
    head[LENGTH_BYTES] = tag;
    w.write_all(&head).await?;
    for piece in body {
        w.write_all(piece).await?;
    }
    Ok(body_len + LENGTH_BYTES)
}

/// Reads a frame written by [`write_tagged_frame`]: returns its tag and leaves the rest of the
/// body in `buf`, starting at `buf[0]` (so payloads keep the alignment of the buffer, which
/// the codecs' fast paths want). The whole body, tag included, is at most `max` bytes; an empty
/// body is malformed. Returns the tag and the bytes read, length word included.
pub async fn read_tagged_frame_into<R: AsyncRead + Unpin>(
    r: &mut R,
    max: usize,
    buf: &mut Vec<u8>,
) -> Result<(u8, usize), FrameError> {
    let mut head = [0u8; LENGTH_BYTES];
    r.read_exact(&mut head).await?;
    let len = u32::from_le_bytes(head) as usize;
    if len > max {
        return Err(FrameError::TooLarge { len, max });
    }
    if len == 0 {
        return Err(FrameError::Malformed("empty frame: no tag".into()));
    }
    let mut tag = [0u8; 1];
    r.read_exact(&mut tag).await?;
    if buf.len() < len - 1 {
        buf.resize(len - 1, 0);
    }
    buf.truncate(len - 1);
    r.read_exact(buf).await?;
    Ok((tag[0], len + LENGTH_BYTES))
}

/// Encodes `msg` with postcard into one frame and flushes: a message is always something the
/// peer waits for, and buffered streams (the fast lane) hold writes back until flushed.
/// Returns the bytes written.
pub async fn write_msg<W: AsyncWrite + Unpin, M: Serialize>(
    w: &mut W,
    msg: &M,
) -> Result<usize, FrameError> {
    let body = encode_msg(msg)?;
    let n = write_frame(w, &[&body]).await?;
    w.flush().await?;
    Ok(n)
}

/// Reads one frame of at most `max` bytes and decodes it as an `M`.
pub async fn read_msg<R: AsyncRead + Unpin, M: DeserializeOwned>(
    r: &mut R,
    max: usize,
) -> Result<M, FrameError> {
    let mut buf = Vec::new();
    read_frame_into(r, max, &mut buf).await?;
    decode_msg(&buf)
}

/// postcard-encodes a message (the body of a message frame).
pub fn encode_msg<M: Serialize>(msg: &M) -> Result<Vec<u8>, FrameError> {
    postcard::to_stdvec(msg).map_err(|e| FrameError::Malformed(format!("cannot encode: {e}")))
}

/// Decodes a message frame's body; trailing bytes are refused (a frame holds one message).
pub fn decode_msg<M: DeserializeOwned>(body: &[u8]) -> Result<M, FrameError> {
    match postcard::take_from_bytes(body) {
        Ok((m, [])) => Ok(m),
        Ok((_, rest)) => Err(FrameError::Malformed(format!(
            "{} trailing bytes after the message",
            rest.len()
        ))),
        Err(e) => Err(FrameError::Malformed(format!("undecodable message: {e}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::executor::block_on;
    use futures::io::Cursor;

    #[test]
    fn frames_round_trip_in_pieces_and_reuse_the_buffer() {
        block_on(async {
            let mut wire = Vec::new();
            let n = write_frame(&mut wire, &[b"ab", b"", b"cde"]).await.unwrap();
            assert_eq!(n, 9);
            write_frame(&mut wire, &[b"x"]).await.unwrap();
            let mut r = Cursor::new(wire);
            let mut buf = Vec::new();
            assert_eq!(read_frame_into(&mut r, 5, &mut buf).await.unwrap(), 9);
            assert_eq!(buf, b"abcde");
            let cap = buf.capacity();
            read_frame_into(&mut r, 5, &mut buf).await.unwrap();
            assert_eq!(buf, b"x");
            assert_eq!(buf.capacity(), cap);
            // End of stream between frames and inside one.
            assert!(matches!(
                read_frame_into(&mut r, 5, &mut buf).await,
                Err(FrameError::Io(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof
            ));
            let mut r = Cursor::new(vec![4, 0, 0, 0, 1, 2]);
            assert!(matches!(
                read_frame_into(&mut r, 5, &mut buf).await,
                Err(FrameError::Io(_))
            ));
        });
    }

    #[test]
    fn tagged_frames_keep_the_payload_at_the_start_of_the_buffer() {
        block_on(async {
            let mut wire = Vec::new();
            let n = write_tagged_frame(&mut wire, 7, &[b"ab", b"cd"])
                .await
                .unwrap();
            assert_eq!(n, 9);
            assert_eq!(&wire[..5], &[5, 0, 0, 0, 7]);
            let mut r = Cursor::new(wire);
            let mut buf = Vec::new();
            assert_eq!(
                read_tagged_frame_into(&mut r, 5, &mut buf).await.unwrap(),
                (7, 9)
            );
            assert_eq!(buf, b"abcd");
            let mut r = Cursor::new(vec![0, 0, 0, 0]);
            assert!(matches!(
                read_tagged_frame_into(&mut r, 5, &mut buf).await,
                Err(FrameError::Malformed(_))
            ));
            let mut r = Cursor::new(vec![6, 0, 0, 0, 1]);
            assert!(matches!(
                read_tagged_frame_into(&mut r, 5, &mut buf).await,
                Err(FrameError::TooLarge { len: 6, max: 5 })
            ));
        });
    }

    #[test]
    fn oversized_garbage_and_trailing_bytes_are_refused() {
        block_on(async {
            let mut buf = Vec::new();
            let mut r = Cursor::new(vec![6, 0, 0, 0, 1, 2, 3, 4, 5, 6]);
            assert!(matches!(
                read_frame_into(&mut r, 5, &mut buf).await,
                Err(FrameError::TooLarge { len: 6, max: 5 })
            ));
            assert!(buf.capacity() < 6, "nothing allocated for a refused frame");
            // A u32 that is not valid postcard for a String of that length.
            let mut r = Cursor::new(vec![2, 0, 0, 0, 0xff, 0xff]);
            assert!(matches!(
                read_msg::<_, String>(&mut r, 64).await,
                Err(FrameError::Malformed(_))
            ));
            let mut body = encode_msg(&7u32).unwrap();
            body.push(0);
            assert!(matches!(
                decode_msg::<u32>(&body),
                Err(FrameError::Malformed(_))
            ));
            let io: std::io::Error = FrameError::TooLarge { len: 9, max: 1 }.into();
            assert_eq!(io.kind(), std::io::ErrorKind::InvalidData);
        });
    }
}
