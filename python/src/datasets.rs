//! `starling.datasets`: the data `starling train` ships with, for Python scripts and tests.

use pyo3::prelude::*;
use pyo3::types::PyBytes;

/// The 1797 embedded 8x8 digits, scaled to [0, 1] and split 80/20 with the fixed shuffle
/// `starling train --model mlp` uses: `(train_x, train_y, test_x, test_y)` as little-endian
/// float32 image bytes (64 values each) and label lists (the Python wrapper makes numpy
/// arrays of them).
#[pyfunction]
#[allow(clippy::type_complexity)]
pub(crate) fn digits(
    py: Python<'_>,
) -> (Bound<'_, PyBytes>, Vec<u32>, Bound<'_, PyBytes>, Vec<u32>) {
    let d = starling_run::data::digits();
    let bytes = |pixels: &[u8]| -> Vec<u8> {
        d.values(pixels)
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect()
    };
    let (train_x, test_x) = (bytes(&d.train_x), bytes(&d.test_x));
    (
        PyBytes::new(py, &train_x),
        d.train_y,
        PyBytes::new(py, &test_x),
        d.test_y,
    )
}
