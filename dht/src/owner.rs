//! Owner-protected keys and sub-keys.
//!
//! A key or sub-key that contains the marker `[owner:<64 hex digits>]` (an ed25519 public key)
//! belongs to that key's holder: an entry under it is accepted only with a valid signature made
//! by that key over `(key, sub-key, value, expiration)`. When both the key and the sub-key carry a
//! marker they must name the same owner. The signed message is domain-separated so a signature
//! made for another purpose cannot be replayed here.

use ed25519_dalek::{Signature, Signer, SigningKey, Verifier, VerifyingKey};

use crate::{DhtError, Entry};

const MARKER_PREFIX: &str = "[owner:";
const DOMAIN: &[u8] = b"starling-dht-entry-v1\0";
const DOCUMENT_DOMAIN: &[u8] = b"starling-signed-document-v1\0";

/// The signing half of an owner identity (normally the node's own ed25519 identity key).
#[derive(Clone)]
pub struct OwnerKey {
    signing: SigningKey,
}

impl std::fmt::Debug for OwnerKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "OwnerKey({})", hex::encode(self.public().as_bytes()))
    }
}

impl OwnerKey {
    /// An owner key from the 32 secret bytes of an ed25519 key.
    pub fn from_secret_bytes(secret: &[u8; 32]) -> Self {
        OwnerKey {
            signing: SigningKey::from_bytes(secret),
        }
    }

    /// The public half.
    pub fn public(&self) -> VerifyingKey {
        self.signing.verifying_key()
    }

    /// The marker to embed in keys or sub-keys that only this owner may write.
    pub fn marker(&self) -> String {
        owner_marker(&self.public())
    }

    /// Signs `entry` for `key`, replacing any previous signature.
    ///
    /// ```
    /// use starling_dht::{owner::verify_entry, Entry, OwnerKey};
    /// let owner = OwnerKey::from_secret_bytes(&[7u8; 32]);
    /// let key = format!("peers.{}", owner.marker());
    /// let mut e = Entry::new("", b"hello".to_vec(), 1_000);
    /// owner.sign_entry(&key, &mut e);
    /// assert!(verify_entry(&key, &e).is_ok());
    /// e.value = b"forged".to_vec();
    /// assert!(verify_entry(&key, &e).is_err());
    /// ```
    pub fn sign_entry(&self, key: &str, entry: &mut Entry) {
        let msg = signed_message(key, entry);
        let sig = self.signing.sign(&msg).to_bytes();
        // This process made it: its checks (before sending, when stored locally, when read
        // back) need no curve arithmetic.
        crate::seen::remember(crate::seen::digest(&self.public(), &sig, &msg));
        entry.signature = Some(sig.to_vec());
    }

    /// Signs a document `msg` for the purpose named by `domain` (for example a training run's
    /// manifest): the signature covers the domain and the bytes, so it never verifies as a DHT
    /// entry's or as another purpose's. Check it with [`verify_document`].
    ///
    /// ```
    /// use starling_dht::{owner::verify_document, OwnerKey};
    /// let alice = OwnerKey::from_secret_bytes(&[7u8; 32]);
    /// let sig = alice.sign_document("starling-run-manifest-v1", b"{\"lr\":0.1}");
    /// assert!(verify_document(&alice.public(), "starling-run-manifest-v1", b"{\"lr\":0.1}", &sig).is_ok());
    /// assert!(verify_document(&alice.public(), "starling-run-manifest-v1", b"{\"lr\":9.9}", &sig).is_err());
    /// assert!(verify_document(&alice.public(), "another-purpose", b"{\"lr\":0.1}", &sig).is_err());
    /// ```
    pub fn sign_document(&self, domain: &str, msg: &[u8]) -> [u8; 64] {
        self.signing.sign(&document_message(domain, msg)).to_bytes()
    }
}

