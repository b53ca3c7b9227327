//! Members a round stops waiting for: those this peer could not reach at all as reducers, and
//! those its node found down while the round ran.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use starling_node::lock::lock;

use super::Round;
use crate::wire::MemberIdx;

/// How long a transfer with a member found down may still take to end by itself (see
/// [`Gone::unless_gone`]).
const DOWN_GRACE: std::time::Duration = std::time::Duration::from_secs(2);

/// Members found unreachable in a round, and a wake-up for the reduction waiting on them.
#[derive(Default)]
pub(super) struct Gone {
    members: Mutex<HashSet<MemberIdx>>,
    pub(super) changed: tokio::sync::Notify,
}

impl Gone {
    pub(super) fn insert(&self, member: MemberIdx) {
        if lock(&self.members).insert(member) {
            self.changed.notify_waiters();
        }
    }

    /// How many (a reduction compares it with what it last took in, so that an insert made
    /// while it was not waiting is not missed).
    pub(super) fn count(&self) -> usize {
        lock(&self.members).len()
    }

    pub(super) fn snapshot(&self) -> HashSet<MemberIdx> {
        lock(&self.members).clone()
    }

    /// Returns once `member` is gone.
    pub(super) async fn wait_for(&self, member: MemberIdx) {
        loop {
            // Created before the check: an insert between the check and the wait wakes it.
            let changed = self.changed.notified();
            if lock(&self.members).contains(&member) {
                return;
            }
            changed.await;
        }
    }

    /// Runs `transfer` with `member`, but gives up on it (`None`) once `member` is gone and
    /// the transfer has not ended [`DOWN_GRACE`] later. Not at once: a member is found down
    /// when its process has exited, and one that finished its round and left may still have
    /// this peer's result on the way (its socket delivers what it wrote, then the end of the
    /// stream). Cut off at once, that result was lost (a throttled peer's last round in
    /// `cli/tests/throttled_link.rs`, half of its runs). A stream to a process that died fails
    /// by itself as soon as what it holds is read; the grace only bounds one that does not.
    pub(super) async fn unless_gone<T>(
        &self,
        member: MemberIdx,
        transfer: impl std::future::Future<Output = T>,
    ) -> Option<T> {
        self.unless_gone_within(member, DOWN_GRACE, transfer).await
    }

    async fn unless_gone_within<T>(
        &self,
        member: MemberIdx,
        grace: std::time::Duration,
        transfer: impl std::future::Future<Output = T>,
    ) -> Option<T> {
        tokio::pin!(transfer);
        tokio::select! {
            done = &mut transfer => return Some(done),
            _ = self.wait_for(member) => {}
        }
        tokio::time::timeout(grace, transfer).await.ok()
    }
}

/// How often a round looks for members its node found down.
const DOWN_POLL: std::time::Duration = std::time::Duration::from_millis(50);

/// While a round runs: every member the node finds down ([`starling_node::Node::is_down`]:
/// its connections dropped and its address refuses, i.e. its process died) is gone. The
/// sends to it stop (those that have not ended by themselves [`DOWN_GRACE`] later; its span
/// is re-delegated) and this peer's reduction stops waiting for its part, instead of both
/// waiting out the sender and reducer timeouts (seen: 10 s of a round of eight peers when one
/// was SIGKILLed as the round began).
pub(super) async fn watch_down(round: Arc<Round>) {
    let node = round.env.transport.node().clone();
    loop {
        for m in MemberIdx::all(round.peers.len()) {
            if m != round.me && node.is_down(&round.peer(m)) {
                round.gone.insert(m);
            }
        }
        tokio::time::sleep(DOWN_POLL).await;
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::time::{sleep, Instant};

    use super::*;

    const GRACE: Duration = Duration::from_millis(300);

    #[tokio::test]
    async fn a_transfer_with_a_member_still_up_runs_to_its_end() {
        let gone = Gone::default();
        let m = MemberIdx::of(1);
        let other = MemberIdx::of(2);
        gone.insert(other);
        let transfer = async {
            sleep(2 * GRACE).await;
            7
        };
        assert_eq!(gone.unless_gone_within(m, GRACE, transfer).await, Some(7));
    }

    #[tokio::test]
    async fn a_member_found_down_still_delivers_what_is_on_its_way() {
        let gone = Gone::default();
        let m = MemberIdx::of(1);
        let transfer = async {
            sleep(GRACE / 3).await;
            7
        };
        let mark = async {
            sleep(GRACE / 6).await;
            gone.insert(m);
        };
        let (done, ()) = tokio::join!(gone.unless_gone_within(m, GRACE, transfer), mark);
        assert_eq!(done, Some(7));
    }

    #[tokio::test]
    async fn a_stuck_transfer_with_a_member_found_down_ends_after_the_grace() {
        let gone = Gone::default();
        let m = MemberIdx::of(1);
        let started = Instant::now();
        let mark = async {
            sleep(GRACE / 3).await;
            gone.insert(m);
        };
        let stuck = std::future::pending::<u32>();
        let (done, ()) = tokio::join!(gone.unless_gone_within(m, GRACE, stuck), mark);
        assert_eq!(done, None);
        let took = started.elapsed();
        assert!(took >= GRACE + GRACE / 3, "gave up after {took:?}");
    }
}
