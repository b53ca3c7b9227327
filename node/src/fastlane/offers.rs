//! Offers a listener accepted and that wait for their TCP connection: bounded, short-lived, and
//! shared fairly between peers.
//!
//! An offer lives [`OFFER_LIFETIME`]: long enough for the dialer's connection attempt (which
//! gives up after `CONNECT_TIMEOUT`), short enough that offers whose dialer went away free their
//! place quickly. The table holds at most [`MAX_PENDING`] offers and one peer at most
//! [`MAX_PENDING_PER_PEER`]; when the table is full, a peer holding less than its fair share
//! (the table divided by the peers holding offers) takes the oldest offer of the peer holding
//! the most, so a greedy peer can never lock the others out.

use std::collections::HashMap;
use std::net::IpAddr;
use std::time::Duration;

use libp2p::PeerId;
use tokio::time::Instant;

use super::handshake::{Keys, Token};

/// How long an accepted offer waits for its connection.
pub(super) const OFFER_LIFETIME: Duration = Duration::from_secs(4);
/// Offers pending at most, over all peers.
pub(super) const MAX_PENDING: usize = 256;
/// Offers one peer may have pending at most.
pub(super) const MAX_PENDING_PER_PEER: usize = 32;

/// An offer accepted and waiting for its connection.
pub(super) struct Pending {
    /// Who made the offer (over an authenticated libp2p connection).
    pub peer: PeerId,
    /// The IP that peer's libp2p connection comes from, where known: its lane connection most
    /// likely comes from there too.
    pub ip: Option<IpAddr>,
    /// The protocol whose handler gets the lane.
    pub protocol: String,
    /// The lane's keys.
    pub keys: Keys,
    /// When the offer lapses.
    pub expires: Instant,
}

/// Why an offer was refused.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Refusal {
    /// The peer already holds as many offers as it may.
    PeerFull,
    /// The table is full and the peer holds its fair share already.
    Full,
    /// Another pending offer has this token.
    TokenInUse,
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Refusal::PeerFull => "too many lanes pending from you",
            Refusal::Full => "too many lanes pending",
            Refusal::TokenInUse => "token in use",
        })
    }
}

/// The pending offers, by token.
pub(super) struct Offers {
    map: HashMap<Token, Pending>,
    capacity: usize,
    per_peer: usize,
}

impl Offers {
    /// An empty table of at most `capacity` offers, `per_peer` per peer.
    pub fn new(capacity: usize, per_peer: usize) -> Self {
        Offers {
            map: HashMap::new(),
            capacity,
            per_peer,
        }
    }

    /// Remembers `offer` under `token` unless its peer holds too many already; evicts another
    /// peer's oldest offer where fairness requires it.
    pub fn insert(&mut self, token: Token, offer: Pending, now: Instant) -> Result<(), Refusal> {
        self.map.retain(|_, p| p.expires > now);
        if self.map.contains_key(&token) {
            return Err(Refusal::TokenInUse);
        }
        let mut held: HashMap<PeerId, usize> = HashMap::new();
        for p in self.map.values() {
            *held.entry(p.peer).or_default() += 1;
        }
        let mine = held.get(&offer.peer).copied().unwrap_or(0);
        if mine >= self.per_peer {
            return Err(Refusal::PeerFull);
        }
        if self.map.len() >= self.capacity {
            let peers = held.len() + usize::from(mine == 0);
            if mine >= self.capacity / peers.max(1) {
                return Err(Refusal::Full);
            }
            // Someone holds more than the fair share: take their oldest offer.
            let greedy = held.iter().max_by_key(|(_, n)| **n).map(|(peer, _)| *peer);
            let victim = self
                .map
                .iter()
                .filter(|(_, p)| Some(p.peer) == greedy)
                .min_by_key(|(_, p)| p.expires)
                .map(|(t, _)| *t);
            if let Some(t) = victim {
                self.map.remove(&t);
            }
        }
        self.map.insert(token, offer);
        Ok(())
    }

    /// The live offer named `token`: its peer, protocol and keys.
    pub fn get(&self, token: &Token, now: Instant) -> Option<(PeerId, String, Keys)> {
        self.map
            .get(token)
            .filter(|p| p.expires > now)
            .map(|p| (p.peer, p.protocol.clone(), p.keys))
    }

    /// Removes the offer named `token`; whether it was there.
    pub fn take(&mut self, token: &Token) -> bool {
        self.map.remove(token).is_some()
    }

