//! Named tensors kept as one flat parameter buffer and one flat gradient buffer.
//!
//! The averager, the optimizers and checkpoints all see a model as two contiguous `Vec<f32>`s of the
//! same length; [`ParamSet`] remembers where each named tensor lives inside them. Registration order
//! fixes the layout, so every peer must register the same tensors in the same order: the
//! [`ParamSet::schema_hash`] of names and shapes tells whether two peers agree.
//!
//! Seeded initialisation ([`Init`]) draws from a caller-supplied RNG (for example
//! `rand::rngs::StdRng::seed_from_u64`), so the same seed gives the same bits on every run. Uniform
//! draws use only IEEE basic operations; normal draws also use `ln`, `sqrt` and `cos` from the
//! platform's math library, so peers on different platforms should take their initial parameters
//! from state sync rather than trust a shared seed.

mod init;

use std::collections::HashMap;
use std::ops::Range;

use rand::Rng;

pub use init::Init;

/// What went wrong while registering, looking up or initialising tensors.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ParamError {
    /// A tensor name was empty.
    #[error("tensor names must not be empty")]
    EmptyName,
    /// The name is registered already; names identify tensors, so they must be unique.
    #[error("tensor {name:?} is already registered; names must be unique")]
    Duplicate {
        /// The repeated name.
        name: String,
    },
    /// The values given do not fill the shape.
    #[error("tensor {name:?}: shape {shape:?} holds {expected} values but {actual} were given")]
    ValueCount {
        /// Tensor name.
        name: String,
        /// Declared shape.
        shape: Vec<usize>,
        /// Product of the shape.
        expected: usize,
        /// Values given.
        actual: usize,
    },
    /// The element count of the shape does not fit in `usize`.
    #[error("tensor {name:?}: shape {shape:?} has more elements than memory can hold")]
    ShapeOverflow {
        /// Tensor name.
        name: String,
        /// Declared shape.
        shape: Vec<usize>,
    },
    /// An initialiser cannot be used on this tensor.
    #[error("tensor {name:?} with shape {shape:?}: {reason}")]
    InvalidInit {
        /// Tensor name.
        name: String,
        /// Tensor shape.
        shape: Vec<usize>,
        /// Why, and what to use instead.
        reason: String,
    },
}

/// Index of a tensor inside the [`ParamSet`] that registered it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TensorId(usize);

impl TensorId {
    /// Registration position (0 for the first tensor).
    ///
    /// ```
    /// let mut set = starling_training::ParamSet::new();
    /// let id = set.add_zeros("w", &[2, 3])?;
    /// assert_eq!(id.index(), 0);
    /// # Ok::<(), starling_training::ParamError>(())
    /// ```
    pub fn index(self) -> usize {
        self.0
    }
}

/// Name, shape and place in the flat buffers of one registered tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    name: String,
    shape: Vec<usize>,
    range: Range<usize>,
}

impl TensorInfo {
    /// The tensor's name.
    ///
    /// ```
    /// let mut set = starling_training::ParamSet::new();
    /// set.add_zeros("layer.0.weight", &[4, 2])?;
    /// assert_eq!(set.iter().next().map(|(_, t)| t.name()), Some("layer.0.weight"));
    /// # Ok::<(), starling_training::ParamError>(())
    /// ```
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The tensor's shape (row-major).
    ///
    /// ```
    /// let mut set = starling_training::ParamSet::new();
    /// let id = set.add_zeros("w", &[4, 2])?;
    /// assert_eq!(set.info(id).map(|t| t.shape()), Some(&[4, 2][..]));
    /// # Ok::<(), starling_training::ParamError>(())
    /// ```
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Where the tensor's values lie in [`ParamSet::params`] and [`ParamSet::grads`].
    ///
    /// ```
    /// let mut set = starling_training::ParamSet::new();
    /// set.add_zeros("a", &[3])?;
    /// let b = set.add_zeros("b", &[2, 2])?;
    /// assert_eq!(set.info(b).map(|t| t.range()), Some(3..7));
    /// # Ok::<(), starling_training::ParamError>(())
    /// ```
    pub fn range(&self) -> Range<usize> {
        self.range.clone()
    }

    /// Number of elements.
    ///
    /// ```
    /// let mut set = starling_training::ParamSet::new();
    /// let id = set.add_zeros("w", &[4, 2])?;
    /// assert_eq!(set.info(id).map(|t| t.len()), Some(8));
    /// # Ok::<(), starling_training::ParamError>(())
    /// ```
    pub fn len(&self) -> usize {
        self.range.len()
    }

