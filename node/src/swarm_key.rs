//! [`SwarmKey`]: the pre-shared key of a private swarm, in libp2p's swarm-key file format.

use std::path::Path;
use std::str::FromStr;

use libp2p::pnet::PreSharedKey;
use rand::RngCore;

use crate::NodeError;

/// A private swarm's 256-bit pre-shared key.
///
/// Stored in the standard libp2p swarm-key text format (`/key/swarm/psk/1.0.0/`, `/base16/`, 64 hex
/// digits), so files are interchangeable with other libp2p implementations. Anyone holding the file
/// can join; treat it like a password.
///
/// ```
/// use starling_node::SwarmKey;
/// let key = SwarmKey::generate();
/// let text = key.to_file_string();
/// let back: SwarmKey = text.parse().unwrap();
/// assert_eq!(back.fingerprint(), key.fingerprint());
/// ```
#[derive(Clone, Copy)]
pub struct SwarmKey(PreSharedKey);

impl std::fmt::Debug for SwarmKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SwarmKey(fingerprint {})", self.fingerprint())
    }
}

impl SwarmKey {
    /// A fresh random key from the operating system's generator.
    pub fn generate() -> Self {
        let mut bytes = [0u8; 32];
        rand::rngs::OsRng.fill_bytes(&mut bytes);
        SwarmKey(PreSharedKey::new(bytes))
    }

    /// The key from raw bytes.
    pub fn from_bytes(bytes: [u8; 32]) -> Self {
        SwarmKey(PreSharedKey::new(bytes))
    }

    /// A short public fingerprint that identifies the swarm without revealing the key.
    pub fn fingerprint(&self) -> String {
        self.0.fingerprint().to_string()
    }

    /// The file contents.
    pub fn to_file_string(&self) -> String {
        format!("{}\n", self.0)
    }

    /// Reads a key file.
    pub fn read(path: &Path) -> Result<Self, NodeError> {
        let text = std::fs::read_to_string(path).map_err(|source| NodeError::Io {
            path: path.display().to_string(),
            source,
        })?;
        text.parse().map_err(|e: String| NodeError::SwarmKey {
            path: path.display().to_string(),
            reason: e,
        })
    }

    /// Writes the key to a new file with owner-only permissions; refuses to overwrite.
    pub fn write_new(&self, path: &Path) -> Result<(), NodeError> {
        crate::identity::write_private_file(path, self.to_file_string().as_bytes(), false)
    }

    /// The key in the form libp2p's `pnet` takes.
    pub(crate) fn psk(&self) -> PreSharedKey {
        self.0
    }
}

impl FromStr for SwarmKey {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        PreSharedKey::from_str(s.trim_end())
            .map(SwarmKey)
            .map_err(|e| e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_malformed_files() {
        assert!("".parse::<SwarmKey>().is_err());
        assert!("/key/swarm/psk/1.0.0/\n/base16/\nzz"
            .parse::<SwarmKey>()
            .is_err());
        assert!("/key/swarm/psk/1.0.0/\n/base16/\nabcd"
            .parse::<SwarmKey>()
            .is_err());
    }

    #[test]
    fn file_round_trip_and_no_overwrite() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("lab.swarm");
        let key = SwarmKey::generate();
        key.write_new(&path).unwrap();
        assert_eq!(
            SwarmKey::read(&path).unwrap().fingerprint(),
            key.fingerprint()
        );
        assert!(SwarmKey::generate().write_new(&path).is_err());
        assert_ne!(SwarmKey::generate().fingerprint(), key.fingerprint());
    }
}
