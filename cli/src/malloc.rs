//! The C allocator's thresholds for a process that computes tensors (glibc only).
//!
//! Every batch allocates its activations and gradients afresh (candle's tensors), and frees them
//! before the next: for the generated-glyphs MLP, a dozen buffers of 100 KiB to 1 MiB a batch.
//! glibc serves an allocation at or above its mmap threshold (128 KiB at start) with a fresh `mmap`
//! and returns it with `munmap` when freed, so each such buffer cost a system call each way and a
//! page fault for every 4 KiB page it touched, every batch. glibc raises the threshold itself once
//! the process frees a mapped buffer larger than it (up to 32 MiB), which is why a run sped up
//! after its first evaluation freed the test set's tensors: measured on the MLP (188 epochs of 2048
//! samples, one core), 3.2-3.7 s with no evaluation before the end, 2.7-3.0 s with one every 31
//! epochs, and 2.4-2.5 s either way with the thresholds set at start as below. The peak resident
//! memory did not change (90 MiB against 93 MiB; the charlm 603 against 593).
//!
//! Set here to what glibc would reach after freeing a 32 MiB buffer: the mmap threshold at
//! 32 MiB, the trim threshold (free memory at the top of the heap kept for reuse rather than
//! returned to the system) at twice that. A user who tunes malloc through `GLIBC_TUNABLES` or
//! `MALLOC_*_` variables keeps their settings.

/// The mmap threshold set at start: buffers below it come from the heap and are reused.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const MMAP_THRESHOLD: usize = 32 << 20;

/// Sets the allocator's thresholds (see the module docs) unless the environment tunes malloc
/// already. Call it first thing in `main`: it changes speed, never results.
pub fn tune_for_tensors() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        if user_tunes_malloc(std::env::vars_os()) {
            tracing::debug!("malloc thresholds left as the environment sets them");
            return;
        }
        match set_thresholds() {
            Ok(()) => tracing::debug!(
                mmap_threshold = MMAP_THRESHOLD,
                "malloc: buffers below the mmap threshold are reused"
            ),
            Err(e) => tracing::debug!("malloc thresholds not set: {e}"),
        }
    }
}

/// Whether the environment tunes glibc's malloc: `GLIBC_TUNABLES` with a `glibc.malloc.`
/// setting, or a `MALLOC_..._` variable.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn user_tunes_malloc(vars: impl Iterator<Item = (std::ffi::OsString, std::ffi::OsString)>) -> bool {
    vars.into_iter().any(|(k, v)| {
        let k = k.to_string_lossy();
        (k == "GLIBC_TUNABLES" && v.to_string_lossy().contains("glibc.malloc."))
            || (k.starts_with("MALLOC_") && k.ends_with('_'))
    })
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn set_thresholds() -> Result<(), String> {
    let set = |param: libc::c_int, value: usize, name: &str| {
        let value = libc::c_int::try_from(value).map_err(|_| format!("{name} too large"))?;
        // SAFETY: mallopt takes two integers and changes only the allocator's parameters; it
        // is safe to call at any time (glibc serialises it with the arenas' locks).
        if unsafe { libc::mallopt(param, value) } == 1 {
            Ok(())
        } else {
            Err(format!("mallopt({name}) refused"))
        }
    };
    // The trim threshold first: setting either also turns off glibc's own adjustment of both.
    set(
        libc::M_TRIM_THRESHOLD,
        2 * MMAP_THRESHOLD,
        "M_TRIM_THRESHOLD",
    )?;
    set(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD, "M_MMAP_THRESHOLD")
}

#[cfg(all(test, target_os = "linux", target_env = "gnu"))]
mod tests {
    use super::*;
    use std::ffi::OsString;

    fn mapped_blocks() -> usize {
        // SAFETY: mallinfo2 only reads the allocator's counters.
        unsafe { libc::mallinfo2() }.hblks
    }

    #[test]
    fn a_batch_sized_buffer_comes_from_the_heap_once_tuned() {
        // Untuned, each of these 1 MiB buffers would be mapped on its own (glibc's threshold
        // starts at 128 KiB; this test fails with the call below left out). The other tests of
        // this binary allocate nothing near the thresholds, so the global count is this one's.
        set_thresholds().unwrap();
        let before = mapped_blocks();
        let buffers: Vec<Vec<f32>> = (0..4)
            .map(|i| std::hint::black_box(vec![i as f32; 1 << 18]))
            .collect();
        assert_eq!(
            mapped_blocks(),
            before,
            "1 MiB buffers were mapped one by one"
        );
        assert!(buffers.iter().all(|b| b.len() == 1 << 18));
        // Above the threshold a buffer is still mapped (and returned when freed).
        let big = std::hint::black_box(vec![1u8; 2 * MMAP_THRESHOLD]);
        assert_eq!(mapped_blocks(), before + 1);
        drop(big);
        assert_eq!(mapped_blocks(), before);
    }

    #[test]
    fn the_environments_malloc_settings_win() {
        let env = |pairs: &[(&str, &str)]| {
            pairs
                .iter()
                .map(|(k, v)| (OsString::from(k), OsString::from(v)))
                .collect::<Vec<_>>()
                .into_iter()
        };
        assert!(!user_tunes_malloc(env(&[("PATH", "/bin")])));
        assert!(!user_tunes_malloc(env(&[(
            "GLIBC_TUNABLES",
            "glibc.rtld.nns=2"
        )])));
        assert!(user_tunes_malloc(env(&[(
            "GLIBC_TUNABLES",
            "glibc.malloc.mmap_threshold=65536"
        )])));
        assert!(user_tunes_malloc(env(&[("MALLOC_ARENA_MAX_", "2")])));
    }
}