    /// Whether the tensor has no elements (a shape with a zero dimension).
    ///
    /// ```
    /// let mut set = starling_training::ParamSet::new();
    /// let id = set.add_zeros("empty", &[0, 5])?;
    /// assert_eq!(set.info(id).map(|t| t.is_empty()), Some(true));
    /// # Ok::<(), starling_training::ParamError>(())
    /// ```
    pub fn is_empty(&self) -> bool {
        self.range.is_empty()
    }
}

/// Named tensors stored as one contiguous parameter buffer and one gradient buffer.
///
/// ```
/// use rand::{rngs::StdRng, SeedableRng};
/// use starling_training::{Init, ParamSet};
///
/// let mut set = ParamSet::new();
/// let mut rng = StdRng::seed_from_u64(7);
/// set.add_init("fc.weight", &[16, 8], Init::KaimingUniform, &mut rng)?;
/// set.add("fc.bias", &[16], &[0.0; 16])?;
/// assert_eq!(set.len(), 16 * 8 + 16);
/// set.grads_mut().fill(1.0);
/// set.zero_grads();
/// assert!(set.grads().iter().all(|&g| g == 0.0));
/// assert_eq!(set.tensor("fc.bias"), Some(&[0.0f32; 16][..]));
/// # Ok::<(), starling_training::ParamError>(())
/// ```
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ParamSet {
    tensors: Vec<TensorInfo>,
    by_name: HashMap<String, usize>,
    params: Vec<f32>,
    grads: Vec<f32>,
}

impl ParamSet {
    /// An empty set.
    ///
    /// ```
    /// assert!(starling_training::ParamSet::new().is_empty());
    /// ```
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers a tensor with the given values (row-major); its gradient starts at zero.
    ///
    /// ```
    /// let mut set = starling_training::ParamSet::new();
    /// set.add("w", &[2, 2], &[1.0, 2.0, 3.0, 4.0])?;
    /// assert!(set.add("w", &[1], &[0.0]).is_err()); // names are unique
    /// assert!(set.add("v", &[3], &[0.0]).is_err()); // values must fill the shape
    /// # Ok::<(), starling_training::ParamError>(())
    /// ```
    pub fn add(
        &mut self,
        name: impl Into<String>,
        shape: &[usize],
        values: &[f32],
    ) -> Result<TensorId, ParamError> {
        let name = name.into();
        let expected = self.check_new(&name, shape)?;
        if values.len() != expected {
            return Err(ParamError::ValueCount {
                name,
                shape: shape.to_vec(),
                expected,
                actual: values.len(),
            });
        }
        Ok(self.push(name, shape, values.iter().copied()))
    }

    /// Registers a tensor filled with zeros.
    ///
    /// ```
    /// let mut set = starling_training::ParamSet::new();
    /// set.add_zeros("b", &[4])?;
    /// assert_eq!(set.tensor("b"), Some(&[0.0f32; 4][..]));
    /// # Ok::<(), starling_training::ParamError>(())
    /// ```
    pub fn add_zeros(
        &mut self,
        name: impl Into<String>,
        shape: &[usize],
    ) -> Result<TensorId, ParamError> {
        let name = name.into();
        let count = self.check_new(&name, shape)?;
        Ok(self.push(name, shape, std::iter::repeat_n(0.0, count)))
    }

    /// Registers a tensor whose values are drawn by `init` from `rng`.
    ///
    /// ```
    /// use rand::{rngs::StdRng, SeedableRng};
    /// use starling_training::{Init, ParamSet};
    /// let mut a = ParamSet::new();
    /// let mut b = ParamSet::new();
    /// a.add_init("w", &[8, 4], Init::Normal { mean: 0.0, std: 0.02 }, &mut StdRng::seed_from_u64(1))?;
    /// b.add_init("w", &[8, 4], Init::Normal { mean: 0.0, std: 0.02 }, &mut StdRng::seed_from_u64(1))?;
    /// assert_eq!(a.params(), b.params()); // same seed, same bits
    /// # Ok::<(), starling_training::ParamError>(())
    /// ```
    pub fn add_init<R: Rng + ?Sized>(
        &mut self,
        name: impl Into<String>,
        shape: &[usize],
        init: Init,
        rng: &mut R,
    ) -> Result<TensorId, ParamError> {
        let name = name.into();
        let count = self.check_new(&name, shape)?;
        let mut values = vec![0.0; count];
        init.fill(&name, shape, &mut values, rng)?;
        Ok(self.push(name, shape, values))
    }

