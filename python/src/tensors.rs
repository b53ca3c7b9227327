//! numpy arrays as `&mut [f32]` without copies, through `__array_interface__` (the buffer
//! protocol is not in the stable ABI before Python 3.11, and this module is one abi3 wheel for
//! 3.9 and later).

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

/// One array's memory: a writable, C-contiguous run of `len` float32 values at `addr`.
#[derive(Debug, Clone, Copy)]
struct Raw {
    addr: usize,
    len: usize,
}

/// What `tensors[i]` is, for error messages.
fn describe(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "object".into())
}

/// The memory of `obj`, the `i`-th tensor: a numpy array (or anything exposing
/// `__array_interface__`) of float32, C-contiguous and writable. Anything else is a
/// `TypeError` (not an array, not float32) or `ValueError` (read-only, strided) naming `i`.
fn raw(i: usize, obj: &Bound<'_, PyAny>) -> PyResult<Raw> {
    let Ok(iface) = obj.getattr("__array_interface__") else {
        return Err(PyTypeError::new_err(format!(
            "tensor {i}: a {} is not an array; pass numpy float32 arrays (a CPU torch tensor: \
             tensor.numpy())",
            describe(obj)
        )));
    };
    let iface = iface.cast_into::<PyDict>().map_err(|_| {
        PyTypeError::new_err(format!("tensor {i}: __array_interface__ is not a dict"))
    })?;
    let item = |k: &str| -> PyResult<Bound<'_, PyAny>> {
        iface.get_item(k)?.ok_or_else(|| {
            PyTypeError::new_err(format!("tensor {i}: __array_interface__ has no {k:?}"))
        })
    };
    let typestr: String = item("typestr")?.extract()?;
    if !matches!(typestr.as_str(), "<f4" | "=f4") {
        return Err(PyTypeError::new_err(format!(
            "tensor {i}: dtype {typestr} ({}), need float32 (<f4): convert with .astype(np.float32) \
             and average the converted array",
            describe(obj)
        )));
    }
    let shape: Vec<usize> = item("shape")?.extract()?;
    let len: usize = shape.iter().product();
    let (addr, readonly): (usize, bool) = item("data")?.extract()?;
    if readonly {
        return Err(PyValueError::new_err(format!(
            "tensor {i}: the array is read-only; the average is written into it"
        )));
    }
    if let Some(strides) = iface.get_item("strides")? {
        if !strides.is_none() {
            let strides: Vec<isize> = strides.extract()?;
            let mut want = 4isize;
            let mut contiguous = true;
            for (s, d) in strides.iter().zip(&shape).rev() {
                if *d > 1 && *s != want {
                    contiguous = false;
                }
                want *= *d as isize;
            }
            if !contiguous {
                return Err(PyValueError::new_err(format!(
                    "tensor {i}: the array is not C-contiguous (strides {strides:?}); use \
                     np.ascontiguousarray, and average that array"
                )));
            }
        }
    }
    if len > 0 && (addr == 0 || addr % std::mem::align_of::<f32>() != 0) {
        return Err(PyValueError::new_err(format!(
            "tensor {i}: data pointer {addr:#x} is not a valid float32 address"
        )));
    }
    Ok(Raw { addr, len })
}

/// The arrays of one call, borrowed: a reference to each (so that none is freed while the
/// GIL is released, whatever other threads do to the list that held it) and its checked
/// memory.
pub(crate) struct Borrowed<'py> {
    _items: Vec<Bound<'py, PyAny>>,
    raws: Vec<Raw>,
}

impl Borrowed<'_> {
    /// The arrays' memory as mutable slices, for as long as this borrow lives.
    pub(crate) fn slices(&mut self) -> Vec<&mut [f32]> {
        self.raws
            .iter()
            .map(|r| {
                if r.len == 0 {
                    &mut [][..]
                } else {
                    // SAFETY: `_items` holds a reference to every array, so each stays alive
                    // (numpy refuses to resize an array others reference) while `self` is
                    // borrowed; `borrow` checked alignment, that each is a writable,
                    // C-contiguous run of `len` float32 values, and that no two overlap. Other
                    // threads must not write them meanwhile (the documented contract of every
                    // in-place operation here).
                    unsafe { std::slice::from_raw_parts_mut(r.addr as *mut f32, r.len) }
                }
            })
            .collect()
    }
}

/// Every array in `tensors` (a list or tuple), checked: float32, C-contiguous, writable, and
/// no two sharing memory.
pub(crate) fn borrow<'py>(tensors: &Bound<'py, PyAny>) -> PyResult<Borrowed<'py>> {
    let items: Vec<Bound<'py, PyAny>> = if let Ok(t) = tensors.cast::<PyTuple>() {
        t.iter().collect()
    } else {
        tensors
            .try_iter()
            .map_err(|_| PyTypeError::new_err("tensors: expected a list of numpy float32 arrays"))?
            .collect::<PyResult<_>>()?
    };
    let raws: Vec<Raw> = items
        .iter()
        .enumerate()
        .map(|(i, t)| raw(i, t))
        .collect::<PyResult<_>>()?;
    let mut spans: Vec<(usize, usize, usize)> = raws
        .iter()
        .enumerate()
        .filter(|(_, r)| r.len > 0)
        .map(|(i, r)| (r.addr, r.addr + r.len * 4, i))
        .collect();
    spans.sort_unstable();
    for w in spans.windows(2) {
        if w[1].0 < w[0].1 {
            return Err(PyValueError::new_err(format!(
                "tensors {} and {} share memory; pass each buffer once",
                w[0].2.min(w[1].2),
                w[0].2.max(w[1].2)
            )));
        }
    }
    Ok(Borrowed {
        _items: items,
        raws,
    })
}
