//! The experts' section of a node's board (see [`starling_node::board`]): which experts the
//! node hosts, as its heartbeat tells the swarm.

use serde::{Deserialize, Serialize};
use starling_node::board::Section;

/// Most expert uids a board lists (the rest are counted in [`ExpertsBoard::total`]).
pub const MAX_EXPERTS_LISTED: usize = 32;
/// Longest uid a board lists, in bytes (longer uids are cut).
pub const MAX_UID_LEN: usize = 128;

/// The experts a node hosts.
///
/// ```
/// use starling_experts::ExpertsBoard;
/// let uids: Vec<String> = (0..40).map(|i| format!("ffn.0.{i}")).collect();
/// let b = ExpertsBoard::new(&uids);
/// assert_eq!((b.listed.len(), b.total), (32, 40));
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExpertsBoard {
    /// Uids of hosted experts (at most [`MAX_EXPERTS_LISTED`], each at most
    /// [`MAX_UID_LEN`] bytes).
    pub listed: Vec<String>,
    /// How many experts the node hosts in all.
    pub total: usize,
}

impl ExpertsBoard {
    /// The section for a node hosting `uids`, within the bounds.
    pub fn new(uids: &[String]) -> Self {
        ExpertsBoard {
            listed: uids
                .iter()
                .take(MAX_EXPERTS_LISTED)
                .map(|u| starling_node::board::cut(u, MAX_UID_LEN))
                .collect(),
            total: uids.len(),
        }
    }
}

impl Section for ExpertsBoard {
    const NAME: &'static str = "experts";
    const VERSION: u32 = 1;
}