    /// Re-initialises every tensor, in registration order, with the [`Init`] that `rule` picks for it.
    ///
    /// ```
    /// use rand::{rngs::StdRng, SeedableRng};
    /// use starling_training::{Init, ParamSet};
    /// let mut set = ParamSet::new();
    /// set.add_zeros("fc.weight", &[3, 5])?;
    /// set.add_zeros("fc.bias", &[3])?;
    /// set.initialize(&mut StdRng::seed_from_u64(3), |t| {
    ///     if t.name().ends_with("bias") { Init::torch_bias(5) } else { Init::TorchLinear }
    /// })?;
    /// assert!(set.params().iter().all(|&v| v.abs() <= 1.0 / 5f32.sqrt()));
    /// # Ok::<(), starling_training::ParamError>(())
    /// ```
    pub fn initialize<R: Rng + ?Sized>(
        &mut self,
        rng: &mut R,
        mut rule: impl FnMut(&TensorInfo) -> Init,
    ) -> Result<(), ParamError> {
        for info in &self.tensors {
            let init = rule(info);
            init.fill(
                &info.name,
                &info.shape,
                &mut self.params[info.range.clone()],
                rng,
            )?;
        }
        Ok(())
    }

    /// Total number of elements over all tensors (the length of both flat buffers).
    ///
    /// ```
    /// let mut set = starling_training::ParamSet::new();
    /// set.add_zeros("a", &[2, 3])?;
    /// set.add_zeros("b", &[4])?;
    /// assert_eq!(set.len(), 10);
    /// # Ok::<(), starling_training::ParamError>(())
    /// ```
    pub fn len(&self) -> usize {
        self.params.len()
    }

    /// Whether the set holds no elements.
    ///
    /// ```
    /// assert!(starling_training::ParamSet::new().is_empty());
    /// ```
    pub fn is_empty(&self) -> bool {
        self.params.is_empty()
    }

    /// Number of registered tensors.
    ///
    /// ```
    /// let mut set = starling_training::ParamSet::new();
    /// set.add_zeros("a", &[2])?;
    /// assert_eq!(set.num_tensors(), 1);
    /// # Ok::<(), starling_training::ParamError>(())
    /// ```
    pub fn num_tensors(&self) -> usize {
        self.tensors.len()
    }

    /// All parameters, tensor after tensor in registration order.
    ///
    /// ```
    /// let mut set = starling_training::ParamSet::new();
    /// set.add("a", &[2], &[1.0, 2.0])?;
    /// set.add("b", &[1], &[3.0])?;
    /// assert_eq!(set.params(), &[1.0, 2.0, 3.0]);
    /// # Ok::<(), starling_training::ParamError>(())
    /// ```
    pub fn params(&self) -> &[f32] {
        &self.params
    }

    /// All parameters, writable (for example to apply an averaged result).
    ///
    /// ```
    /// let mut set = starling_training::ParamSet::new();
    /// set.add_zeros("a", &[2])?;
    /// set.params_mut().copy_from_slice(&[5.0, 6.0]);
    /// assert_eq!(set.tensor("a"), Some(&[5.0, 6.0][..]));
    /// # Ok::<(), starling_training::ParamError>(())
    /// ```
    pub fn params_mut(&mut self) -> &mut [f32] {
        &mut self.params
    }

    /// All gradients, laid out like [`ParamSet::params`].
    ///
    /// ```
    /// let mut set = starling_training::ParamSet::new();
    /// set.add_zeros("a", &[2])?;
    /// assert_eq!(set.grads(), &[0.0, 0.0]);
    /// # Ok::<(), starling_training::ParamError>(())
    /// ```
    pub fn grads(&self) -> &[f32] {
        &self.grads
    }

    /// All gradients, writable (to accumulate micro-batches or apply an averaged gradient).
    ///
    /// ```
    /// let mut set = starling_training::ParamSet::new();
    /// set.add_zeros("a", &[2])?;
    /// set.grads_mut()[1] += 0.5;
    /// assert_eq!(set.grad("a"), Some(&[0.0, 0.5][..]));
    /// # Ok::<(), starling_training::ParamError>(())
    /// ```
    pub fn grads_mut(&mut self) -> &mut [f32] {
        &mut self.grads
    }

