//! The decisions of one exchange, with no I/O: each side's phases as a type, how the responder
//! answers a hello, what the initiator makes of the answer, and what each side's end means for
//! the pair's mass. [`exchange`](super::exchange) carries them out on a lane; the arithmetic of
//! the update is [`mix`](super::mix).
//!
//! ```text
//! initiator phase                       message                responder phase
//! Locking (own exclusive lock)
//! Hello                                 Hello{..} ->           answer_hello: Ready | Busy | ...
//! Sending x_a                           chunks, SendDone ->    Receiving x̂_a
//! AwaitingDifference                    <- chunks, DiffDone    Sending d̂ (and keeping it)
//! Applied (x_a += c_a d̂)               Applied ->             AwaitingConfirmation
//!                                                              Applied (x_b -= c_b d̂)
//! ```
//!
//! Only two ends move values: the initiator's `Applied` and the responder's. An exchange cut
//! before the initiator applied moves nothing on either side; one cut after it applied and
//! before the responder read the confirmation moves the initiator only ([`ExchangeOutcome::Unconfirmed`]),
//! which is the one case where the pair's mass changes, and the report says so.

use super::mix::coefficients;
use super::report::ExchangeOutcome;
use crate::wire::GossipMsg;

/// Where the initiator of an exchange stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum InitiatorPhase {
    /// Waiting for its own exclusive lock (an exchange it answers may hold it).
    Locking,
    /// Hello sent, waiting for the answer.
    Hello,
    /// Sending its values.
    Sending,
    /// Waiting for the responder's decoded difference.
    AwaitingDifference,
    /// Added `c_a d̂` to its values; sending the confirmation.
    Applied,
}

/// Where the responder of an exchange stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ResponderPhase {
    /// Receiving the initiator's values.
    Receiving,
    /// Sending the difference (and keeping what the initiator will decode of it).
    Sending,
    /// Waiting for the initiator's `Applied`.
    AwaitingConfirmation,
}

/// What the initiator's failure in `phase` means: before it applied, nothing moved; after, its
/// values moved and the responder's may not have.
pub(crate) fn initiator_failed(phase: InitiatorPhase, why: String) -> ExchangeOutcome {
    match phase {
        InitiatorPhase::Applied => ExchangeOutcome::Unconfirmed(why),
        _ => ExchangeOutcome::Failed(why),
    }
}

/// What the responder's failure in `phase` means: it applies only on the confirmation, so a
/// failure before it moved nothing here; a missing confirmation means the initiator may have
/// moved alone.
pub(crate) fn responder_failed(phase: ResponderPhase, why: String) -> ExchangeOutcome {
    match phase {
        ResponderPhase::AwaitingConfirmation => ExchangeOutcome::Unconfirmed(why),
        _ => ExchangeOutcome::Failed(why),
    }
}

/// What the responder knows of itself when a hello arrives.
#[derive(Debug, Clone)]
pub(crate) struct Responder<'a> {
    /// Its run prefix.
    pub prefix: &'a str,
    /// Its mixing rate.
    pub alpha: f64,
    /// Its codec's name (for the refusal message).
    pub codec: &'a str,
    /// The vector it serves: schema, length and weight; `None` when it serves nothing.
    pub served: Option<(u64, u64, f64)>,
    /// Whether its exclusive lock is free (it is in no other exchange).
    pub free: bool,
}

/// The hello's fields.
#[derive(Debug, Clone)]
pub(crate) struct Hello<'a> {
    /// The initiator's run prefix.
    pub prefix: &'a str,
    /// Its schema.
    pub schema: u64,
    /// Its vector's length.
    pub len: u64,
    /// Its weight.
    pub weight: f64,
    /// Its mixing rate.
    pub alpha: f64,
}

