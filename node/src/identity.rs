//! A node's identity: the ed25519 key file (created with 0600 permissions), and the mapping
//! between that key, the peer id it names, and the DHT owner key that signs its records.

use std::io::Write;
use std::path::Path;

use libp2p::identity::Keypair;
use starling_dht::OwnerKey;

use crate::NodeError;

/// Loads the node's ed25519 identity from `path`, creating it (with 0600 permissions) when the
/// file does not exist. The same key names the peer and signs its DHT records.
///
/// ```
/// let dir = tempfile::tempdir().unwrap();
/// let path = dir.path().join("id.key");
/// let a = starling_node::load_or_create_identity(&path).unwrap();
/// let b = starling_node::load_or_create_identity(&path).unwrap();
/// assert_eq!(a.public().to_peer_id(), b.public().to_peer_id());
/// ```
pub fn load_or_create_identity(path: &Path) -> Result<Keypair, NodeError> {
    let display = path.display().to_string();
    match std::fs::read(path) {
        Ok(bytes) => {
            warn_if_readable_by_others(path);
            let key = Keypair::from_protobuf_encoding(&bytes).map_err(|e| NodeError::Identity {
                path: display.clone(),
                reason: e.to_string(),
            })?;
            if key.clone().try_into_ed25519().is_err() {
                return Err(NodeError::Identity {
                    path: display,
                    reason: "only ed25519 identities are supported".into(),
                });
            }
            Ok(key)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let key = Keypair::generate_ed25519();
            let bytes = key
                .to_protobuf_encoding()
                .map_err(|e| NodeError::Identity {
                    path: display.clone(),
                    reason: e.to_string(),
                })?;
            write_private_file(path, &bytes, false)?;
            tracing::info!(path = %path.display(), peer = %key.public().to_peer_id(), "created a new identity");
            Ok(key)
        }
        Err(source) => Err(NodeError::Io {
            path: display,
            source,
        }),
    }
}

/// The DHT owner key (for signed records) of an ed25519 identity.
pub fn owner_key_of(keypair: &Keypair) -> Option<OwnerKey> {
    let ed = keypair.clone().try_into_ed25519().ok()?;
    let bytes = ed.to_bytes();
    let mut secret = [0u8; 32];
    secret.copy_from_slice(&bytes[..32]);
    Some(OwnerKey::from_secret_bytes(&secret))
}

/// The peer id of the node whose identity is the ed25519 key `owner` (the key in a DHT owner
/// marker). Lets a reader check that a signed record about a peer was written by that peer.
///
/// ```
/// let keypair = starling_node::Keypair::generate_ed25519();
/// let owner = starling_node::owner_key_of(&keypair).unwrap();
/// assert_eq!(
///     starling_node::peer_id_of_owner(&owner.public()),
///     Some(keypair.public().to_peer_id())
/// );
/// ```
pub fn peer_id_of_owner(owner: &starling_dht::VerifyingKey) -> Option<libp2p::PeerId> {
    let ed = libp2p::identity::ed25519::PublicKey::try_from_bytes(owner.as_bytes()).ok()?;
    Some(libp2p::identity::PublicKey::from(ed).to_peer_id())
}

/// The ed25519 key of the node whose peer id is `peer` (the inverse of [`peer_id_of_owner`]):
/// `None` for a peer id that does not embed an ed25519 key. Lets a reader check a signature
/// made by a peer it knows only by id.
///
/// ```
/// let keypair = starling_node::Keypair::generate_ed25519();
/// let owner = starling_node::owner_key_of(&keypair).unwrap();
/// assert_eq!(
///     starling_node::owner_of_peer(&keypair.public().to_peer_id()),
///     Some(owner.public())
/// );
/// ```
pub fn owner_of_peer(peer: &libp2p::PeerId) -> Option<starling_dht::VerifyingKey> {
    let hash: &libp2p::multihash::Multihash<64> = peer.as_ref();
    // Ed25519 keys are short enough to be inlined: the identity multihash (code 0) of the
    // protobuf-encoded public key.
    if hash.code() != 0 {
        return None;
    }
    let public = libp2p::identity::PublicKey::try_decode_protobuf(hash.digest()).ok()?;
    let ed = public.try_into_ed25519().ok()?;
    starling_dht::VerifyingKey::from_bytes(&ed.to_bytes()).ok()
}

/// Writes a file that only its owner may read (mode 0600 on Unix), refusing to overwrite unless
/// `overwrite` is set.
pub(crate) fn write_private_file(
    path: &Path,
    bytes: &[u8],
    overwrite: bool,
) -> Result<(), NodeError> {
    let io = |source| NodeError::Io {
        path: path.display().to_string(),
        source,
    };
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(io)?;
    }
    let mut options = std::fs::OpenOptions::new();
    options.write(true);
    if overwrite {
        options.create(true).truncate(true);
    } else {
        options.create_new(true);
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    let mut file = options.open(path).map_err(io)?;
    file.write_all(bytes).map_err(io)?;
    file.sync_all().map_err(io)
}

/// Logs a warning when a key file's mode lets group or others read it (Unix only).
fn warn_if_readable_by_others(path: &Path) {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        if let Ok(meta) = std::fs::metadata(path) {
            if meta.permissions().mode() & 0o077 != 0 {
                tracing::warn!(path = %path.display(), "identity file is readable by other users; run chmod 600 on it");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn created_with_owner_only_permissions() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/id.key");
        let key = load_or_create_identity(&path).unwrap();
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&path).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600);
        }
        let owner = owner_key_of(&key).unwrap();
        let ed = key.public().try_into_ed25519().unwrap();
        assert_eq!(owner.public().as_bytes(), &ed.to_bytes());
    }

    #[test]
    fn garbage_identity_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("id.key");
        std::fs::write(&path, b"not a key").unwrap();
        assert!(matches!(
            load_or_create_identity(&path),
            Err(NodeError::Identity { .. })
        ));
    }
}
