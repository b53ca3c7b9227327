//! Expert uids on a grid (`ffn.3.7`) and how they are declared in the DHT.
//!
//! An expert `name.c0.c1...` is declared under every prefix: the DHT key `experts/name.` holds
//! sub-key `c0[owner:<server key>]`, the key `experts/name.c0.` holds sub-key
//! `c1[owner:<server key>]`, and so on; the value is the [`ExpertHost`] serving something under
//! that prefix (for the last coordinate: the expert itself). The owner marker makes every
//! declaration signed by the server it names: nobody can overwrite or forge another server's
//! declaration, several servers can host replicas of one uid side by side, and a reader drops any
//! declaration whose signer is not the peer it points to. A client walks these keys level by
//! level (beam search) and sees only prefixes that still hold a live (unexpired) declaration.

use serde::{Deserialize, Serialize};
use starling_node::{Multiaddr, PeerId};

use crate::{ExpertError, Result};

/// Namespace of expert keys in the DHT.
pub const DHT_NAMESPACE: &str = "experts/";
/// Most grid dimensions a uid may have.
pub const MAX_GRID_DEPTH: usize = 8;
/// Largest coordinate on any grid dimension.
pub const MAX_GRID_SIZE: u32 = 1 << 20;

/// A parsed expert uid: a name and at least one grid coordinate.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ExpertUid {
    /// The grid's name (letters, digits, `_`, `-`).
    pub name: String,
    /// One coordinate per grid dimension.
    pub coords: Vec<u32>,
}

impl ExpertUid {
    /// Parses `name.c0.c1...`.
    ///
    /// ```
    /// let uid = starling_experts::ExpertUid::parse("ffn.3.7").unwrap();
    /// assert_eq!(uid.coords, vec![3, 7]);
    /// assert!(starling_experts::ExpertUid::parse("ffn").is_err());
    /// ```
    pub fn parse(s: &str) -> Result<ExpertUid> {
        let bad = |why: &str| ExpertError::Invalid(format!("expert uid {s:?}: {why}"));
        let mut parts = s.split('.');
        let name = parts.next().unwrap_or_default();
        if name.is_empty()
            || name.len() > 64
            || !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        {
            return Err(bad("the name must be 1-64 letters, digits, '_' or '-'"));
        }
        let coords = parts
            .map(|p| match p.parse::<u32>() {
                Ok(c) if c < MAX_GRID_SIZE && (p == "0" || !p.starts_with('0')) => Ok(c),
                _ => Err(bad("coordinates must be integers below 2^20")),
            })
            .collect::<Result<Vec<u32>>>()?;
        if coords.is_empty() || coords.len() > MAX_GRID_DEPTH {
            return Err(bad("expected 1 to 8 grid coordinates, as in ffn.3.7"));
        }
        Ok(ExpertUid {
            name: name.to_string(),
            coords,
        })
    }

    /// The DHT key of the prefix made of the first `level` coordinates, and the sub-key a server
    /// with owner marker `owner_marker` (see `Node::owner_marker`) declares this uid under.
    pub fn declaration_at(&self, level: usize, owner_marker: &str) -> (String, String) {
        (
            prefix_key(&self.name, &self.coords[..level]),
            format!("{}{owner_marker}", self.coords[level]),
        )
    }
}

impl std::fmt::Display for ExpertUid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.name)?;
        for c in &self.coords {
            write!(f, ".{c}")?;
        }
        Ok(())
    }
}

/// The DHT key listing the live next coordinates under `name.prefix...`.
pub fn prefix_key(name: &str, prefix: &[u32]) -> String {
    let mut key = format!("{DHT_NAMESPACE}{name}.");
    for c in prefix {
        key.push_str(&c.to_string());
        key.push('.');
    }
    key
}

