//! [`NodeError`]: what can go wrong when starting, running and using a node, with messages
//! that say how to fix it where the user can.

use thiserror::Error;

use starling_dht::DhtError;

/// Errors from starting, running and using a node.
#[derive(Debug, Error)]
pub enum NodeError {
    /// A file (identity, swarm key) could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file involved.
        path: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The identity file does not hold a valid key.
    #[error("identity file {path} is invalid: {reason}")]
    Identity {
        /// The file involved.
        path: String,
        /// What is wrong.
        reason: String,
    },
    /// The swarm key file is malformed.
    #[error("swarm key {path} is invalid: {reason} (create one with `starling init-swarm`)")]
    SwarmKey {
        /// The file involved.
        path: String,
        /// What is wrong.
        reason: String,
    },
    /// The configuration is inconsistent.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The transport stack could not be built.
    #[error("transport setup failed: {0}")]
    Transport(String),
    /// A listen address could not be bound.
    #[error("cannot listen on {addr}: {reason}")]
    Listen {
        /// The address.
        addr: String,
        /// Why.
        reason: String,
    },
    /// None of the bootstrap peers could be reached.
    #[error("none of the {tried} bootstrap peers answered after {attempts} attempts (last error: {last_error}); check the addresses, that the peers run, and that you use the same swarm key")]
    Bootstrap {
        /// How many addresses were tried.
        tried: usize,
        /// Attempts per address.
        attempts: u32,
        /// The last dial error seen.
        last_error: String,
    },
    /// Dialing a peer failed.
    #[error("dial {addr} failed: {reason}")]
    Dial {
        /// The address dialed.
        addr: String,
        /// Why.
        reason: String,
    },
    /// A record or key was refused by local validation.
    #[error(transparent)]
    Dht(#[from] DhtError),
    /// A PUT reached fewer peers than required.
    #[error("record {key:?} was stored locally but acknowledged by {acknowledged} of the {required} peers required")]
    QuorumFailed {
        /// The key.
        key: String,
        /// Peers that acknowledged.
        acknowledged: usize,
        /// Peers required.
        required: usize,
    },
    /// An operation ran past its deadline.
    #[error("{0} timed out")]
    Timeout(&'static str),
    /// No fast lane could be had (disabled, client mode, relayed connection, refused or
    /// failed handshake): fall back to libp2p streams.
    #[error("fast lane: {0}")]
    FastLane(String),
    /// The node has shut down.
    #[error("the node has shut down")]
    Closed,
}

/// `error` and every error in its source chain, joined with ": " (empty messages skipped):
/// libp2p's transport errors print nothing of their own (`TransportError::Other` displays as
/// an empty string) and keep the OS error ("Address already in use", "Too many open files")
/// as their source, so `to_string()` alone lost exactly the cause a user needs.
///
/// ```
/// use std::io;
/// let os = io::Error::from(io::ErrorKind::AddrInUse);
/// let wrapped = libp2p::TransportError::Other(os);
/// assert_eq!(wrapped.to_string(), "");
/// assert!(starling_node::error_chain(&wrapped).contains("in use"));
/// ```
pub fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut next = Some(error);
    while let Some(e) = next {
        let text = e.to_string();
        // A wrapper that repeats its source's message adds nothing.
        if !text.is_empty() && !parts.last().is_some_and(|p| p.contains(&text)) {
            parts.push(text);
        }
        next = e.source();
    }
    if parts.is_empty() {
        format!("{error:?}")
    } else {
        parts.join(": ")
    }
}