    /// Parameters (writable) and gradients together, the two arguments of [`crate::Optimizer::step`].
    ///
    /// ```
    /// use starling_training::{Optimizer, ParamSet, Sgd, SgdConfig};
    /// let mut set = ParamSet::new();
    /// set.add("w", &[2], &[1.0, 1.0])?;
    /// set.grads_mut().copy_from_slice(&[1.0, -1.0]);
    /// let mut sgd = Sgd::new(SgdConfig::new(0.5), set.len())?;
    /// let (params, grads) = set.params_and_grads_mut();
    /// sgd.step(params, grads)?;
    /// assert_eq!(set.params(), &[0.5, 1.5]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn params_and_grads_mut(&mut self) -> (&mut [f32], &[f32]) {
        (&mut self.params, &self.grads)
    }

    /// The parameters and the gradients, both writable (e.g. to average both in one round).
    ///
    /// ```
    /// let mut set = starling_training::ParamSet::new();
    /// set.add("w", &[2], &[1.0, 2.0])?;
    /// let (params, grads) = set.buffers_mut();
    /// grads.copy_from_slice(params);
    /// assert_eq!(set.grads(), &[1.0, 2.0]);
    /// # Ok::<(), starling_training::ParamError>(())
    /// ```
    pub fn buffers_mut(&mut self) -> (&mut [f32], &mut [f32]) {
        (&mut self.params, &mut self.grads)
    }

    /// Sets every gradient to zero.
    ///
    /// ```
    /// let mut set = starling_training::ParamSet::new();
    /// set.add_zeros("a", &[2])?;
    /// set.grads_mut().fill(3.0);
    /// set.zero_grads();
    /// assert_eq!(set.grads(), &[0.0, 0.0]);
    /// # Ok::<(), starling_training::ParamError>(())
    /// ```
    pub fn zero_grads(&mut self) {
        self.grads.fill(0.0);
    }

    /// The id of the tensor called `name`.
    ///
    /// ```
    /// let mut set = starling_training::ParamSet::new();
    /// let id = set.add_zeros("a", &[2])?;
    /// assert_eq!(set.id("a"), Some(id));
    /// assert_eq!(set.id("b"), None);
    /// # Ok::<(), starling_training::ParamError>(())
    /// ```
    pub fn id(&self, name: &str) -> Option<TensorId> {
        self.by_name.get(name).map(|&i| TensorId(i))
    }

    /// Name, shape and range of a tensor; `None` for an id this set did not hand out.
    ///
    /// ```
    /// let mut set = starling_training::ParamSet::new();
    /// let id = set.add_zeros("a", &[2, 2])?;
    /// assert_eq!(set.info(id).map(|t| t.name()), Some("a"));
    /// # Ok::<(), starling_training::ParamError>(())
    /// ```
    pub fn info(&self, id: TensorId) -> Option<&TensorInfo> {
        self.tensors.get(id.0)
    }

    /// The tensors in registration order (the layout of the flat buffers).
    ///
    /// ```
    /// let mut set = starling_training::ParamSet::new();
    /// set.add_zeros("a", &[2])?;
    /// set.add_zeros("b", &[3, 1])?;
    /// let names: Vec<&str> = set.iter().map(|(_, t)| t.name()).collect();
    /// assert_eq!(names, ["a", "b"]);
    /// # Ok::<(), starling_training::ParamError>(())
    /// ```
    pub fn iter(&self) -> impl ExactSizeIterator<Item = (TensorId, &TensorInfo)> + '_ {
        self.tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (TensorId(i), t))
    }

    /// The parameters of the tensor called `name`.
    ///
    /// ```
    /// let mut set = starling_training::ParamSet::new();
    /// set.add("a", &[2], &[1.0, 2.0])?;
    /// assert_eq!(set.tensor("a"), Some(&[1.0, 2.0][..]));
    /// # Ok::<(), starling_training::ParamError>(())
    /// ```
    pub fn tensor(&self, name: &str) -> Option<&[f32]> {
        let range = self.range_of(name)?;
        Some(&self.params[range])
    }

    /// The parameters of the tensor called `name`, writable.
    ///
    /// ```
    /// let mut set = starling_training::ParamSet::new();
    /// set.add_zeros("a", &[2])?;
    /// if let Some(a) = set.tensor_mut("a") { a[0] = 4.0; }
    /// assert_eq!(set.params(), &[4.0, 0.0]);
    /// # Ok::<(), starling_training::ParamError>(())
    /// ```
    pub fn tensor_mut(&mut self, name: &str) -> Option<&mut [f32]> {
        let range = self.range_of(name)?;
        Some(&mut self.params[range])
    }

    /// The gradient of the tensor called `name`.
    ///
    /// ```
    /// let mut set = starling_training::ParamSet::new();
    /// set.add_zeros("a", &[2])?;
    /// assert_eq!(set.grad("a"), Some(&[0.0, 0.0][..]));
    /// # Ok::<(), starling_training::ParamError>(())
    /// ```
    pub fn grad(&self, name: &str) -> Option<&[f32]> {
        let range = self.range_of(name)?;
        Some(&self.grads[range])
    }

    /// The gradient of the tensor called `name`, writable.
    ///
    /// ```
    /// let mut set = starling_training::ParamSet::new();
    /// set.add_zeros("a", &[2])?;
    /// if let Some(g) = set.grad_mut("a") { g.copy_from_slice(&[0.1, 0.2]); }
    /// assert_eq!(set.grads(), &[0.1, 0.2]);
    /// # Ok::<(), starling_training::ParamError>(())
    /// ```
    pub fn grad_mut(&mut self, name: &str) -> Option<&mut [f32]> {
        let range = self.range_of(name)?;
        Some(&mut self.grads[range])
    }

    /// A stable 64-bit hash of the layout: every tensor's name and shape, in order.
    ///
    /// Two sets with the same hash lay their flat buffers out the same way, so they can be averaged
    /// element by element. The hash is FNV-1a over the name lengths, names, ranks and dimensions
    /// (all integers as little-endian `u64`), the same on every platform and release.
    ///
    /// ```
    /// let mut a = starling_training::ParamSet::new();
    /// a.add_zeros("w", &[2, 3])?;
    /// let mut b = starling_training::ParamSet::new();
    /// b.add("w", &[2, 3], &[1.0; 6])?; // values do not matter
    /// assert_eq!(a.schema_hash(), b.schema_hash());
    /// let mut c = starling_training::ParamSet::new();
    /// c.add_zeros("w", &[3, 2])?;
    /// assert_ne!(a.schema_hash(), c.schema_hash());
    /// # Ok::<(), starling_training::ParamError>(())
    /// ```
    pub fn schema_hash(&self) -> u64 {
        schema_hash(self.tensors.iter().map(|t| (t.name.as_str(), &t.shape[..])))
    }

    fn range_of(&self, name: &str) -> Option<Range<usize>> {
        let &i = self.by_name.get(name)?;
        Some(self.tensors[i].range.clone())
    }

    /// Checks a new tensor's name and shape; returns its element count.
    fn check_new(&self, name: &str, shape: &[usize]) -> Result<usize, ParamError> {
        if name.is_empty() {
            return Err(ParamError::EmptyName);
        }
        if self.by_name.contains_key(name) {
            return Err(ParamError::Duplicate {
                name: name.to_string(),
            });
        }
        let overflow = || ParamError::ShapeOverflow {
            name: name.to_string(),
            shape: shape.to_vec(),
        };
        let count = shape
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))
            .ok_or_else(overflow)?;
        self.params.len().checked_add(count).ok_or_else(overflow)?;
        Ok(count)
    }

    fn push(
        &mut self,
        name: String,
        shape: &[usize],
        values: impl IntoIterator<Item = f32>,
    ) -> TensorId {
        let start = self.params.len();
        self.params.extend(values);
        let end = self.params.len();
        self.grads.resize(end, 0.0);
        let id = TensorId(self.tensors.len());
        self.by_name.insert(name.clone(), id.0);
        self.tensors.push(TensorInfo {
            name,
            shape: shape.to_vec(),
            range: start..end,
        });
        id
    }
}

