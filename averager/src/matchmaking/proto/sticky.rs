//! A group that held the whole swarm re-forms around its agreed leader (see the parent
//! module's docs): [`Search::sticky`] and what the leader and its members do differently.

use super::{Action, Declaration, MemberInfo, Ms, Search, QUICK_ASK_SHARE};
use crate::config::AveragingMode;

impl Search {
    /// Lets the previous group re-form around its agreed leader if it held every peer
    /// expected (see the [parent module's docs](super)); the driver calls it for the first
    /// window of a search only (a window that ended without a group searches the usual way).
    pub fn sticky(mut self) -> Self {
        let whole = self.params.swarm == Some(self.previous.len() + 1)
            && self.previous.len() < self.params.target_group_size;
        if self.previous.is_empty() || !whole || self.me.mode == AveragingMode::Client {
            return self;
        }
        let leader = self
            .previous
            .iter()
            .chain(std::iter::once(&self.me.peer_id))
            .min()
            .cloned()
            .expect("not empty");
        if leader == self.me.peer_id {
            // Its members come at once: the first read waits a little.
            self.next_read = self.opened + self.params.first_refresh_ms;
        } else {
            self.sticky_retry = Some(self.opened);
            self.next_read = self.sticky_until();
        }
        self.sticky = Some(leader);
        self
    }

    /// Whether the driver declares this peer under the group key when the window opens: every
    /// peer but a member of a re-forming group that asks its leader directly and whose last
    /// join request was answered within a [`QUICK_ASK_SHARE`]th of the start grace. Nobody reads
    /// such a member's declaration: the leader takes its previous members without reading the
    /// key, and a newcomer asks the leader, which declares. It declares ([`Action::Declare`]) if
    /// it falls back to the usual search. (In a pair of glyphs MLP peers, a core each, the
    /// follower's declaration was one DHT write per 9 ms step, with the leader storing it.)
    ///
    /// Where asks are slow, members declare at once as before: a leader whose grace ends
    /// before its members' requests arrive begins with the declared peers that joined, and
    /// only a declaration tells it that a member is still on its way (four peers with 60 ms
    /// round trips: a member's request took 520 ms or more to reach its leader, whose grace
    /// was over; the leader began without it).
    pub fn declares_at_open(&self) -> bool {
        let quick = self
            .params
            .last_ask_ms
            .is_some_and(|t| t.saturating_mul(QUICK_ASK_SHARE) <= self.params.start_grace_ms);
        !(self.sticky_following() && quick)
    }

    /// Until when a member of a re-forming group asks its leader before it searches the usual
    /// way: half the start grace (at least one first refresh). The other half is for the
    /// members that fell back to find each other: a leader of the usual way begins without a
    /// late member of its previous group once its grace is over, and members whose windows
    /// opened up to half a grace apart all fall back before that.
    pub(super) fn sticky_until(&self) -> Ms {
        self.opened + (self.params.start_grace_ms / 2).max(self.params.first_refresh_ms)
    }

    /// Whether this peer leads a re-forming group.
    pub(super) fn sticky_leading(&self) -> bool {
        self.sticky.as_ref() == Some(&self.me.peer_id)
    }

    /// Whether this peer is a member (not the leader) of a re-forming group that still asks
    /// its leader directly.
    pub(super) fn sticky_following(&self) -> bool {
        !self.fell_back && self.sticky.is_some() && !self.sticky_leading()
    }

    /// The re-forming group's leader as a declaration: its peer id, this round's tag, and
    /// this peer's own window (its addresses are the node's to find: the two were connected).
    pub(super) fn sticky_leader(&self) -> Option<Declaration> {
        let leader = self.sticky.clone()?;
        Some(Declaration {
            info: MemberInfo {
                peer_id: leader,
                mode: AveragingMode::Node,
                bandwidth: 1.0,
                addrs: Vec::new(),
                tag: self.me.tag,
            },
            window_end: self.my_rank.0,
        })
    }

    /// A member of a re-forming group stops asking its leader: it declares itself (unless it
    /// did when its window opened) and searches the usual way, reading the key at once.
    pub(super) fn fall_back(&mut self, now: Ms, out: &mut Vec<Action>) {
        if !self.fell_back && !self.declares_at_open() {
            out.push(Action::Declare);
        }
        self.fell_back = true;
        self.sticky_retry = None;
        self.next_read = now;
    }
}
