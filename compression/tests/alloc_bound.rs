//! Decoding never allocates more than the bound [`DecodeOptions::max_elements`] documents, whatever the bytes:
//! 4 bytes per element of output plus, for a zstd frame, its raw body. A counting global allocator measures the
//! peak of live heap bytes during each decode. This file holds one test so nothing else allocates concurrently.
//! (zstd's own context is allocated by C code and is not counted.)

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use proptest::prelude::*;
use starling_compression::{decode, encode, Codec, DecodeOptions, EncodeOptions};

struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let live = LIVE.fetch_add(layout.size(), Ordering::SeqCst) + layout.size();
        PEAK.fetch_max(live, Ordering::SeqCst);
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Ordering::SeqCst);
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

const LIMIT: usize = 1 << 14;

/// Peak heap bytes allocated (beyond those live before) while decoding `bytes`.
fn peak_during_decode(bytes: &[u8], opts: &DecodeOptions) -> usize {
    let base = LIVE.load(Ordering::SeqCst);
    PEAK.store(base, Ordering::SeqCst);
    let _ = decode(bytes, opts);
    PEAK.load(Ordering::SeqCst) - base
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn decode_allocation_is_bounded(
        codec in prop::sample::select(Codec::WIRE.to_vec()),
        len in 0usize..30_000,
        zstd in any::<bool>(),
        flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..6),
    ) {
        let x: Vec<f32> = (0..len).map(|i| ((i % 17) as f32) * 0.25).collect();
        let opts = if zstd { EncodeOptions::default().with_zstd(1) } else { EncodeOptions::default() };
        let mut frame = encode(codec, &x, &opts).expect("encode");
        for (at, b) in &flips {
            let i = at.index(frame.len());
            frame[i] = *b;
        }
        let dopts = DecodeOptions::default().with_max_elements(LIMIT);
        let peak = peak_during_decode(&frame, &dopts);
        // Output of at most LIMIT f32, a raw zstd body of at most 4 * LIMIT + 1024 bytes, small bookkeeping.
        let bound = 4 * LIMIT + (4 * LIMIT + 1024) + 4096;
        prop_assert!(peak <= bound, "peak {} > bound {} ({} zstd={})", peak, bound, codec, zstd);
        // Without zstd the output is also bounded by the input: at most 8 f32 bytes per input byte (u4).
        if frame.get(6) == Some(&0) {
            prop_assert!(peak <= 8 * frame.len() + 4096, "peak {} for a {}-byte frame", peak, frame.len());
        }
    }
}