/// The [`ParamSet::schema_hash`] of a list of (name, shape), for layouts described elsewhere
/// (a checkpoint, a peer's announcement).
///
/// ```
/// let mut set = starling_training::ParamSet::new();
/// set.add_zeros("w", &[2, 3])?;
/// assert_eq!(starling_training::schema_hash([("w", &[2usize, 3][..])]), set.schema_hash());
/// # Ok::<(), starling_training::ParamError>(())
/// ```
pub fn schema_hash<'a>(tensors: impl IntoIterator<Item = (&'a str, &'a [usize])>) -> u64 {
    let mut h = Fnv1a::new();
    for (name, shape) in tensors {
        h.write_u64(name.len() as u64);
        h.write(name.as_bytes());
        h.write_u64(shape.len() as u64);
        for &d in shape {
            h.write_u64(d as u64);
        }
    }
    h.finish()
}

/// FNV-1a, 64-bit: small, stable across platforms and releases (unlike `std`'s `DefaultHasher`).
#[derive(Debug, Clone)]
pub(crate) struct Fnv1a(u64);

impl Fnv1a {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;

    pub(crate) fn new() -> Self {
        Self(Self::OFFSET)
    }

    pub(crate) fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(Self::PRIME);
        }
    }

    pub(crate) fn write_u64(&mut self, v: u64) {
        self.write(&v.to_le_bytes());
    }

    pub(crate) fn finish(&self) -> u64 {
        self.0
    }
}
