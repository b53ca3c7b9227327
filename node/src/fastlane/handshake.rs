//! The fast lane's handshake: the offer a dialer sends over its libp2p stream, the listener's
//! answer, how both sides derive the lane's keys from the two sides' randomness, and which port
//! the dialer connects to.
//!
//! Offers and answers travel as [`crate::framing`] messages (a little-endian `u32` length,
//! then the postcard body) of at most [`MAX_HANDSHAKE_MSG`] bytes.

use std::net::{IpAddr, SocketAddr};

use ring::hkdf::{KeyType, Salt, HKDF_SHA256};
use serde::{Deserialize, Serialize};

/// Names one offered lane; single-use.
pub(super) type Token = [u8; 16];
/// One side's fresh randomness for a lane's keys.
pub(super) type Secret = [u8; 32];
/// Two AES-256-GCM keys: dialer→listener, then listener→dialer.
pub(super) type Keys = [u8; 64];
/// Largest offer or answer, in bytes (an offer is about 60 bytes plus the protocol name; an
/// answer about 40 plus 19 per address).
pub(super) const MAX_HANDSHAKE_MSG: usize = 1024;
/// Most lane addresses an answer lists (one per listen IP); a dialer ignores the rest.
pub(super) const MAX_LANE_ADDRS: usize = 8;
/// What the dialer's first record on a new lane says (it proves the dialer holds the keys).
pub(super) const HELLO: &[u8; 16] = b"starling-lane-v2";
/// What the listener's first record answers once the lane has a place in a handler's queue.
pub(super) const READY: &[u8; 16] = b"starling-lane-ok";
/// HKDF salt: names this key schedule, so keys from it can never match another protocol's.
const KEY_SALT: &[u8] = b"starling fast lane v2 keys";

/// A message on the `/starling/fastlane/2` libp2p stream.
#[derive(Serialize, Deserialize, Debug)]
pub(super) enum Handshake {
    /// Dialer → listener: a lane for `protocol`, named by `token`; `secret` is the dialer's
    /// share of the key material.
    Offer {
        protocol: String,
        token: Token,
        secret: Secret,
    },
    /// Listener → dialer: the lane listens at `addrs` (an unspecified IP: every interface);
    /// `random` is the listener's share of the key material. Connect within the offer's
    /// lifetime.
    Accept {
        addrs: Vec<SocketAddr>,
        random: Secret,
    },
    /// Listener → dialer: no lane (reason for the log).
    Refuse(String),
}

/// Output length for HKDF-expand.
struct Len(usize);

impl KeyType for Len {
    fn len(&self) -> usize {
        self.0
    }
}

/// A lane's two keys: HKDF-SHA256 over the dialer's secret and the listener's randomness, bound
/// to the lane's token. The listener draws fresh randomness for every offer, so even a dialer
/// that repeats its secret and token never makes the listener reuse a key (and hence a nonce).
pub(super) fn derive_keys(
    token: &Token,
    dialer: &Secret,
    listener: &Secret,
) -> std::io::Result<Keys> {
    let mut ikm = [0u8; 64];
    ikm[..32].copy_from_slice(dialer);
    ikm[32..].copy_from_slice(listener);
    let prk = Salt::new(HKDF_SHA256, KEY_SALT).extract(&ikm);
    let mut keys = [0u8; 64];
    let info: [&[u8]; 1] = [token];
    // 64 bytes is far below HKDF-SHA256's limit (255 * 32): this does not fail in practice.
    prk.expand(&info, Len(keys.len()))
        .and_then(|okm| okm.fill(&mut keys))
        .map_err(|_| std::io::Error::other("deriving fast lane keys failed"))?;
    Ok(keys)
}

