//! Opening and accepting streams on custom protocols: `libp2p-stream`'s control, with each use
//! recorded for the connection manager (a peer we exchange streams with is a peer in use, and
//! its connection is the last to be pruned; see [`ConnectionLimits`](crate::ConnectionLimits)).

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Instant;

use libp2p::{PeerId, Stream, StreamProtocol};
use libp2p_stream::{AlreadyRegistered, OpenStreamError};

use crate::lock::lock;

/// When each peer last had a stream opened to or from it, shared by a node's handles and its
/// swarm task (which forgets peers it is no longer connected to).
#[derive(Clone, Default)]
pub(crate) struct StreamUsage(Arc<Mutex<HashMap<PeerId, Instant>>>);

impl StreamUsage {
    /// Records a stream with `peer` now.
    fn touch(&self, peer: PeerId) {
        self.touch_at(peer, Instant::now());
    }

    /// Records a stream with `peer` at `at`.
    pub(crate) fn touch_at(&self, peer: PeerId, at: Instant) {
        lock(&self.0).insert(peer, at);
    }

    /// When `peer` last had a stream.
    #[cfg(test)]
    pub(crate) fn last(&self, peer: &PeerId) -> Option<Instant> {
        lock(&self.0).get(peer).copied()
    }

    /// `f` of the whole table, under one lock.
    pub(crate) fn read<R>(&self, f: impl FnOnce(&HashMap<PeerId, Instant>) -> R) -> R {
        f(&lock(&self.0))
    }

    /// Forgets the peers for which `keep` is false.
    pub(crate) fn retain(&self, mut keep: impl FnMut(&PeerId, Instant) -> bool) {
        lock(&self.0).retain(|p, t| keep(p, *t));
    }
}

/// The handle for opening and accepting streams on custom protocols
/// ([`Node::stream_control`](crate::Node::stream_control)). Cheap to clone; each clone opens one
/// stream at a time (`libp2p-stream`'s backpressure).
///
/// ```no_run
/// # async fn demo(node: starling_node::Node, peer: starling_node::PeerId) -> Result<(), Box<dyn std::error::Error>> {
/// use futures::{AsyncWriteExt, StreamExt};
/// use starling_node::StreamProtocol;
/// const PROTO: StreamProtocol = StreamProtocol::new("/example/1");
/// let mut incoming = node.stream_control().accept(PROTO)?;
/// let mut stream = node.stream_control().open_stream(peer, PROTO).await?;
/// stream.write_all(b"hello").await?;
/// if let Some((from, _stream)) = incoming.next().await {
///     println!("a stream from {from}");
/// }
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct StreamControl {
    inner: libp2p_stream::Control,
    usage: StreamUsage,
}

impl StreamControl {
    pub(crate) fn new(inner: libp2p_stream::Control, usage: StreamUsage) -> Self {
        StreamControl { inner, usage }
    }

    /// Opens a stream to `peer` on `protocol`, dialing the peer if no connection is open.
    pub async fn open_stream(
        &mut self,
        peer: PeerId,
        protocol: StreamProtocol,
    ) -> Result<Stream, OpenStreamError> {
        self.usage.touch(peer);
        let stream = self.inner.open_stream(peer, protocol).await?;
        self.usage.touch(peer);
        Ok(stream)
    }

    /// Accepts inbound streams on `protocol` until the returned handle is dropped. One handle
    /// per protocol per node.
    pub fn accept(
        &mut self,
        protocol: StreamProtocol,
    ) -> Result<IncomingStreams, AlreadyRegistered> {
        Ok(IncomingStreams {
            inner: self.inner.accept(protocol)?,
            usage: self.usage.clone(),
        })
    }
}

/// Inbound streams on one protocol, with the peer that opened each.
#[must_use = "streams arrive only while this is polled"]
pub struct IncomingStreams {
    inner: libp2p_stream::IncomingStreams,
    usage: StreamUsage,
}

impl futures::Stream for IncomingStreams {
    type Item = (PeerId, Stream);

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let polled = Pin::new(&mut self.inner).poll_next(cx);
        if let Poll::Ready(Some((peer, _))) = &polled {
            self.usage.touch(*peer);
        }
        polled
    }
}
