//! Every message of the averaging protocols, and their framing.
//!
//! Frames are `starling_node::framing` frames (a little-endian `u32` length, then the body,
//! never more than the configured `max_frame_bytes`). The first byte of a body is its tag:
//! [`TAG_CONTROL`] bodies carry a postcard-encoded message, [`TAG_DATA`] bodies carry one chunk
//! in the `starling_compression` wire format. A control body is exactly the postcard encoding
//! of [`Control`] (variant index 0 is the tag), so a stream's first message is read with the
//! node's generic message reader.

use futures::{AsyncRead, AsyncWrite};
use serde::{de::DeserializeOwned, Deserialize, Serialize};
use starling_node::{framing, StreamProtocol};

use crate::config::AveragingMode;
use crate::verify::{Evidence, Reveal, Seal};
use crate::AveragerError;

/// Matchmaking: join requests, then the leader's begin or disband.
pub const MATCHMAKING_PROTOCOL: StreamProtocol =
    StreamProtocol::new("/starling/averager/matchmaking/2");
/// All-reduce: a sender's span to a reducer, and the reducer's averaged delta back (also a
/// re-delegated part of a failed reducer's span to a surviving reducer).
pub const REDUCE_PROTOCOL: StreamProtocol = StreamProtocol::new("/starling/averager/reduce/1");

/// Gossip: one pairwise push-pull exchange (the initiator's values, the responder's difference
/// back, the initiator's confirmation), see [`crate::gossip`].
pub const GOSSIP_PROTOCOL: StreamProtocol = StreamProtocol::new("/starling/averager/gossip/1");

/// Tag of a frame holding a postcard control message.
pub const TAG_CONTROL: u8 = 0;
/// Tag of a frame holding a compressed tensor chunk.
pub const TAG_DATA: u8 = 1;
/// Largest control message, in bytes (a begin message lists at most 256 members).
pub const MAX_CONTROL_BYTES: usize = 256 * 1024;

/// What a peer tells others about itself when it searches for a group.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MemberInfo {
    /// The peer id, as bytes.
    pub peer_id: Vec<u8>,
    /// How it takes part.
    pub mode: AveragingMode,
    /// Its measured or declared bandwidth, bytes per second.
    pub bandwidth: f64,
    /// Addresses it can be dialed at (empty for clients).
    pub addrs: Vec<String>,
    /// The caller's round tag ([`crate::Averager::set_round_tag`], e.g. a training epoch):
    /// peers with different tags never group, and a peer that finds another searching with a
    /// greater tag ends its search at once ([`crate::AveragerError::Behind`]). 0 unless set.
    pub tag: u64,
}

/// The value a searching peer stores in the DHT under the group key.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Declaration {
    /// The peer.
    pub info: MemberInfo,
    /// End of its search window (unix ms); the earliest window leads.
    pub window_end: u64,
}

/// Matchmaking messages.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum MatchMsg {
    /// Follower to leader: take me into your group.
    Join {
        /// The group key both searched under (prefix, schema hash, grid bits).
        group_key: String,
        /// The follower.
        info: MemberInfo,
        /// The follower's own window end. A leader accepts only followers it still ranks ahead
        /// of with its *current* window (the follower may have read an older declaration);
        /// otherwise it refuses with [`RejectReason::Stale`].
        window_end: u64,
    },
    /// Leader to follower: you are in; wait for `Begin`.
    Accepted,
    /// Leader to follower: no.
    Rejected(RejectReason),
    /// Leader to followers: the group is final; run the all-reduce.
    Begin {
        /// Identifies the round on reduce streams.
        round_id: u64,
        /// Every member, the leader first (member `i` reduces span `i`).
        members: Vec<MemberInfo>,
    },
    /// Leader to followers: the group did not reach its minimum size; search again.
    Disband,
}

