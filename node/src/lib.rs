//! The Starling libp2p host.
//!
//! One tokio task owns the libp2p `Swarm`; the rest of the program holds a cheap, cloneable
//! [`Node`] handle that sends commands over a bounded channel and awaits replies on oneshots.
//! No lock is held across an await.
//!
//! What a node runs:
//! - transports: TCP + noise + yamux, and QUIC in public swarms; in a **private swarm**
//!   ([`SwarmKey`]) TCP is wrapped in libp2p `pnet` with a 256-bit pre-shared key and QUIC is
//!   disabled, because pnet covers TCP only (a keyless peer could otherwise connect over QUIC);
//! - identify, ping, autonat (reachability), relay client + dcutr (hole punching), and a relay
//!   server where configured ([`NodeConfig::relay_server`]). A node that autonat finds private
//!   switches Kademlia to client mode and reserves relay slots by itself ([`NatConfig`]); what
//!   happens is reported as [`NatEvent`]s ([`Node::nat_events`]);
//! - Kademlia over a [`starling_dht::DhtStore`] with `StoreInserts::FilterBoth`: every inbound PUT
//!   is validated and merged by our store, never stored blindly;
//! - `libp2p-stream` for bulk data protocols (averaging, experts): see [`Node::stream_control`];
//! - the **fast lane** ([`fastlane`]): direct AES-256-GCM TCP connections, requested over an
//!   authenticated libp2p stream, for transfers that would saturate one libp2p connection
//!   ([`Node::open_fast`], [`Node::accept_fast`]).
//!
//! Observability: [`metrics`] (the node's Prometheus registry, shared by everything running on it,
//! [`Node::metrics`]) and [`heartbeat`] (an owner-signed record per node in the DHT, from which
//! `starling status` and dashboards list the live swarm).
//!
//! Modules for protocol authors: [`framing`] (length-prefixed postcard frames with a hard size
//! limit, the one framing every stream protocol uses), [`streams`] (opening streams the other
//! side really accepted, serving inbound ones), [`fastlane`], and [`cluster`] (many nodes on
//! loopback for tests, benches and demos).
//!
//! Every task a node runs (its swarm task, fast lane loops and handshakes) runs in a
//! `node{peer=<last 6 characters of the peer id>}` tracing span ([`Node::span`]), so the logs of
//! several nodes in one process can be told apart. Poisoned locks are recovered, not
//! propagated: no critical section in this crate can leave its data half-updated.
//!
//! **Client mode** ([`NodeConfig::client_mode`]) is for peers that cannot or should not accept
//! inbound connections: they listen on nothing and run Kademlia in client mode, so they never
//! appear in others' routing tables, but can still read and write records.
//!
//! ```no_run
//! # async fn demo() -> Result<(), starling_node::NodeError> {
//! use starling_node::{Node, NodeConfig};
//! let node = Node::start(NodeConfig::default().listen_on("/ip4/127.0.0.1/tcp/0".parse().unwrap())).await?;
//! println!("dial me at {:?}", node.listen_addrs().await?);
//! node.store("hello", "me", &"world".to_string(), starling_dht::now_ms() + 60_000).await?;
//! let values: Vec<(String, String, u64)> = node.get("hello").await?;
//! node.shutdown().await;
//! # Ok(()) }
//! ```

#![warn(missing_docs)]

mod behaviour;
pub mod board;
pub mod cluster;
mod config;
mod control;
mod down;
mod error;
pub mod fastlane;
pub mod framing;
pub mod heartbeat;
mod identity;
pub mod metrics;
mod node;
pub mod simdelay;
pub mod streams;
mod swarm_key;

pub use config::{
    ConnectionLimits, NatConfig, NodeConfig, RelayServerConfig, DEFAULT_KAD_PROTOCOL,
};
pub use down::{DownPeers, PeerDown, DOWN_FOR};
pub use error::{error_chain, NodeError};
pub use fastlane::{FastReader, FastStream, FastWriter, IncomingFast};
pub use identity::{load_or_create_identity, owner_key_of, owner_of_peer, peer_id_of_owner};
pub use node::{BootstrapReport, NatEvent, Node, NodeStatus, PutReport, Reachability};
/// Locks, and the workspace's one policy for poisoned ones (see the module).
pub use starling_dht::lock;
pub use swarm_key::SwarmKey;

pub use control::{IncomingStreams, StreamControl};
pub use libp2p::{identity::Keypair, Multiaddr, PeerId, Stream, StreamProtocol};
pub use libp2p_stream::{AlreadyRegistered, OpenStreamError};