/// Expands a uid pattern with ranges, e.g. `ffn.0.[0:8]` (8 uids) or `ffn.[0:2].[0:4]` (8
/// uids). A range `[a:b]` is half-open.
///
/// ```
/// let uids = starling_experts::expand_uid_pattern("ffn.0.[0:3]").unwrap();
/// assert_eq!(uids, vec!["ffn.0.0", "ffn.0.1", "ffn.0.2"]);
/// ```
pub fn expand_uid_pattern(pattern: &str) -> Result<Vec<String>> {
    let bad = |why: &str| ExpertError::Invalid(format!("uid pattern {pattern:?}: {why}"));
    let mut out = vec![String::new()];
    for (i, part) in pattern.split('.').enumerate() {
        let values: Vec<String> =
            if let Some(range) = part.strip_prefix('[').and_then(|p| p.strip_suffix(']')) {
                let (a, b) = range
                    .split_once(':')
                    .ok_or_else(|| bad("ranges look like [0:8]"))?;
                let (a, b): (u32, u32) = (
                    a.trim().parse().map_err(|_| bad("range start"))?,
                    b.trim().parse().map_err(|_| bad("range end"))?,
                );
                if a >= b {
                    return Err(bad("empty range"));
                }
                (a..b).map(|c| c.to_string()).collect()
            } else {
                vec![part.to_string()]
            };
        if out.len() * values.len() > 65_536 {
            return Err(bad("more than 65536 uids"));
        }
        out = out
            .iter()
            .flat_map(|p| {
                values.iter().map(move |v| {
                    if i == 0 {
                        v.clone()
                    } else {
                        format!("{p}.{v}")
                    }
                })
            })
            .collect();
    }
    for uid in &out {
        ExpertUid::parse(uid)?;
    }
    Ok(out)
}

/// Who serves an expert (or some expert under a prefix): stored as the DHT value.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExpertHost {
    /// The server's peer id, as bytes.
    pub peer: Vec<u8>,
    /// Addresses it listens on.
    pub addrs: Vec<String>,
}

impl ExpertHost {
    /// The peer id, if well-formed.
    pub fn peer_id(&self) -> Option<PeerId> {
        PeerId::from_bytes(&self.peer).ok()
    }

    /// The addresses that parse.
    pub fn multiaddrs(&self) -> Vec<Multiaddr> {
        self.addrs.iter().filter_map(|a| a.parse().ok()).collect()
    }
}

/// The coordinate a declaration (sub-key `c[owner:..]` under `key`, value `host`) stands for,
/// if it is well-formed and signed by the peer it names. (The DHT has already checked the
/// signature against the owner marker.)
pub fn parse_declaration(key: &str, subkey: &str, host: &ExpertHost) -> Option<u32> {
    let (coord, _) = subkey.split_once('[')?;
    let coord: u32 = coord.parse().ok().filter(|c| *c < MAX_GRID_SIZE)?;
    let owner = starling_dht::required_owner(key, subkey).ok()??;
    (starling_node::peer_id_of_owner(&owner)? == host.peer_id()?).then_some(coord)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uids_parse_and_expand() {
        let u = ExpertUid::parse("ffn.3.7").unwrap();
        assert_eq!(u.to_string(), "ffn.3.7");
        assert_eq!(
            u.declaration_at(0, "[owner:ab]"),
            ("experts/ffn.".into(), "3[owner:ab]".into())
        );
        assert_eq!(
            u.declaration_at(1, ""),
            ("experts/ffn.3.".into(), "7".into())
        );
        let k = starling_node::Keypair::generate_ed25519();
        let owner = starling_node::owner_key_of(&k).unwrap();
        let host = ExpertHost {
            peer: k.public().to_peer_id().to_bytes(),
            addrs: vec![],
        };
        let (key, sub) = u.declaration_at(1, &owner.marker());
        assert_eq!(parse_declaration(&key, &sub, &host), Some(7));
        let other = ExpertHost {
            peer: starling_node::PeerId::random().to_bytes(),
            addrs: vec![],
        };
        assert_eq!(parse_declaration(&key, &sub, &other), None);
        assert_eq!(parse_declaration(&key, "7", &host), None);
        for bad in [
            "",
            "ffn",
            ".1",
            "ffn.x",
            "ffn.-1",
            "ffn.01",
            "f f.1",
            "ffn.1.",
            "ffn.2000000",
        ] {
            assert!(ExpertUid::parse(bad).is_err(), "{bad}");
        }
        assert_eq!(expand_uid_pattern("ffn.[0:2].[0:4]").unwrap().len(), 8);
        assert_eq!(expand_uid_pattern("ffn.5").unwrap(), vec!["ffn.5"]);
        for bad in [
            "ffn.[3:3]",
            "ffn.[a:4]",
            "ffn.[0:4",
            "ffn",
            "ffn.[0:1000].[0:1000]",
        ] {
            assert!(expand_uid_pattern(bad).is_err(), "{bad}");
        }
    }
}
