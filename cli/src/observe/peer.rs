//! A peer as `starling status` and the dashboard show it: its heartbeat, with the board's
//! sections decoded by the components' types (the JSON shape both have always printed).

use serde::Serialize;
use starling_averager::AveragerBoard;
use starling_experts::ExpertsBoard;
use starling_node::board::Section;
use starling_node::heartbeat::{Heartbeat, Mode};
use starling_node::Reachability;
use starling_training::TrainingBoard;

/// One live peer.
#[derive(Debug, Clone, Serialize)]
pub struct PeerView {
    /// Its peer id.
    pub peer_id: String,
    /// Its software version.
    pub version: String,
    /// Node or client.
    pub mode: Mode,
    /// Reachability as autonat sees it.
    pub reachability: Reachability,
    /// Peers connected when it sent the heartbeat.
    pub connected_peers: usize,
    /// Measured averaging bandwidth, bytes per second (0: not measured).
    pub bandwidth: f64,
    /// The run it trains in, and how far it is.
    pub training: Option<TrainingBoard>,
    /// Experts hosted (the first few).
    pub experts: Vec<String>,
    /// How many experts it hosts in all.
    pub experts_total: usize,
    /// Sections of its board this binary does not know (a newer peer's).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub other_sections: Vec<String>,
    /// When the heartbeat was sent (unix ms).
    pub time_ms: u64,
    /// When it expires (unix ms).
    pub expires_ms: u64,
}

impl From<&Heartbeat> for PeerView {
    fn from(hb: &Heartbeat) -> Self {
        let experts = hb.board.get::<ExpertsBoard>();
        let known = [AveragerBoard::NAME, TrainingBoard::NAME, ExpertsBoard::NAME];
        PeerView {
            peer_id: hb.peer_id.clone(),
            version: hb.version.clone(),
            mode: hb.mode,
            reachability: hb.reachability,
            connected_peers: hb.connected_peers,
            bandwidth: hb
                .board
                .get::<AveragerBoard>()
                .map_or(0.0, |a| a.bandwidth)
                .max(0.0),
            training: hb.board.get::<TrainingBoard>(),
            experts_total: experts.as_ref().map_or(0, |e| e.total),
            experts: experts.map(|e| e.listed).unwrap_or_default(),
            other_sections: hb
                .board
                .names()
                .filter(|n| !known.contains(n))
                .map(str::to_string)
                .collect(),
            time_ms: hb.time_ms,
            expires_ms: hb.expires_ms,
        }
    }
}
