//! The board: what a node tells the swarm about itself in its [heartbeat](crate::heartbeat),
//! as sections that the components running on the node fill.
//!
//! The node knows no section's meaning. Each component (the averager's measured bandwidth,
//! training progress, hosted experts) declares a type that implements [`Section`]: a name, a
//! version and a serde form. [`Board::put`] stores it as postcard bytes under its name;
//! [`Board::get`] decodes it for a reader that knows the type, and gives `None` when the section
//! is absent, has another version, or does not decode (a newer or a foreign peer). A new
//! dashboard field therefore changes the crate that owns it, not node/ or its wire format.
//!
//! Bounded: at most [`MAX_SECTIONS`] sections, names of at most [`MAX_NAME_LEN`] bytes, and at
//! most [`MAX_SECTION_BYTES`] encoded bytes each; [`Board::put`] refuses what does not fit and
//! a reader drops what a peer sent beyond the bounds ([`Board::within_bounds`]).
//!
//! ```
//! use serde::{Deserialize, Serialize};
//! use starling_node::board::{Board, Section};
//!
//! #[derive(Debug, PartialEq, Serialize, Deserialize)]
//! struct Jobs { done: u64 }
//! impl Section for Jobs {
//!     const NAME: &'static str = "jobs";
//!     const VERSION: u32 = 1;
//! }
//!
//! let mut board = Board::default();
//! board.put(&Jobs { done: 3 })?;
//! assert_eq!(board.get::<Jobs>(), Some(Jobs { done: 3 }));
//! assert_eq!(board.names().collect::<Vec<_>>(), vec!["jobs"]);
//! # Ok::<(), starling_node::board::BoardError>(())
//! ```

use std::collections::BTreeMap;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// Most sections on one board.
pub const MAX_SECTIONS: usize = 16;
/// Longest section name, in bytes.
pub const MAX_NAME_LEN: usize = 32;
/// Largest encoded section, in bytes (a heartbeat must fit one DHT value).
pub const MAX_SECTION_BYTES: usize = 2048;

/// `s` cut to at most `max_bytes` bytes, at a character boundary: how sections (and the
/// heartbeat) keep names and uids within their bounds.
///
/// ```
/// assert_eq!(starling_node::board::cut("héllo", 2), "h");
/// assert_eq!(starling_node::board::cut("run", 128), "run");
/// ```
pub fn cut(s: &str, max_bytes: usize) -> String {
    let mut end = s.len().min(max_bytes);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_string()
}

/// A typed section of the board: its owner implements this for its serde type.
pub trait Section: Serialize + DeserializeOwned {
    /// The section's name (at most [`MAX_NAME_LEN`] bytes), unique in the workspace: by
    /// convention the owning crate's (`averager`, `training`, `experts`).
    const NAME: &'static str;
    /// The version of the encoding: bump it when the type changes, and readers of the old
    /// version see the section as absent instead of misreading it.
    const VERSION: u32;
}

/// One section as it travels: its version and its postcard bytes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RawSection {
    /// The [`Section::VERSION`] it was written with.
    pub version: u32,
    /// The encoded value.
    pub bytes: Vec<u8>,
}

/// A board refused a section.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum BoardError {
    /// The section's name is empty or longer than [`MAX_NAME_LEN`].
    #[error("board section name {0:?} must have 1 to {MAX_NAME_LEN} bytes")]
    Name(String),
    /// The encoded section is larger than [`MAX_SECTION_BYTES`].
    #[error("board section {name:?} encodes to {bytes} bytes; at most {MAX_SECTION_BYTES} fit")]
    TooLarge {
        /// The section.
        name: String,
        /// Its encoded size.
        bytes: usize,
    },
    /// The board already holds [`MAX_SECTIONS`] other sections.
    #[error("the board holds {MAX_SECTIONS} sections already; {0:?} does not fit")]
    Full(String),
    /// The value could not be encoded.
    #[error("board section {name:?} does not encode: {reason}")]
    Encode {
        /// The section.
        name: String,
        /// Why.
        reason: String,
    },
}

/// What a node tells the swarm about itself: named, versioned, opaque sections. See the
/// [module docs](self).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Board {
    sections: BTreeMap<String, RawSection>,
}

