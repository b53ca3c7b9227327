//! What gossip did: [`GossipReport`] per round, [`Exchange`] per exchange.

use std::time::Duration;

use starling_node::PeerId;

/// This peer's side of an exchange.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// This peer chose the neighbour and opened the exchange.
    Initiator,
    /// The neighbour opened it.
    Responder,
}

/// How an exchange ended.
#[derive(Debug, Clone, PartialEq)]
pub enum ExchangeOutcome {
    /// Both sides applied their update: the pair's weighted mass is unchanged.
    Averaged,
    /// The neighbour was in other exchanges (or not serving) for the whole busy patience: no
    /// exchange this round, no back-off.
    Busy,
    /// It failed (reason); nothing was applied on this side. The neighbour is backed off.
    Failed(String),
    /// Responder only: the difference went out but the initiator's confirmation never came, so
    /// this side did not apply its update. The initiator may have applied its own (if only the
    /// confirmation was lost), which moves the pair's mass by that one update.
    Unconfirmed(String),
}

/// One exchange with one neighbour.
#[derive(Debug, Clone, PartialEq)]
pub struct Exchange {
    /// The neighbour.
    pub peer: PeerId,
    /// This peer's side.
    pub role: Role,
    /// How it ended.
    pub outcome: ExchangeOutcome,
    /// This peer's weight in it.
    pub my_weight: f64,
    /// The neighbour's weight (0 when it never answered).
    pub peer_weight: f64,
    /// The fraction of the difference this peer moved by (`alpha * w_peer / (w_me + w_peer)`),
    /// 0 unless averaged.
    pub moved: f64,
    /// Bytes this peer sent and received in it (framing included).
    pub bytes_sent: u64,
    /// Bytes received.
    pub bytes_received: u64,
    /// Over the fast lane.
    pub fast_lane: bool,
}

impl Exchange {
    /// Whether both sides applied the exchange.
    pub fn averaged(&self) -> bool {
        self.outcome == ExchangeOutcome::Averaged
    }
}

/// What one gossip round did (a [`step`](super::GossipAverager::step), or one tick of the
/// background loop).
///
/// ```
/// # fn show(report: starling_averager::gossip::GossipReport) {
/// for e in report.exchanges.iter().chain(&report.served) {
///     println!("{} ({:?}): {:?}, {} bytes out", e.peer, e.role, e.outcome, e.bytes_sent);
/// }
/// println!("averaged with {} peers", report.averaged_with().len());
/// # }
/// ```
#[derive(Debug, Clone, Default)]
pub struct GossipReport {
    /// This peer's round counter (0 for its first round).
    pub round: u64,
    /// Live members this round's graph was built over (this peer included).
    pub members: usize,
    /// This peer's rank among them (`None` if it was not among them).
    pub rank: Option<usize>,
    /// The neighbours the topology gave this round, in order.
    pub targets: Vec<PeerId>,
    /// The exchanges this peer initiated this round.
    pub exchanges: Vec<Exchange>,
    /// Exchanges other peers initiated with this one since the previous report (at most the
    /// last 256).
    pub served: Vec<Exchange>,
    /// Bytes sent in both kinds of exchanges above.
    pub bytes_sent: u64,
    /// Bytes received in both.
    pub bytes_received: u64,
    /// How long the round took.
    pub duration: Duration,
}

impl GossipReport {
    /// The peers this one averaged with (either role), in order, with repeats.
    pub fn averaged_with(&self) -> Vec<PeerId> {
        self.exchanges
            .iter()
            .chain(&self.served)
            .filter(|e| e.averaged())
            .map(|e| e.peer)
            .collect()
    }
}
