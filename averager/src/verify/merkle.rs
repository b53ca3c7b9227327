//! A binary SHA-256 hash tree over a run of `f32` values in blocks of [`BLOCK`] elements, so a
//! signed root commits to every value and one block can be shown with a short path.
//!
//! Leaves are `SHA-256(0x00 || len || little-endian values)`, inner nodes
//! `SHA-256(0x01 || left || right)`; a level of odd length carries its last node up unchanged.
//! The leaf and node prefixes keep a leaf from ever passing for an inner node.

use sha2::{Digest as _, Sha256};

/// Elements per leaf. Small enough that a revealed block of every member of a 16-member group
/// fits one DHT entry, large enough that hashing stays a small cost beside the transfer.
pub const BLOCK: usize = 64;

/// A SHA-256 digest.
pub type Digest = [u8; 32];

/// The hash of one block of values.
pub fn leaf(values: &[f32]) -> Digest {
    let mut h = Sha256::new();
    h.update([0u8]);
    h.update((values.len() as u64).to_le_bytes());
    h.update(bytemuck::cast_slice::<f32, u8>(values));
    h.finalize().into()
}

fn node(left: &Digest, right: &Digest) -> Digest {
    let mut h = Sha256::new();
    h.update([1u8]);
    h.update(left);
    h.update(right);
    h.finalize().into()
}

/// Number of leaves (blocks) of a run of `len` values (at least one).
pub fn leaves(len: usize) -> usize {
    len.div_ceil(BLOCK).max(1)
}

/// The element range of block `index` in a run of `len` values.
pub fn block_range(len: usize, index: usize) -> std::ops::Range<usize> {
    let start = (index * BLOCK).min(len);
    start..(start + BLOCK).min(len)
}

fn next_level(level: &[Digest]) -> Vec<Digest> {
    level
        .chunks(2)
        .map(|pair| match pair {
            [l, r] => node(l, r),
            [only] => *only,
            _ => unreachable!("chunks(2) yields one or two"),
        })
        .collect()
}

fn leaf_level(values: &[f32]) -> Vec<Digest> {
    if values.is_empty() {
        return vec![leaf(values)];
    }
    values.chunks(BLOCK).map(leaf).collect()
}

/// The root over `values`.
///
/// ```
/// use starling_averager::verify::merkle::{root, path, verify_path, leaf, block_range};
/// let values: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5).collect();
/// let r = root(&values);
/// let p = path(&values, 7);
/// let block = &values[block_range(values.len(), 7)];
/// assert!(verify_path(&leaf(block), 7, values.len(), &p, &r));
/// assert!(!verify_path(&leaf(&[1.0]), 7, values.len(), &p, &r));
/// ```
pub fn root(values: &[f32]) -> Digest {
    let mut level = leaf_level(values);
    while level.len() > 1 {
        level = next_level(&level);
    }
    level[0]
}

/// The sibling hashes from block `index`'s leaf up to the root (empty where a level carried
/// the node up without a sibling).
pub fn path(values: &[f32], index: usize) -> Vec<Digest> {
    let mut level = leaf_level(values);
    let mut at = index;
    let mut out = Vec::new();
    while level.len() > 1 {
        let sibling = at ^ 1;
        if sibling < level.len() {
            out.push(level[sibling]);
        }
        level = next_level(&level);
        at /= 2;
    }
    out
}

/// Whether `leaf_hash`, as block `index` of a run of `len` values, leads through `path` to
/// `root`. A path of the wrong length for the run's shape fails.
pub fn verify_path(
    leaf_hash: &Digest,
    index: usize,
    len: usize,
    path: &[Digest],
    root: &Digest,
) -> bool {
    let mut width = leaves(len);
    if index >= width {
        return false;
    }
    let mut at = index;
    let mut hash = *leaf_hash;
    let mut siblings = path.iter();
    while width > 1 {
        let sibling = at ^ 1;
        if sibling < width {
            let Some(s) = siblings.next() else {
                return false;
            };
            hash = if at % 2 == 0 {
                node(&hash, s)
            } else {
                node(s, &hash)
            };
        }
        at /= 2;
        width = width.div_ceil(2);
    }
    siblings.next().is_none() && hash == *root
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    #[test]
    fn every_block_of_every_shape_proves_and_no_other_does() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        for len in [0, 1, 63, 64, 65, 127, 128, 129, 64 * 5 + 3, 64 * 16, 10_000] {
            let values: Vec<f32> = (0..len).map(|_| rng.gen_range(-5.0f32..5.0)).collect();
            let r = root(&values);
            for i in 0..leaves(len) {
                let p = path(&values, i);
                let b = &values[block_range(len, i)];
                assert!(verify_path(&leaf(b), i, len, &p, &r), "len {len} block {i}");
                // The same block claimed at another index, a changed value, a cut path: refused.
                if leaves(len) > 1 {
                    let other = (i + 1) % leaves(len);
                    assert!(
                        !verify_path(&leaf(b), other, len, &p, &r) || {
                            let ob = &values[block_range(len, other)];
                            ob == b
                        }
                    );
                    assert!(!verify_path(&leaf(b), i, len, &p[..p.len() - 1], &r));
                }
                if !b.is_empty() {
                    let mut changed = b.to_vec();
                    changed[0] += 1.0;
                    assert!(!verify_path(&leaf(&changed), i, len, &p, &r));
                }
            }
            assert!(!verify_path(&leaf(&[]), leaves(len), len, &[], &r));
        }
    }

    #[test]
    fn roots_differ_when_any_value_does() {
        let a: Vec<f32> = (0..500).map(|i| i as f32).collect();
        let mut b = a.clone();
        b[499] = -0.0;
        let mut c = a.clone();
        c[499] = 0.0;
        assert_ne!(root(&a), root(&b));
        assert_ne!(root(&b), root(&c), "bits, not values, are committed");
        assert_ne!(root(&a[..499]), root(&a), "a shorter run is another root");
    }
}