/// How the responder answers a hello: `Ok((c_b, w_b))` (answer `Ready{w_b}`, then subtract
/// `c_b d̂` when confirmed), or the refusal to send. Refusals that may pass (busy, nothing
/// served yet) are `Busy`/`NotServing`; the rest say why.
pub(crate) fn answer_hello(me: &Responder<'_>, hello: &Hello<'_>) -> Result<(f32, f64), GossipMsg> {
    if hello.prefix != me.prefix {
        return Err(GossipMsg::Refused(format!(
            "this peer gossips in {}",
            me.prefix
        )));
    }
    let Some((schema, len, w_b)) = me.served else {
        return Err(GossipMsg::NotServing);
    };
    if schema != hello.schema || len != hello.len {
        return Err(GossipMsg::Refused(format!(
            "schema mismatch: this peer averages {len} values with codec {}",
            me.codec
        )));
    }
    if hello.alpha != me.alpha || coefficients(hello.alpha, hello.weight, 1.0).is_none() {
        return Err(GossipMsg::Refused(format!(
            "alpha {} or weight {} refused (alpha here: {})",
            hello.alpha, hello.weight, me.alpha
        )));
    }
    if !me.free {
        return Err(GossipMsg::Busy);
    }
    match coefficients(hello.alpha, hello.weight, w_b) {
        Some((_, c_b)) => Ok((c_b, w_b)),
        None => Err(GossipMsg::Refused("both weights are zero".into())),
    }
}

/// What the initiator does with the responder's answer.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Answered {
    /// Send the values; add `c_a d̂` when the difference arrives (`w_b`: the responder's
    /// weight).
    Proceed {
        /// The initiator's coefficient.
        c_a: f32,
        /// The responder's weight.
        w_b: f64,
    },
    /// Busy or serving nothing yet: try again after a pause.
    Retry,
    /// Refused or malformed: give up on this peer for now.
    Fail(String),
}

/// The initiator's reading of `reply` to its hello (weight `w_a`, rate `alpha`).
pub(crate) fn on_answer(alpha: f64, w_a: f64, reply: GossipMsg) -> Answered {
    match reply {
        GossipMsg::Ready { weight: w_b } => match coefficients(alpha, w_a, w_b) {
            Some((c_a, _)) => Answered::Proceed { c_a, w_b },
            None => Answered::Fail(format!("invalid weights {w_a} and {w_b}")),
        },
        GossipMsg::Busy | GossipMsg::NotServing => Answered::Retry,
        GossipMsg::Refused(why) => Answered::Fail(format!("refused: {why}")),
        other => Answered::Fail(format!("unexpected answer {other:?}")),
    }
}

/// What the initiator's machine hears.
#[derive(Debug, Clone)]
pub(crate) enum InitiatorEvent {
    /// Its exclusive lock is held; `weight` of the values it serves (`None`: none).
    Locked(Option<f64>),
    /// The responder answered the hello.
    Answer(GossipMsg),
    /// Its values and `SendDone` went out.
    Sent,
    /// The decoded difference arrived whole.
    Difference,
    /// `Applied` went out after it added `c_a d̂`.
    Confirmed,
    /// The step in progress failed (I/O, timeout, the vector changed size).
    Failed(String),
}

/// What the initiator's machine asks for next.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum InitiatorAction {
    /// Send the hello (with the weight it reported).
    SendHello,
    /// Send its values; the responder weighs `w_b`.
    SendValues {
        /// The responder's weight.
        w_b: f64,
    },
    /// Read the difference.
    ReadDifference,
    /// Add `c_a d̂` to its values, then send `Applied`.
    Apply {
        /// The initiator's coefficient.
        c_a: f32,
    },
    /// The responder is busy: try again after a pause.
    Retry,
    /// The exchange ended.
    End(ExchangeOutcome),
}

/// The initiator's side of an exchange as a state machine: each step's outcome in, the next
/// step out, the phase kept. An event out of order ends the exchange as a failure of the phase
/// it arrived in.
#[derive(Debug, Clone)]
pub(crate) struct Initiator {
    phase: InitiatorPhase,
    alpha: f64,
    w_a: f64,
    c_a: f32,
}