/// Why a join request was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum RejectReason {
    /// Not searching under that key (never was, or done).
    NotSearching,
    /// Following another leader, or a client that cannot lead.
    NotLeading,
    /// The group is full or has begun.
    Full,
    /// Busy with its own join request; try again shortly.
    Busy,
    /// The follower ranked this peer by an old declaration; under the current one the follower
    /// is ahead. Read the group key again.
    Stale,
    /// The join request describes the follower impossibly (a peer id that does not parse, a
    /// bandwidth that is not a positive finite number).
    Invalid,
    /// The follower's round tag is not the leader's (see [`MemberInfo::tag`]).
    OtherRound,
    /// The leader holds evidence that the follower broke the all-reduce (see
    /// [`crate::verify`]) and refuses it for the rest of the run.
    Banned,
}

/// All-reduce control messages.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum ReduceMsg {
    /// Sender to reducer, first frame: who sends what.
    Hello {
        /// The round.
        round_id: u64,
        /// The sender's index in the member list.
        sender: MemberIdx,
        /// The sender's averaging weight (finite, >= 0).
        weight: f64,
        /// First element of the span (in the flattened vector).
        start: u64,
        /// Elements in the span.
        len: u64,
    },
    /// Reducer to sender: hello accepted, send the data. (libp2p-stream drops inbound streams
    /// that arrive while its accept queue is busy; waiting for this tells a dropped stream, to be
    /// retried, from a slow reducer.)
    Ready,
    /// Sender to reducer: every chunk of the span has been sent.
    SendDone,
    /// Reducer to sender: the part `start..start + len` of the span (offsets within the span)
    /// was averaged over these members; the sender's delta chunks for it follow (offsets within
    /// the part; with the exact codec `none`, the part's mean itself, so every member ends with
    /// the same bits). Parts come in order and cover the span before `ResultDone`.
    Result {
        /// First element of the part, counted from the start of the span.
        start: u64,
        /// Elements in the part.
        len: u64,
        /// Indices of the members whose data is in the part's average.
        contributors: Vec<MemberIdx>,
    },
    /// Reducer to sender: every delta chunk has been sent.
    ResultDone,
    /// Reducer to sender: the span could not be averaged with you (reason).
    Excluded(String),
    /// Sender to a surviving reducer, first frame of a re-delegation: reducer `failed` did not
    /// return its span, and by the sender's repair plan this reducer takes the part
    /// `start..start + len` of it. Then as after [`ReduceMsg::Hello`]: `Ready`, the sender's
    /// original values of the part, `SendDone`, and the `Result` with its deltas.
    RepairHello {
        /// The round.
        round_id: u64,
        /// The sender's index in the member list.
        sender: MemberIdx,
        /// The sender's averaging weight (finite, >= 0).
        weight: f64,
        /// Index of the reducer whose span is repaired.
        failed: MemberIdx,
        /// First element of the part (in the flattened vector).
        start: u64,
        /// Elements in the part.
        len: u64,
    },
    /// Sender to reducer, after each data chunk when the group verifies
    /// ([`crate::AveragerConfig::verify`]): its signed root over the chunk's values (see
    /// [`crate::verify`]).
    Seal(Seal),
    /// Reducer to sender, after each part's delta chunks when the group verifies: its signed
    /// root over the part's result.
    ResultSeal(Seal),
    /// Verifier to reducer, first frame of a reduce stream: show block `block` of the part
    /// `start..start + len` (absolute) of your result in round `round_id`.
    Reveal {
        /// The round.
        round_id: u64,
        /// First element of the part.
        start: u64,
        /// Elements in the part.
        len: u64,
        /// The block ([`crate::verify::merkle::BLOCK`] elements each) within the part.
        block: u32,
    },
    /// Reducer to verifier: the block, every contributor's signed values of it and the signed
    /// result (or `Excluded` if it cannot show it).
    Revealed(Box<Reveal>),
    /// Member to member, the only frame of a reduce stream, when the group verifies: this
    /// member's round is back and its check (if it made one) is done; `evidence` if it caught
    /// a reducer lying. Members apply the round's results only once every member's verdict is
    /// in (or its wait is over), and never the span of a reducer that checked evidence accuses.
    Verdict {
        /// The round.
        round_id: u64,
        /// What this member's check proved, if it caught a liar.
        evidence: Option<Box<Evidence>>,
    },
    /// Member to member, the only frame of a reduce stream: the sender, listed in round
    /// `round_id`'s group, refused that group (it holds a peer proven to have lied) and takes
    /// no part in it. Its part is not waited for; its span, as any failed reducer's, is
    /// re-delegated (its own peer answers hellos for the round at once with
    /// [`UNKNOWN_ROUND`]).
    Declined {
        /// The round.
        round_id: u64,
        /// The sender's index in the member list.
        sender: MemberIdx,
    },
}