    /// Live offers made by peers whose libp2p connection comes from `ip`.
    pub fn waiting_from(&self, ip: IpAddr, now: Instant) -> usize {
        self.map
            .values()
            .filter(|p| p.expires > now && p.ip == Some(ip))
            .count()
    }

    /// Offers pending (expired ones included until the next insert).
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Forgets every offer.
    pub fn clear(&mut self) {
        self.map.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn offer(peer: PeerId, now: Instant, age: u64) -> Pending {
        Pending {
            peer,
            ip: None,
            protocol: "/p/1".into(),
            keys: [0; 64],
            expires: now + OFFER_LIFETIME - Duration::from_millis(age),
        }
    }

    fn token(peer: u8, i: usize) -> Token {
        let mut t = [peer; 16];
        t[..8].copy_from_slice(&(i as u64).to_le_bytes());
        t
    }

    #[test]
    fn offers_lapse_after_their_short_lifetime() {
        let now = Instant::now();
        let mut offers = Offers::new(MAX_PENDING, MAX_PENDING_PER_PEER);
        let peer = PeerId::random();
        offers.insert([1; 16], offer(peer, now, 0), now).unwrap();
        assert!(offers.get(&[1; 16], now).is_some());
        let later = now + OFFER_LIFETIME;
        assert!(offers.get(&[1; 16], later).is_none());
        // The lapsed offer no longer counts against its peer.
        for i in 0..MAX_PENDING_PER_PEER {
            offers
                .insert(token(2, i), offer(peer, later, 0), later)
                .unwrap();
        }
        assert!(OFFER_LIFETIME <= Duration::from_secs(5));
    }

    #[test]
    fn a_full_table_makes_room_for_a_peer_below_its_fair_share() {
        let now = Instant::now();
        let mut offers = Offers::new(MAX_PENDING, MAX_PENDING_PER_PEER);
        let greedy: Vec<PeerId> = (0..MAX_PENDING / MAX_PENDING_PER_PEER)
            .map(|_| PeerId::random())
            .collect();
        for (g, peer) in greedy.iter().enumerate() {
            for i in 0..MAX_PENDING_PER_PEER {
                // Lower `i`: older.
                let age = (MAX_PENDING - g * MAX_PENDING_PER_PEER - i) as u64;
                offers
                    .insert(token(g as u8, i), offer(*peer, now, age), now)
                    .unwrap();
            }
        }
        assert_eq!(offers.len(), MAX_PENDING);
        // A peer at its cap is refused.
        assert_eq!(
            offers.insert([0xee; 16], offer(greedy[0], now, 0), now),
            Err(Refusal::PeerFull)
        );
        // A newcomer gets in; the table stays bounded.
        let newcomer = PeerId::random();
        let fair = MAX_PENDING / (greedy.len() + 1);
        for i in 0..fair {
            offers
                .insert(token(0xaa, i), offer(newcomer, now, 0), now)
                .unwrap();
            assert_eq!(offers.len(), MAX_PENDING);
        }
        // Beyond its fair share of a full table it waits like everyone else.
        assert_eq!(
            offers.insert(token(0xaa, fair), offer(newcomer, now, 0), now),
            Err(Refusal::Full)
        );
        // The evicted offers were the greedy peers' oldest ones.
        assert!(offers.get(&token(0, 0), now).is_none());
        assert!(offers
            .get(&token(0, MAX_PENDING_PER_PEER - 1), now)
            .is_some());
        assert_eq!(
            offers.insert(token(0xaa, 0), offer(newcomer, now, 0), now),
            Err(Refusal::TokenInUse)
        );
    }

    #[test]
    fn offers_are_counted_by_the_ip_their_peer_connects_from() {
        let now = Instant::now();
        let mut offers = Offers::new(MAX_PENDING, MAX_PENDING_PER_PEER);
        let ip: IpAddr = "10.0.0.2".parse().unwrap();
        let peer = PeerId::random();
        for i in 0..3 {
            let mut o = offer(peer, now, 0);
            o.ip = Some(ip);
            offers.insert(token(1, i), o, now).unwrap();
        }
        offers.insert([9; 16], offer(peer, now, 0), now).unwrap();
        assert_eq!(offers.waiting_from(ip, now), 3);
        assert_eq!(offers.waiting_from("10.0.0.3".parse().unwrap(), now), 0);
        assert!(offers.take(&token(1, 0)));
        assert!(!offers.take(&token(1, 0)), "single use");
        assert_eq!(offers.waiting_from(ip, now), 2);
        assert_eq!(offers.waiting_from(ip, now + OFFER_LIFETIME), 0);
    }
}