impl Board {
    /// Sets section `S` to `value`, replacing what was there.
    pub fn put<S: Section>(&mut self, value: &S) -> Result<(), BoardError> {
        let name = S::NAME;
        if name.is_empty() || name.len() > MAX_NAME_LEN {
            return Err(BoardError::Name(name.to_string()));
        }
        let bytes = postcard::to_stdvec(value).map_err(|e| BoardError::Encode {
            name: name.to_string(),
            reason: e.to_string(),
        })?;
        if bytes.len() > MAX_SECTION_BYTES {
            return Err(BoardError::TooLarge {
                name: name.to_string(),
                bytes: bytes.len(),
            });
        }
        if !self.sections.contains_key(name) && self.sections.len() >= MAX_SECTIONS {
            return Err(BoardError::Full(name.to_string()));
        }
        self.sections.insert(
            name.to_string(),
            RawSection {
                version: S::VERSION,
                bytes,
            },
        );
        Ok(())
    }

    /// Section `S`, when the board holds it in `S`'s version and it decodes.
    pub fn get<S: Section>(&self) -> Option<S> {
        let raw = self.sections.get(S::NAME)?;
        if raw.version != S::VERSION {
            return None;
        }
        postcard::from_bytes(&raw.bytes).ok()
    }

    /// Removes section `name`; whether it was there.
    pub fn remove(&mut self, name: &str) -> bool {
        self.sections.remove(name).is_some()
    }

    /// The names of the sections held, in order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.sections.keys().map(String::as_str)
    }

    /// The board with only the sections within the bounds (at most [`MAX_SECTIONS`], names and
    /// sizes within theirs): what a reader keeps of a board a peer sent.
    pub fn within_bounds(mut self) -> Board {
        self.sections.retain(|name, raw| {
            !name.is_empty() && name.len() <= MAX_NAME_LEN && raw.bytes.len() <= MAX_SECTION_BYTES
        });
        while self.sections.len() > MAX_SECTIONS {
            self.sections.pop_last();
        }
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct A {
        x: f64,
        names: Vec<String>,
    }
    impl Section for A {
        const NAME: &'static str = "a";
        const VERSION: u32 = 2;
    }

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct OldA {
        x: f64,
    }
    impl Section for OldA {
        const NAME: &'static str = "a";
        const VERSION: u32 = 1;
    }

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct N(u8);
    impl Section for N {
        const NAME: &'static str = "this-name-is-much-longer-than-thirty-two-bytes";
        const VERSION: u32 = 1;
    }

    #[test]
    fn sections_round_trip_and_other_versions_read_as_absent() {
        let mut b = Board::default();
        let a = A {
            x: 1.5,
            names: vec!["ffn.0.1".into()],
        };
        b.put(&a).unwrap();
        assert_eq!(b.get::<A>(), Some(a));
        assert_eq!(b.get::<OldA>(), None);
        let wire: Board = postcard::from_bytes(&postcard::to_stdvec(&b).unwrap()).unwrap();
        assert_eq!(wire, b);
        assert!(b.remove("a"));
        assert_eq!(b.get::<A>(), None);
    }

    #[test]
    fn oversized_misnamed_and_surplus_sections_are_refused_or_dropped() {
        let mut b = Board::default();
        let big = A {
            x: 0.0,
            names: vec!["x".repeat(MAX_SECTION_BYTES)],
        };
        assert!(matches!(b.put(&big), Err(BoardError::TooLarge { .. })));
        assert!(matches!(b.put(&N(1)), Err(BoardError::Name(_))));
        // A peer's board beyond the bounds: a reader keeps what fits.
        let mut sections = BTreeMap::new();
        for i in 0..(MAX_SECTIONS + 5) {
            sections.insert(
                format!("s{i:02}"),
                RawSection {
                    version: 1,
                    bytes: vec![0; 4],
                },
            );
        }
        sections.insert(
            "huge".into(),
            RawSection {
                version: 1,
                bytes: vec![0; MAX_SECTION_BYTES + 1],
            },
        );
        let kept = Board { sections }.within_bounds();
        assert_eq!(kept.names().count(), MAX_SECTIONS);
        assert!(kept.names().all(|n| n != "huge"));
    }
}
