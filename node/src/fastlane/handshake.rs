//! The fast lane's handshake messages: the offer a dialer sends over its libp2p stream and the
//! listener's answer, plus the first record each side sends on the new TCP connection.
//!
//! Offers and answers travel as [`crate::framing`] messages (a little-endian `u32` length,
//! then the postcard body) of at most [`MAX_HANDSHAKE_MSG`] bytes.

use serde::{Deserialize, Serialize};

/// Names one offered lane; single-use.
pub(super) type Token = [u8; 16];
/// Two AES-256-GCM keys: dialer→listener, then listener→dialer.
pub(super) type Keys = [u8; 64];
/// Largest offer or answer, in bytes (an offer is about 90 bytes plus the protocol name).
pub(super) const MAX_HANDSHAKE_MSG: usize = 1024;
/// What the dialer's first record on a new lane says (it proves the dialer holds the keys).
pub(super) const HELLO: &[u8; 16] = b"starling-lane-v1";
/// What the listener's first record answers once the lane is routed to a handler.
pub(super) const READY: &[u8; 16] = b"starling-lane-ok";

/// A message on the `/starling/fastlane/1` libp2p stream.
#[derive(Serialize, Deserialize, Debug)]
pub(super) enum Handshake {
    /// Dialer → listener: a lane for `protocol`, named by `token`; `keys` holds the
    /// dialer→listener key, then the listener→dialer key.
    Offer {
        protocol: String,
        token: Token,
        #[serde(with = "serde_bytes_64")]
        keys: Keys,
    },
    /// Listener → dialer: connect to this port within the offer's lifetime.
    Accept { port: u16 },
    /// Listener → dialer: no lane (reason for the log).
    Refuse(String),
}

/// serde for `[u8; 64]` (serde's array impls stop at 32), as a length-prefixed byte sequence.
mod serde_bytes_64 {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};
    pub fn serialize<S: Serializer>(v: &[u8; 64], s: S) -> Result<S::Ok, S::Error> {
        v.as_slice().serialize(s)
    }
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<[u8; 64], D::Error> {
        let v = <Vec<u8>>::deserialize(d)?;
        v.try_into()
            .map_err(|_| serde::de::Error::custom("expected 64 key bytes"))
    }
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
                keys: [9; 64],
            };
            let mut wire = Vec::new();
            write_msg(&mut wire, &offer).await.unwrap();
            // The bytes the fast lane sent before it used the shared framing module.
            let body = postcard::to_stdvec(&offer).unwrap();
            let mut expected = (body.len() as u32).to_le_bytes().to_vec();
            expected.extend_from_slice(&body);
            assert_eq!(wire, expected);
            let back: Handshake = read_msg(&mut Cursor::new(wire), MAX_HANDSHAKE_MSG)
                .await
                .unwrap();
            assert!(
                matches!(back, Handshake::Offer { token, keys, .. } if token == [7; 16] && keys == [9; 64])
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
}