/// What a gossiping peer stores in the DHT under `{prefix}.gossip`, in a sub-key under its own
/// owner marker (so only it can write it), with an expiration of the membership TTL.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GossipDeclaration {
    /// The peer id, as bytes (must be the owner marker's peer).
    pub peer_id: Vec<u8>,
    /// Addresses it can be dialed at.
    pub addrs: Vec<String>,
    /// Hash of what it averages (element count and codec): only equal schemas exchange.
    pub schema: u64,
}

/// Gossip exchange messages, in protocol order. The initiator opens with `Hello`; the responder
/// answers `Ready` (then the initiator's value chunks and `SendDone`; the responder's difference
/// chunks and `DiffDone`; the initiator's `Applied`) or refuses with `Busy`, `NotServing` or
/// `Refused`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum GossipMsg {
    /// Initiator to responder: an exchange of `len` values under the run `prefix`.
    Hello {
        /// The run (the gossip averager's prefix).
        prefix: String,
        /// Hash of element count and codec.
        schema: u64,
        /// Elements in the vector.
        len: u64,
        /// The initiator's weight (finite, >= 0).
        weight: f64,
        /// The mixing weight both sides apply (0 < alpha <= 1).
        alpha: f64,
    },
    /// Responder to initiator: locked for this exchange; its weight.
    Ready {
        /// The responder's weight (finite, >= 0).
        weight: f64,
    },
    /// Responder to initiator: in another exchange right now; try again shortly.
    Busy,
    /// Responder to initiator: it has no values to average yet (or any more).
    NotServing,
    /// Responder to initiator: the exchange cannot happen (reason): another run or schema.
    Refused(String),
    /// Initiator to responder: every value chunk has been sent.
    SendDone,
    /// Responder to initiator: every difference chunk has been sent.
    DiffDone,
    /// Initiator to responder: the difference was applied; apply yours.
    Applied,
}

/// The reason in [`ReduceMsg::Excluded`] when the addressed peer is not (or no longer) running
/// the round: for the sender, that reducer has failed.
pub const UNKNOWN_ROUND: &str = "unknown round";

/// A member's index in the group's member list (the leader first; member `i` reduces span `i`).
/// Groups have at most 256 members, so every index fits; this is the one place indices change
/// type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct MemberIdx(pub u32);

impl MemberIdx {
    /// The index of member `i` of a group.
    pub fn of(i: usize) -> Self {
        debug_assert!(i <= u32::MAX as usize);
        MemberIdx(i as u32)
    }

    /// As a position in the member list. A received index must be checked against the group
    /// size before use ([`MemberIdx::within`]).
    pub fn get(self) -> usize {
        self.0 as usize
    }

    /// `Some(position)` if this index names a member of a group of `n`.
    pub fn within(self, n: usize) -> Option<usize> {
        (self.get() < n).then_some(self.get())
    }

    /// Every member index of a group of `n`.
    pub fn all(n: usize) -> impl Iterator<Item = MemberIdx> {
        (0..n).map(MemberIdx::of)
    }
}

impl std::fmt::Display for MemberIdx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// A control frame's body as postcard sees it: the variant index is [`TAG_CONTROL`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Control<M> {
    /// The message.
    Control(M),
}

/// A frame read off a stream.
pub enum Frame<M> {
    /// A control message.
    Control(M),
    /// A data chunk (compression wire format), left at the start of the caller's buffer.
    Data,
}