impl Initiator {
    /// An exchange with mixing rate `alpha`, waiting for the lock.
    pub fn new(alpha: f64) -> Self {
        Initiator {
            phase: InitiatorPhase::Locking,
            alpha,
            w_a: 0.0,
            c_a: 0.0,
        }
    }

    /// Where it stands.
    #[cfg_attr(not(test), allow(dead_code))]
    pub fn phase(&self) -> InitiatorPhase {
        self.phase
    }

    /// Handles `event`; the next step.
    pub fn on(&mut self, event: InitiatorEvent) -> InitiatorAction {
        use InitiatorAction as A;
        use InitiatorEvent as E;
        use InitiatorPhase as P;
        match (self.phase, event) {
            (phase, E::Failed(why)) => A::End(initiator_failed(phase, why)),
            (P::Locking, E::Locked(Some(w_a))) => {
                self.w_a = w_a;
                self.phase = P::Hello;
                A::SendHello
            }
            (P::Locking, E::Locked(None)) => A::End(ExchangeOutcome::Failed(
                "this peer has no values to average".into(),
            )),
            (P::Hello, E::Answer(reply)) => match on_answer(self.alpha, self.w_a, reply) {
                Answered::Proceed { c_a, w_b } => {
                    self.c_a = c_a;
                    self.phase = P::Sending;
                    A::SendValues { w_b }
                }
                Answered::Retry => A::Retry,
                Answered::Fail(why) => A::End(ExchangeOutcome::Failed(why)),
            },
            (P::Sending, E::Sent) => {
                self.phase = P::AwaitingDifference;
                A::ReadDifference
            }
            (P::AwaitingDifference, E::Difference) => {
                self.phase = P::Applied;
                A::Apply { c_a: self.c_a }
            }
            (P::Applied, E::Confirmed) => A::End(ExchangeOutcome::Averaged),
            (phase, event) => A::End(initiator_failed(
                phase,
                format!("{event:?} out of order while {phase:?}"),
            )),
        }
    }
}

/// What the responder's machine hears (after [`answer_hello`] accepted).
#[derive(Debug, Clone)]
pub(crate) enum ResponderEvent {
    /// `Ready` went out and the initiator's values arrived whole.
    Received,
    /// The difference and `DiffDone` went out.
    Sent,
    /// The initiator's `Applied` arrived.
    Confirmed,
    /// The step in progress failed.
    Failed(String),
}

/// What the responder's machine asks for next.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum ResponderAction {
    /// Compute and send the difference, keeping what the initiator will decode of it.
    SendDifference,
    /// Wait for `Applied`.
    AwaitConfirmation,
    /// Subtract `c_b d̂` from its values: the exchange averaged.
    Apply {
        /// The responder's coefficient.
        c_b: f32,
    },
    /// The exchange ended without this side applying.
    End(ExchangeOutcome),
}

/// The responder's side of an exchange as a state machine (see [`Initiator`]).
#[derive(Debug, Clone)]
pub(crate) struct ResponderSide {
    phase: ResponderPhase,
    c_b: f32,
}

impl ResponderSide {
    /// An accepted exchange in which this side moves by `c_b`, receiving the values.
    pub fn new(c_b: f32) -> Self {
        ResponderSide {
            phase: ResponderPhase::Receiving,
            c_b,
        }
    }