/// The port to connect to when the libp2p connection reaches the listener at `conn_ip`: the
/// lane address with exactly that IP, else one on every interface of the same family, else the
/// first of the same family (a port forwarded through a NAT), else the first listed.
///
/// The dialer always connects to `conn_ip` itself, never to another IP from the answer: that
/// is the address libp2p authenticated, and a peer cannot steer the dialer elsewhere.
pub(super) fn lane_port(conn_ip: IpAddr, addrs: &[SocketAddr]) -> Option<u16> {
    let conn_ip = conn_ip.to_canonical();
    let addrs = &addrs[..addrs.len().min(MAX_LANE_ADDRS)];
    let same_family = |a: &&SocketAddr| a.ip().to_canonical().is_ipv4() == conn_ip.is_ipv4();
    addrs
        .iter()
        .find(|a| a.ip().to_canonical() == conn_ip)
        .or_else(|| {
            addrs
                .iter()
                .filter(same_family)
                .find(|a| a.ip().is_unspecified())
        })
        .or_else(|| addrs.iter().find(same_family))
        .or_else(|| addrs.first())
        .map(SocketAddr::port)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::framing::{read_msg, write_msg, FrameError};
    use futures::executor::block_on;
    use futures::io::Cursor;

    #[test]
    fn offers_are_a_u32_le_length_then_postcard_and_bounded() {
        block_on(async {
            let offer = Handshake::Offer {
                protocol: "/test/1".into(),
                token: [7; 16],
                secret: [9; 32],
            };
            let mut wire = Vec::new();
            write_msg(&mut wire, &offer).await.unwrap();
            let body = postcard::to_stdvec(&offer).unwrap();
            let mut expected = (body.len() as u32).to_le_bytes().to_vec();
            expected.extend_from_slice(&body);
            assert_eq!(wire, expected);
            let back: Handshake = read_msg(&mut Cursor::new(wire), MAX_HANDSHAKE_MSG)
                .await
                .unwrap();
            assert!(
                matches!(back, Handshake::Offer { token, secret, .. } if token == [7; 16] && secret == [9; 32])
            );

            let mut big = ((MAX_HANDSHAKE_MSG + 1) as u32).to_le_bytes().to_vec();
            big.resize(MAX_HANDSHAKE_MSG + 5, 0);
            let err = read_msg::<_, Handshake>(&mut Cursor::new(big), MAX_HANDSHAKE_MSG)
                .await
                .unwrap_err();
            assert!(matches!(err, FrameError::TooLarge { .. }));
            // Still an InvalidData io error where the lane code uses `?` on it.
            assert_eq!(
                std::io::Error::from(err).kind(),
                std::io::ErrorKind::InvalidData
            );
        });
    }

    #[test]
    fn a_full_answer_fits_the_message_bound() {
        let addrs = (0..MAX_LANE_ADDRS)
            .map(|i| SocketAddr::new("ffff::1".parse().unwrap(), 60_000 + i as u16))
            .collect();
        let answer = Handshake::Accept {
            addrs,
            random: [0xff; 32],
        };
        assert!(postcard::to_stdvec(&answer).unwrap().len() < MAX_HANDSHAKE_MSG);
    }

    #[test]
    fn keys_depend_on_both_sides_randomness_and_the_token() {
        let d = |t: u8, a: u8, b: u8| derive_keys(&[t; 16], &[a; 32], &[b; 32]).unwrap();
        let k = d(1, 2, 3);
        assert_eq!(k, d(1, 2, 3));
        assert_ne!(k[..32], k[32..], "one key per direction");
        assert_ne!(k, d(1, 2, 4));
        assert_ne!(k, d(1, 5, 3));
        assert_ne!(k, d(6, 2, 3));
    }

    #[test]
    fn the_dialer_picks_the_port_of_the_address_it_is_connected_to() {
        let a = |s: &str| s.parse::<SocketAddr>().unwrap();
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let all = [a("0.0.0.0:1000"), a("[::]:2000")];
        assert_eq!(lane_port(ip("10.0.0.2"), &all), Some(1000));
        assert_eq!(lane_port(ip("fe80::2"), &all), Some(2000));
        // An IPv4 peer seen through an IPv6 socket is still IPv4.
        assert_eq!(lane_port(ip("::ffff:10.0.0.2"), &all), Some(1000));
        let several = [a("127.0.0.1:1"), a("10.0.0.2:2"), a("0.0.0.0:3")];
        assert_eq!(lane_port(ip("10.0.0.2"), &several), Some(2));
        assert_eq!(lane_port(ip("192.168.1.9"), &several), Some(3));
        // Reached through a NAT's public address: the first lane port of that family.
        let private = [a("[fd00::1]:7"), a("192.168.1.5:8")];
        assert_eq!(lane_port(ip("203.0.113.7"), &private), Some(8));
        assert_eq!(lane_port(ip("203.0.113.7"), &[a("[fd00::1]:7")]), Some(7));
        assert_eq!(lane_port(ip("203.0.113.7"), &[]), None);
    }
}