/// Writes a control message and flushes the stream (a control message is always something
/// the peer waits for; buffered streams, like the fast lane, hold writes until flushed).
pub async fn write_control<S: AsyncWrite + Unpin, M: Serialize>(
    s: &mut S,
    msg: &M,
) -> Result<usize, AveragerError> {
    Ok(framing::write_msg(s, &Control::Control(msg)).await?)
}

/// Writes a data frame holding one encoded chunk.
pub async fn write_data<S: AsyncWrite + Unpin>(
    s: &mut S,
    chunk: &[u8],
) -> Result<usize, AveragerError> {
    Ok(framing::write_tagged_frame(s, TAG_DATA, &[chunk]).await?)
}

/// The data frames of a span: uncompressed chunks go out straight from the values (header from
/// [`starling_compression::raw_frame_header`], no encode copy), other codecs through the encoder
/// into one reused buffer.
pub(crate) enum SpanChunks<'a> {
    Raw {
        data: &'a [f32],
        per_chunk: usize,
        next: usize,
    },
    Encoded {
        chunks: starling_compression::SplitChunks<'a>,
        buf: Vec<u8>,
    },
}

/// One data frame of [`SpanChunks`].
pub(crate) enum ChunkOut<'a> {
    Raw {
        values: &'a [f32],
        offset: usize,
        total: usize,
    },
    Encoded(&'a [u8]),
}

impl<'a> SpanChunks<'a> {
    pub fn new(
        codec: starling_compression::Codec,
        data: &'a [f32],
        chunk_bytes: usize,
        zstd_level: Option<i32>,
    ) -> Result<Self, AveragerError> {
        let err = |e: starling_compression::Error| AveragerError::Protocol(e.to_string());
        // The raw path writes f32 in memory order: little-endian hosts only.
        if codec == starling_compression::Codec::None
            && zstd_level.is_none()
            && cfg!(target_endian = "little")
        {
            let per_chunk = starling_compression::elements_per_chunk(codec, chunk_bytes)
                .map_err(err)?
                .max(1);
            return Ok(SpanChunks::Raw {
                data,
                per_chunk,
                next: 0,
            });
        }
        let opts = starling_compression::EncodeOptions {
            zstd_level,
            ..Default::default()
        };
        Ok(SpanChunks::Encoded {
            chunks: starling_compression::split_chunks(codec, data, chunk_bytes, &opts)
                .map_err(err)?,
            buf: Vec::new(),
        })
    }

    /// The next frame; `None` after the last.
    pub fn next_chunk(&mut self) -> Option<Result<ChunkOut<'_>, AveragerError>> {
        match self {
            SpanChunks::Raw {
                data,
                per_chunk,
                next,
            } => {
                if *next >= data.len() {
                    return None;
                }
                let offset = *next;
                let end = (offset + *per_chunk).min(data.len());
                *next = end;
                Some(Ok(ChunkOut::Raw {
                    values: &data[offset..end],
                    offset,
                    total: data.len(),
                }))
            }
            SpanChunks::Encoded { chunks, buf } => match chunks.next_into(buf)? {
                Ok(_) => Some(Ok(ChunkOut::Encoded(buf))),
                Err(e) => Some(Err(AveragerError::Protocol(e.to_string()))),
            },
        }
    }
}

/// Writes one data frame of [`SpanChunks`].
pub(crate) async fn write_chunk<S: AsyncWrite + Unpin>(
    s: &mut S,
    chunk: &ChunkOut<'_>,
) -> Result<usize, AveragerError> {
    match chunk {
        ChunkOut::Encoded(bytes) => write_data(s, bytes).await,
        ChunkOut::Raw {
            values,
            offset,
            total,
        } => {
            let header =
                starling_compression::raw_frame_header(values.len(), *offset as u64, *total as u64)
                    .map_err(|e| AveragerError::Protocol(e.to_string()))?;
            Ok(
                framing::write_frame(s, &[&[TAG_DATA], &header, bytemuck::cast_slice(values)])
                    .await?,
            )
        }
    }
}