    /// Handles `event`; the next step.
    pub fn on(&mut self, event: ResponderEvent) -> ResponderAction {
        use ResponderAction as A;
        use ResponderEvent as E;
        use ResponderPhase as P;
        match (self.phase, event) {
            (phase, E::Failed(why)) => A::End(responder_failed(phase, why)),
            (P::Receiving, E::Received) => {
                self.phase = P::Sending;
                A::SendDifference
            }
            (P::Sending, E::Sent) => {
                self.phase = P::AwaitingConfirmation;
                A::AwaitConfirmation
            }
            (P::AwaitingConfirmation, E::Confirmed) => A::Apply { c_b: self.c_b },
            (phase, event) => A::End(responder_failed(
                phase,
                format!("{event:?} out of order while {phase:?}"),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn me(served: Option<(u64, u64, f64)>, free: bool) -> Responder<'static> {
        Responder {
            prefix: "run",
            alpha: 1.0,
            codec: "none",
            served,
            free,
        }
    }

    fn hello(prefix: &str, schema: u64, len: u64, weight: f64, alpha: f64) -> Hello<'_> {
        Hello {
            prefix,
            schema,
            len,
            weight,
            alpha,
        }
    }

    #[test]
    fn a_responder_answers_ready_only_to_a_matching_hello_when_free() {
        let served = Some((7, 100, 3.0));
        // Ready, moving by c_b = alpha w_a / (w_a + w_b).
        assert_eq!(
            answer_hello(&me(served, true), &hello("run", 7, 100, 1.0, 1.0)),
            Ok((0.25, 3.0))
        );
        let refused = |r: Result<(f32, f64), GossipMsg>| matches!(r, Err(GossipMsg::Refused(_)));
        assert!(refused(answer_hello(
            &me(served, true),
            &hello("other", 7, 100, 1.0, 1.0)
        )));
        assert!(refused(answer_hello(
            &me(served, true),
            &hello("run", 8, 100, 1.0, 1.0)
        )));
        assert!(refused(answer_hello(
            &me(served, true),
            &hello("run", 7, 99, 1.0, 1.0)
        )));
        assert!(refused(answer_hello(
            &me(served, true),
            &hello("run", 7, 100, 1.0, 0.5)
        )));
        assert!(refused(answer_hello(
            &me(served, true),
            &hello("run", 7, 100, f64::NAN, 1.0)
        )));
        assert!(refused(answer_hello(
            &me(Some((7, 100, 0.0)), true),
            &hello("run", 7, 100, 0.0, 1.0)
        )));
        // Passing states: nothing served yet, or in another exchange.
        assert_eq!(
            answer_hello(&me(None, true), &hello("run", 7, 100, 1.0, 1.0)),
            Err(GossipMsg::NotServing)
        );
        assert_eq!(
            answer_hello(&me(served, false), &hello("run", 7, 100, 1.0, 1.0)),
            Err(GossipMsg::Busy)
        );
    }

    #[test]
    fn the_initiator_proceeds_retries_or_fails_by_the_answer_and_both_sides_preserve_mass() {
        let (w_a, w_b) = (1.0, 3.0);
        let Answered::Proceed { c_a, .. } = on_answer(1.0, w_a, GossipMsg::Ready { weight: w_b })
        else {
            panic!("ready proceeds");
        };
        let Ok((c_b, _)) =
            answer_hello(&me(Some((7, 1, w_b)), true), &hello("run", 7, 1, w_a, 1.0))
        else {
            panic!("the hello matches");
        };
        // w_a c_a - w_b c_b = 0: the pair's weighted sum does not move.
        assert!((w_a * f64::from(c_a) - w_b * f64::from(c_b)).abs() < 1e-7);
        assert_eq!(on_answer(1.0, w_a, GossipMsg::Busy), Answered::Retry);
        assert_eq!(on_answer(1.0, w_a, GossipMsg::NotServing), Answered::Retry);
        assert!(matches!(
            on_answer(1.0, w_a, GossipMsg::Refused("no".into())),
            Answered::Fail(_)
        ));
        assert!(matches!(
            on_answer(1.0, 0.0, GossipMsg::Ready { weight: 0.0 }),
            Answered::Fail(_)
        ));
        assert!(matches!(
            on_answer(1.0, w_a, GossipMsg::SendDone),
            Answered::Fail(_)
        ));
    }

    #[test]
    fn only_a_failure_after_applying_leaves_an_exchange_unconfirmed() {
        for phase in [
            InitiatorPhase::Locking,
            InitiatorPhase::Hello,
            InitiatorPhase::Sending,
            InitiatorPhase::AwaitingDifference,
        ] {
            assert!(matches!(
                initiator_failed(phase, "x".into()),
                ExchangeOutcome::Failed(_)
            ));
        }
        assert!(matches!(
            initiator_failed(InitiatorPhase::Applied, "x".into()),
            ExchangeOutcome::Unconfirmed(_)
        ));
        for phase in [ResponderPhase::Receiving, ResponderPhase::Sending] {
            assert!(matches!(
                responder_failed(phase, "x".into()),
                ExchangeOutcome::Failed(_)
            ));
        }
        assert!(matches!(
            responder_failed(ResponderPhase::AwaitingConfirmation, "x".into()),
            ExchangeOutcome::Unconfirmed(_)
        ));
    }

    #[test]
    fn the_two_machines_walk_an_exchange_and_end_by_the_phase_they_reached() {
        use InitiatorAction as A;
        use InitiatorEvent as E;
        let mut a = Initiator::new(1.0);
        assert_eq!(a.on(E::Locked(Some(1.0))), A::SendHello);
        assert_eq!(
            a.on(E::Answer(GossipMsg::Ready { weight: 3.0 })),
            A::SendValues { w_b: 3.0 }
        );
        let mut b = ResponderSide::new(0.25);
        assert_eq!(
            b.on(ResponderEvent::Received),
            ResponderAction::SendDifference
        );
        assert_eq!(a.on(E::Sent), A::ReadDifference);
        assert_eq!(
            b.on(ResponderEvent::Sent),
            ResponderAction::AwaitConfirmation
        );
        assert_eq!(a.on(E::Difference), A::Apply { c_a: 0.75 });
        assert_eq!(a.on(E::Confirmed), A::End(ExchangeOutcome::Averaged));
        assert_eq!(
            b.on(ResponderEvent::Confirmed),
            ResponderAction::Apply { c_b: 0.25 }
        );
        // Busy answers retry; nothing served fails; events out of order end the exchange.
        let mut a = Initiator::new(1.0);
        a.on(E::Locked(Some(1.0)));
        assert_eq!(a.on(E::Answer(GossipMsg::Busy)), A::Retry);
        assert!(matches!(
            Initiator::new(1.0).on(E::Locked(None)),
            A::End(ExchangeOutcome::Failed(_))
        ));
        let mut a = Initiator::new(1.0);
        a.on(E::Locked(Some(1.0)));
        assert!(matches!(
            a.on(E::Difference),
            A::End(ExchangeOutcome::Failed(_))
        ));
        // A failure after applying is unconfirmed, before it nothing moved.
        let mut a = Initiator::new(1.0);
        a.on(E::Locked(Some(1.0)));
        a.on(E::Answer(GossipMsg::Ready { weight: 1.0 }));
        assert_eq!(a.phase(), InitiatorPhase::Sending);
        assert!(matches!(
            a.on(E::Failed("reset".into())),
            A::End(ExchangeOutcome::Failed(_))
        ));
        let mut a = Initiator::new(1.0);
        for e in [
            E::Locked(Some(1.0)),
            E::Answer(GossipMsg::Ready { weight: 1.0 }),
            E::Sent,
            E::Difference,
        ] {
            a.on(e);
        }
        assert!(matches!(
            a.on(E::Failed("reset".into())),
            A::End(ExchangeOutcome::Unconfirmed(_))
        ));
        let mut b = ResponderSide::new(0.5);
        b.on(ResponderEvent::Received);
        b.on(ResponderEvent::Sent);
        assert!(matches!(
            b.on(ResponderEvent::Failed("no confirmation".into())),
            ResponderAction::End(ExchangeOutcome::Unconfirmed(_))
        ));
    }
}