/// Checks a signature made by [`OwnerKey::sign_document`] for `domain` over `msg`.
pub fn verify_document(
    owner: &VerifyingKey,
    domain: &str,
    msg: &[u8],
    signature: &[u8],
) -> Result<(), DhtError> {
    let bad = || DhtError::BadSignature {
        key: domain.to_string(),
        subkey: String::new(),
    };
    let bytes: [u8; 64] = signature.try_into().map_err(|_| bad())?;
    owner
        .verify(
            &document_message(domain, msg),
            &Signature::from_bytes(&bytes),
        )
        .map_err(|_| bad())
}

/// `DOCUMENT_DOMAIN || len(domain) || domain || msg`: never a prefix of an entry's message,
/// whose domain string differs.
fn document_message(domain: &str, msg: &[u8]) -> Vec<u8> {
    let mut m = Vec::with_capacity(DOCUMENT_DOMAIN.len() + 8 + domain.len() + msg.len());
    m.extend_from_slice(DOCUMENT_DOMAIN);
    m.extend_from_slice(&(domain.len() as u64).to_le_bytes());
    m.extend_from_slice(domain.as_bytes());
    m.extend_from_slice(msg);
    m
}

/// The marker string for an owner's public key: `[owner:<hex>]`.
pub fn owner_marker(public: &VerifyingKey) -> String {
    format!("{MARKER_PREFIX}{}]", hex::encode(public.as_bytes()))
}

/// Finds the single owner marker in `s`, if any.
fn find_owner(s: &str) -> Result<Option<VerifyingKey>, DhtError> {
    let mut found = None;
    let mut rest = s;
    while let Some(pos) = rest.find(MARKER_PREFIX) {
        let after = &rest[pos + MARKER_PREFIX.len()..];
        let end = after
            .find(']')
            .ok_or_else(|| DhtError::BadOwner("unterminated owner marker".into()))?;
        let bytes = hex::decode(&after[..end])
            .map_err(|_| DhtError::BadOwner("owner marker is not hex".into()))?;
        let bytes: [u8; 32] = bytes
            .try_into()
            .map_err(|_| DhtError::BadOwner("owner key must be 32 bytes".into()))?;
        let key = crate::seen::owner_key(&bytes)
            .map_err(|_| DhtError::BadOwner("owner key is not a valid ed25519 point".into()))?;
        if found.is_some_and(|f: VerifyingKey| f != key) {
            return Err(DhtError::BadOwner(
                "two different owners in one name".into(),
            ));
        }
        found = Some(key);
        rest = &after[end..];
    }
    Ok(found)
}

/// The owner who must sign entries under `(key, subkey)`, if the names carry a marker.
///
/// ```
/// use starling_dht::{required_owner, OwnerKey};
/// let owner = OwnerKey::from_secret_bytes(&[1u8; 32]);
/// assert!(required_owner("plain", "sub").unwrap().is_none());
/// assert_eq!(required_owner("plain", &owner.marker()).unwrap(), Some(owner.public()));
/// ```
pub fn required_owner(key: &str, subkey: &str) -> Result<Option<VerifyingKey>, DhtError> {
    let k = find_owner(key)?;
    let s = find_owner(subkey)?;
    match (k, s) {
        (Some(a), Some(b)) if a != b => Err(DhtError::BadOwner(
            "key and sub-key name different owners".into(),
        )),
        (a, b) => Ok(a.or(b)),
    }
}

/// Checks that `entry` carries a valid signature if `(key, entry.subkey)` names an owner.
pub fn verify_entry(key: &str, entry: &Entry) -> Result<(), DhtError> {
    let Some(owner) = required_owner(key, &entry.subkey)? else {
        return Ok(());
    };
    let bad = || DhtError::BadSignature {
        key: key.to_string(),
        subkey: entry.subkey.clone(),
    };
    let sig_bytes: [u8; 64] = entry
        .signature
        .as_deref()
        .ok_or_else(bad)?
        .try_into()
        .map_err(|_| bad())?;
    // An entry is checked several times in one process (before sending, when stored, each
    // time a lookup returns it): the curve arithmetic runs once per exact (owner, signature,
    // message), see `seen`.
    let msg = signed_message(key, entry);
    let digest = crate::seen::digest(&owner, &sig_bytes, &msg);
    if crate::seen::checked(&digest) {
        return Ok(());
    }
    owner
        .verify(&msg, &Signature::from_bytes(&sig_bytes))
        .map_err(|_| bad())?;
    crate::seen::remember(digest);
    Ok(())
}