/// Reads one frame into a reusable buffer (which only grows, so a stream of chunks allocates
/// and zeroes its buffer once), refusing anything longer than `max_frame_bytes` before
/// allocating. A data chunk is left in `buf`, from its start (aligned for the codecs' fast
/// paths). Returns the frame and the bytes read.
pub async fn read_frame_into<S: AsyncRead + Unpin, M: DeserializeOwned>(
    s: &mut S,
    max_frame_bytes: usize,
    buf: &mut Vec<u8>,
) -> Result<(Frame<M>, usize), AveragerError> {
    let (tag, n) = framing::read_tagged_frame_into(s, max_frame_bytes, buf).await?;
    let frame = match tag {
        TAG_CONTROL => {
            if buf.len() > MAX_CONTROL_BYTES {
                return Err(AveragerError::Protocol(format!(
                    "control message of {} bytes (limit {MAX_CONTROL_BYTES})",
                    buf.len()
                )));
            }
            Frame::Control(framing::decode_msg(buf)?)
        }
        TAG_DATA => Frame::Data,
        t => return Err(AveragerError::Protocol(format!("unknown frame tag {t}"))),
    };
    Ok((frame, n))
}

/// Reads a frame that must be a control message (at most [`MAX_CONTROL_BYTES`]).
pub async fn read_control<S: AsyncRead + Unpin, M: DeserializeOwned>(
    s: &mut S,
) -> Result<M, AveragerError> {
    let Control::Control(m) = framing::read_msg(s, MAX_CONTROL_BYTES + 1).await?;
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn frames_round_trip_and_limits_hold() {
        let mut buf = Vec::new();
        write_control(&mut buf, &MatchMsg::Rejected(RejectReason::Full))
            .await
            .unwrap();
        write_data(&mut buf, &[1, 2, 3]).await.unwrap();
        // The control frame's bytes are the historical ones: length, tag 0, postcard body.
        assert_eq!(&buf[..7], &[3, 0, 0, 0, TAG_CONTROL, 2, 2]);
        let mut r = futures::io::Cursor::new(buf.clone());
        let m: MatchMsg = read_control(&mut r).await.unwrap();
        assert!(matches!(m, MatchMsg::Rejected(RejectReason::Full)));
        let mut chunk = Vec::new();
        match read_frame_into::<_, MatchMsg>(&mut r, 1024, &mut chunk)
            .await
            .unwrap()
        {
            (Frame::Data, 8) => assert_eq!(chunk, [1, 2, 3]),
            _ => panic!("expected a data frame of 8 bytes"),
        }
        // Oversized length prefix: refused before allocation.
        let mut r = futures::io::Cursor::new(vec![0xff, 0xff, 0xff, 0x7f, 0]);
        assert!(read_frame_into::<_, MatchMsg>(&mut r, 1 << 20, &mut chunk)
            .await
            .is_err());
        // Unknown tag, empty frame, truncated body, garbage control.
        for bad in [
            vec![2, 0, 0, 0, 9, 0],
            vec![0, 0, 0, 0],
            vec![10, 0, 0, 0, 0, 1],
            vec![3, 0, 0, 0, 0, 0xff, 0xff],
        ] {
            let mut r = futures::io::Cursor::new(bad);
            assert!(read_frame_into::<_, MatchMsg>(&mut r, 1024, &mut chunk)
                .await
                .is_err());
        }
        // A data frame where a control message must come.
        let mut r = futures::io::Cursor::new(vec![2, 0, 0, 0, TAG_DATA, 0]);
        assert!(read_control::<_, MatchMsg>(&mut r).await.is_err());
    }

    #[test]
    fn member_indices_are_checked_against_the_group() {
        assert_eq!(MemberIdx::of(3).within(4), Some(3));
        assert_eq!(MemberIdx(4).within(4), None);
        assert_eq!(MemberIdx(u32::MAX).within(256), None);
        assert_eq!(
            MemberIdx::all(3).collect::<Vec<_>>(),
            [MemberIdx(0), MemberIdx(1), MemberIdx(2)]
        );
    }
}
