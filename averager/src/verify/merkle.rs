//! Commitments to runs of `f32` values and proofs that one block belongs to a run, on BLAKE3's
//! own hash tree: the root of a run is `blake3::hash` of its little-endian bytes (computed at
//! full SIMD speed, 6-7 GB/s on one core here), a block is one BLAKE3 chunk ([`BLOCK`] values,
//! 1 KiB), and a block's proof is the chaining values of the sibling subtrees on its way up
//! (`blake3::hazmat`), about `log2(blocks)` hashes.

use blake3::hazmat::{
    left_subtree_len, merge_subtrees_non_root, merge_subtrees_root, ChainingValue, HasherExt, Mode,
};

/// Values per block: one BLAKE3 chunk (1 KiB). Small enough that a revealed block of every
/// member of an 8-member group fits one DHT entry.
pub const BLOCK: usize = blake3::CHUNK_LEN / 4;

/// A 32-byte hash (a root or a chaining value).
pub type Digest = [u8; 32];

fn bytes(values: &[f32]) -> &[u8] {
    bytemuck::cast_slice(values)
}

/// Number of blocks of a run of `len` values (at least one).
pub fn leaves(len: usize) -> usize {
    len.div_ceil(BLOCK).max(1)
}

/// The element range of block `index` in a run of `len` values.
pub fn block_range(len: usize, index: usize) -> std::ops::Range<usize> {
    let start = (index * BLOCK).min(len);
    start..(start + BLOCK).min(len)
}

/// The chaining value of the subtree over `data`, which starts `offset` bytes into the run.
fn chaining_value(data: &[u8], offset: usize) -> ChainingValue {
    let mut h = blake3::Hasher::new();
    h.set_input_offset(offset as u64);
    h.update(data);
    h.finalize_non_root()
}

/// The root over `values`: `blake3::hash` of their little-endian bytes.
///
/// ```
/// use starling_averager::verify::merkle::{block_range, path, root, verify_block};
/// let values: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5).collect();
/// let r = root(&values);
/// let p = path(&values, 2);
/// assert!(verify_block(&values[block_range(values.len(), 2)], 2, values.len(), &p, &r));
/// assert!(!verify_block(&[1.0; 256], 2, values.len(), &p, &r));
/// ```
pub fn root(values: &[f32]) -> Digest {
    *blake3::hash(bytes(values)).as_bytes()
}

/// One level of a descent: into the left subtree?, and the level's `lo`, `mid`, `hi` bytes.
type Step = (bool, usize, usize, usize);

/// Which way the descent to the byte offset `target` goes at each level of the tree over
/// `total` bytes, top down (`true`: into the left subtree), with each level's bounds, and the
/// block's own byte range at the bottom.
fn descend(total: usize, target: usize) -> (Vec<Step>, (usize, usize)) {
    let (mut lo, mut hi) = (0usize, total);
    let mut steps = Vec::new();
    while hi - lo > blake3::CHUNK_LEN {
        let mid = lo + left_subtree_len((hi - lo) as u64) as usize;
        let left = target < mid;
        steps.push((left, lo, mid, hi));
        if left {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    (steps, (lo, hi))
}

/// The proof for block `index`: the chaining values of the sibling subtrees, bottom up (empty
/// for a run of one block).
pub fn path(values: &[f32], index: usize) -> Vec<Digest> {
    let data = bytes(values);
    let (steps, _) = descend(data.len(), index * blake3::CHUNK_LEN);
    steps
        .iter()
        .rev()
        .map(|&(left, lo, mid, hi)| {
            if left {
                chaining_value(&data[mid..hi], mid)
            } else {
                chaining_value(&data[lo..mid], lo)
            }
        })
        .collect()
}

/// Whether `block` is block `index` of a run of `len` values whose root is `root`, by `path`.
/// A block of the wrong length or position, or a path of the wrong length, fails.
pub fn verify_block(
    block: &[f32],
    index: usize,
    len: usize,
    path: &[Digest],
    root: &Digest,
) -> bool {
    if index >= leaves(len) || block.len() != block_range(len, index).len() {
        return false;
    }
    let total = len * 4;
    let (steps, (lo, _)) = descend(total, index * blake3::CHUNK_LEN);
    if path.len() != steps.len() || lo != index * blake3::CHUNK_LEN {
        return false;
    }
    if steps.is_empty() {
        return blake3::hash(bytes(block)).as_bytes() == root;
    }
    let mut node = chaining_value(bytes(block), lo);
    for (depth, (&(left, ..), sibling)) in steps.iter().rev().zip(path).enumerate() {
        let (l, r) = if left {
            (&node, sibling)
        } else {
            (sibling, &node)
        };
        if depth + 1 == steps.len() {
            return merge_subtrees_root(l, r, Mode::Hash).as_bytes() == root;
        }
        node = merge_subtrees_non_root(l, r, Mode::Hash);
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    #[test]
    fn every_block_of_every_shape_proves_and_no_other_does() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let b = BLOCK;
        for len in [
            0,
            1,
            b - 1,
            b,
            b + 1,
            2 * b,
            2 * b + 1,
            3 * b,
            5 * b + 3,
            16 * b,
            16 * b + 7,
            10_000,
        ] {
            let values: Vec<f32> = (0..len).map(|_| rng.gen_range(-5.0f32..5.0)).collect();
            let r = root(&values);
            for i in 0..leaves(len) {
                let p = path(&values, i);
                let block = &values[block_range(len, i)];
                assert!(verify_block(block, i, len, &p, &r), "len {len} block {i}");
                if !block.is_empty() {
                    let mut changed = block.to_vec();
                    changed[0] += 1.0;
                    assert!(
                        !verify_block(&changed, i, len, &p, &r),
                        "len {len} block {i}"
                    );
                }
                if !p.is_empty() {
                    assert!(!verify_block(block, i, len, &p[..p.len() - 1], &r));
                    let mut wrong = p.clone();
                    wrong[0][0] ^= 1;
                    assert!(!verify_block(block, i, len, &wrong, &r));
                }
                if leaves(len) > 1 {
                    let other = (i + 1) % leaves(len);
                    let same = values[block_range(len, other)] == *block;
                    assert!(same || !verify_block(block, other, len, &p, &r));
                }
            }
            assert!(!verify_block(&[], leaves(len), len, &[], &r));
        }
    }

    #[test]
    fn roots_are_blake3_of_the_bits() {
        let a: Vec<f32> = (0..500).map(|i| i as f32).collect();
        let mut b = a.clone();
        b[499] = -0.0;
        let mut c = a.clone();
        c[499] = 0.0;
        assert_ne!(root(&a), root(&b));
        assert_ne!(root(&b), root(&c), "bits, not values, are committed");
        assert_ne!(root(&a[..499]), root(&a), "a shorter run is another root");
        let le: Vec<u8> = a.iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(root(&a), *blake3::hash(&le).as_bytes());
    }
}

#[cfg(test)]
mod speed {
    #[test]
    #[ignore = "a measurement"]
    fn root_speed() {
        let values: Vec<f32> = (0..10_000_000).map(|i| i as f32).collect();
        let t = std::time::Instant::now();
        let r = super::root(&values);
        let s = t.elapsed().as_secs_f64();
        println!(
            "root of 40 MB: {s:.4} s, {:.2} GB/s ({:?})",
            0.04 / s,
            &r[..4]
        );
        let t = std::time::Instant::now();
        let p = super::path(&values[..262_144], 77);
        let s = t.elapsed().as_secs_f64();
        println!(
            "path in a 1 MiB part: {:.3} ms, {} hashes",
            s * 1e3,
            p.len()
        );
    }
}