fn signed_message(key: &str, entry: &Entry) -> Vec<u8> {
    let mut m =
        Vec::with_capacity(DOMAIN.len() + key.len() + entry.subkey.len() + entry.value.len() + 24);
    m.extend_from_slice(DOMAIN);
    for part in [key.as_bytes(), entry.subkey.as_bytes(), &entry.value] {
        m.extend_from_slice(&(part.len() as u64).to_le_bytes());
        m.extend_from_slice(part);
    }
    m.extend_from_slice(&entry.expiration.to_le_bytes());
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(seed: u8) -> OwnerKey {
        OwnerKey::from_secret_bytes(&[seed; 32])
    }

    #[test]
    fn subkey_owner_must_sign() {
        let alice = key(1);
        let mallory = key(2);
        let k = "experts.ffn";
        let mut e = Entry::new(alice.marker(), b"v".to_vec(), 10);
        assert!(matches!(
            verify_entry(k, &e),
            Err(DhtError::BadSignature { .. })
        ));
        mallory.sign_entry(k, &mut e);
        assert!(verify_entry(k, &e).is_err(), "signature by another key");
        alice.sign_entry(k, &mut e);
        assert!(verify_entry(k, &e).is_ok());
    }

    #[test]
    fn signature_covers_expiration_key_and_subkey() {
        let alice = key(1);
        let k = format!("state.{}", alice.marker());
        let mut e = Entry::new("s", b"v".to_vec(), 10);
        alice.sign_entry(&k, &mut e);
        let mut later = e.clone();
        later.expiration = 11;
        assert!(verify_entry(&k, &later).is_err());
        let mut moved = e.clone();
        moved.subkey = "t".into();
        assert!(verify_entry(&k, &moved).is_err());
        assert!(verify_entry(&format!("other.{}", alice.marker()), &e).is_err());
        let mut truncated = e.clone();
        truncated.signature = Some(vec![0; 10]);
        assert!(verify_entry(&k, &truncated).is_err());
    }

    #[test]
    fn a_remembered_check_never_passes_another_entry() {
        let alice = key(4);
        let k = format!("progress.{}", alice.marker());
        let mut e = Entry::new("s", b"v".to_vec(), 10);
        alice.sign_entry(&k, &mut e);
        // Checked twice (the second from memory), then every change is checked afresh.
        assert!(verify_entry(&k, &e).is_ok() && verify_entry(&k, &e).is_ok());
        let mut forged = e.clone();
        forged.value = b"w".to_vec();
        assert!(verify_entry(&k, &forged).is_err());
        assert!(
            verify_entry(&k, &forged).is_err(),
            "a failed check is not remembered"
        );
        let mut resigned = e.clone();
        key(5).sign_entry(&k, &mut resigned);
        assert!(verify_entry(&k, &resigned).is_err());
        // A signature another process made (nothing remembered of it) still verifies.
        let bob = key(6);
        let kb = format!("progress.{}", bob.marker());
        let mut theirs = Entry::new("s", b"v".to_vec(), 10);
        theirs.signature = Some(
            bob.signing
                .sign(&signed_message(&kb, &theirs))
                .to_bytes()
                .to_vec(),
        );
        assert!(verify_entry(&kb, &theirs).is_ok());
    }

    #[test]
    fn malformed_markers_are_errors() {
        assert!(required_owner("[owner:zz]", "").is_err());
        assert!(required_owner("[owner:abcd", "").is_err());
        assert!(required_owner("[owner:00]", "").is_err());
        let a = key(1).marker();
        let b = key(2).marker();
        assert!(required_owner(&a, &b).is_err());
        assert!(required_owner(&format!("{a}{b}"), "").is_err());
        assert!(required_owner(&a, &a).unwrap().is_some());
    }
}
