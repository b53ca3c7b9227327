//! The byte stream a reduce exchange runs on: a fast lane when both peers have one, otherwise a
//! libp2p stream.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use futures::{AsyncRead, AsyncWrite};
use starling_node::{FastStream, Stream};

/// A reduce exchange's stream. Writes on a fast lane are buffered: the frame writers flush
/// where the peer must see what was written.
pub(crate) enum Lane {
    P2p(Stream),
    Fast(Box<FastStream>),
}

pub(crate) type LaneReader = Box<dyn AsyncRead + Send + Unpin>;
pub(crate) type LaneWriter = Box<dyn AsyncWrite + Send + Unpin>;

impl Lane {
    /// Read and write halves for concurrent use. A fast lane's halves are independent (each
    /// encrypts or decrypts in its own task); a libp2p stream's share a lock.
    pub fn split(self) -> (LaneReader, LaneWriter) {
        match self {
            Lane::P2p(s) => {
                let (r, w) = futures::AsyncReadExt::split(s);
                (Box::new(r), Box::new(w))
            }
            Lane::Fast(s) => {
                let (r, w) = (*s).into_split();
                (Box::new(r), Box::new(w))
            }
        }
    }

    pub fn is_fast(&self) -> bool {
        matches!(self, Lane::Fast(_))
    }
}

impl AsyncRead for Lane {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Lane::P2p(s) => Pin::new(s).poll_read(cx, buf),
            Lane::Fast(s) => Pin::new(&mut **s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Lane {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Lane::P2p(s) => Pin::new(s).poll_write(cx, buf),
            Lane::Fast(s) => Pin::new(&mut **s).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Lane::P2p(s) => Pin::new(s).poll_flush(cx),
            Lane::Fast(s) => Pin::new(&mut **s).poll_flush(cx),
        }
    }

    fn poll_close(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Lane::P2p(s) => Pin::new(s).poll_close(cx),
            Lane::Fast(s) => Pin::new(&mut **s).poll_close(cx),
        }
    }
}
