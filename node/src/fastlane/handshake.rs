//! The fast lane's handshake messages: the offer a dialer sends over its libp2p stream and the
//! listener's answer, plus the first record each side sends on the new TCP connection.

use serde::{Deserialize, Serialize};

pub(super) type Token = [u8; 16];
pub(super) type Keys = [u8; 64];
/// What the dialer's first record says; what the listener's first record answers.
pub(super) const HELLO: &[u8; 16] = b"starling-lane-v1";
pub(super) const READY: &[u8; 16] = b"starling-lane-ok";

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
