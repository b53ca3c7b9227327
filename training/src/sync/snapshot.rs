//! What state sync moves, on each side: a donor's [`StateView`] (borrowed, captured into an owned
//! [`StateSnapshot`] at a step boundary), a joiner's [`StateTarget`] (where a verified
//! [`SyncedState`] is written), and the [`StateLayout`] both must agree on. The two builders are
//! [`crate::state`]'s, the same ones a checkpoint saves and loads.
//!
//! State is a list of named flat `f32` buffers of one value per parameter, in a fixed order:
//! `param`, then `optim/<optimizer>/<state>` for each optimizer's state buffers, then
//! `buffer/<name>` for extra buffers; plus named `u64` counters (`optim/<optimizer>/steps` for
//! each optimizer, and any the caller adds). The layout is those names and lengths and the
//! [`ParamSet::schema_hash`]; a joiner refuses a manifest whose layout differs from its own
//! before downloading anything.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::ops::Range;

use crate::optim::Optimizer;
use crate::params::ParamSet;
pub use crate::state::{StateTarget, StateView};

use super::SyncError;

/// Name of the parameter buffer.
pub const PARAM_BUFFER: &str = "param";

fn optim_buffer(optimizer: &str, state: &str) -> String {
    format!("optim/{optimizer}/{state}")
}

fn steps_counter(optimizer: &str) -> String {
    format!("optim/{optimizer}/steps")
}

fn extra_buffer(name: &str) -> String {
    format!("buffer/{name}")
}

/// The shape of a training state: the model's schema hash, the buffers (name, length) in order,
/// and the counters a joiner needs.
///
/// ```
/// use starling_training::{sync::StateView, ParamSet, Sgd, SgdConfig};
/// let mut params = ParamSet::new();
/// params.add_zeros("w", &[3])?;
/// let sgd = Sgd::new(SgdConfig::new(0.1).momentum(0.9), params.len())?;
/// let layout = StateView::new(0, &params).optimizer("opt", &sgd).layout();
/// let names: Vec<&str> = layout.buffers().iter().map(|(n, _)| n.as_str()).collect();
/// assert_eq!(names, ["param", "optim/opt/momentum_buffer"]);
/// assert_eq!(layout.counters(), ["optim/opt/steps"]);
/// assert_eq!(layout.total_values(), 6);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateLayout {
    schema_hash: u64,
    buffers: Vec<(String, usize)>,
    counters: Vec<String>,
}

impl StateLayout {
    /// [`ParamSet::schema_hash`] of the model.
    ///
    /// ```
    /// let params = starling_training::ParamSet::new();
    /// let layout = starling_training::sync::StateView::new(0, &params).layout();
    /// assert_eq!(layout.schema_hash(), params.schema_hash());
    /// ```
    pub fn schema_hash(&self) -> u64 {
        self.schema_hash
    }

    /// The buffers, (name, values), in transfer order.
    ///
    /// ```
    /// let params = starling_training::ParamSet::new();
    /// let layout = starling_training::sync::StateView::new(0, &params).layout();
    /// assert_eq!(layout.buffers(), [("param".to_string(), 0)]);
    /// ```
    pub fn buffers(&self) -> &[(String, usize)] {
        &self.buffers
    }

    /// The counters a joiner needs (the donor may send more).
    ///
    /// ```
    /// let params = starling_training::ParamSet::new();
    /// assert!(starling_training::sync::StateView::new(0, &params).layout().counters().is_empty());
    /// ```
    pub fn counters(&self) -> &[String] {
        &self.counters
    }

    /// Values over all buffers.
    ///
    /// ```
    /// let mut params = starling_training::ParamSet::new();
    /// params.add_zeros("w", &[4])?;
    /// assert_eq!(starling_training::sync::StateView::new(0, &params).layout().total_values(), 4);
    /// # Ok::<(), starling_training::ParamError>(())
    /// ```
    pub fn total_values(&self) -> usize {
        self.buffers.iter().map(|(_, n)| n).sum()
    }

    /// The first difference between this layout (the joiner's) and a donor's, if any.
    pub(crate) fn mismatch(
        &self,
        schema_hash: u64,
        buffers: &[(String, u64)],
        counters: &[(String, u64)],
    ) -> Option<String> {
        if schema_hash != self.schema_hash {
            return Some(format!(
                "model schema hash {schema_hash:016x}, ours is {:016x}",
                self.schema_hash
            ));
        }
        let theirs: Vec<(&str, u64)> = buffers.iter().map(|(n, l)| (n.as_str(), *l)).collect();
        let ours: Vec<(&str, u64)> = self
            .buffers
            .iter()
            .map(|(n, l)| (n.as_str(), *l as u64))
            .collect();
        if theirs != ours {
            return Some(format!(
                "buffers (name, values) {theirs:?}, ours are {ours:?} (another optimizer kind or configuration?)"
            ));
        }
        let missing: Vec<&String> = self
            .counters
            .iter()
            .filter(|c| !counters.iter().any(|(n, _)| n == *c))
            .collect();
        if !missing.is_empty() {
            return Some(format!("counters {missing:?} are missing"));
        }
        None
    }
}

impl StateView<'_> {
    /// The layout of this state (what a joiner passes to [`sync_state`](super::sync_state)).
    ///
    /// ```
    /// let mut params = starling_training::ParamSet::new();
    /// params.add_zeros("w", &[2])?;
    /// let layout = starling_training::sync::StateView::new(0, &params).layout();
    /// assert_eq!(layout.total_values(), 2);
    /// # Ok::<(), starling_training::ParamError>(())
    /// ```
    pub fn layout(&self) -> StateLayout {
        let len = self.params.len();
        layout_of(
            self.params,
            self.optimizers.iter().map(|(n, o)| (n.as_str(), *o)),
            self.buffers.iter().map(|(n, _)| (n.as_str(), len)),
        )
    }

    /// Copies the state (one copy of every buffer), checking every length and that names are
    /// unique.
    ///
    /// ```
    /// use starling_training::{sync::StateView, ParamSet};
    /// let mut params = ParamSet::new();
    /// params.add_zeros("w", &[2])?;
    /// assert!(StateView::new(0, &params).buffer("anchor", &[1.0]).capture().is_err()); // wrong length
    /// # Ok::<(), starling_training::ParamError>(())
    /// ```
    pub fn capture(&self) -> Result<StateSnapshot, SyncError> {
        let len = self.params.len();
        let mut buffers = vec![(PARAM_BUFFER.to_string(), self.params.params().to_vec())];
        let mut counters = self.counters.clone();
        for (name, opt) in &self.optimizers {
            for (state, values) in opt.state() {
                buffers.push((optim_buffer(name, state), values.to_vec()));
            }
            counters.insert(steps_counter(name), opt.steps());
        }
        for (name, values) in &self.buffers {
            buffers.push((extra_buffer(name), values.to_vec()));
        }
        check_buffers(
            &buffers
                .iter()
                .map(|(n, v)| (n, v.len()))
                .collect::<Vec<_>>(),
            len,
        )?;
        Ok(StateSnapshot {
            epoch: self.epoch,
            schema_hash: self.params.schema_hash(),
            buffers,
            counters,
        })
    }
}

/// The layout of `params`, each optimizer's state buffers and step counter, and the extra
/// buffers `(name, values)`: one computation for a donor's view and a joiner's target, so the
/// two always describe state the same way.
fn layout_of<'o>(
    params: &ParamSet,
    optimizers: impl Iterator<Item = (&'o str, &'o dyn Optimizer)>,
    extra: impl Iterator<Item = (&'o str, usize)>,
) -> StateLayout {
    let len = params.len();
    let mut buffers = vec![(PARAM_BUFFER.to_string(), len)];
    let mut counters = Vec::new();
    for (name, opt) in optimizers {
        for (state, _) in opt.state() {
            buffers.push((optim_buffer(name, state), len));
        }
        counters.push(steps_counter(name));
    }
    buffers.extend(extra.map(|(name, n)| (extra_buffer(name), n)));
    StateLayout {
        schema_hash: params.schema_hash(),
        buffers,
        counters,
    }
}

/// Every buffer has `len` values and every name is unique.
fn check_buffers(buffers: &[(&String, usize)], len: usize) -> Result<(), SyncError> {
    for (i, (name, n)) in buffers.iter().enumerate() {
        if *n != len {
            return Err(SyncError::Invalid(format!(
                "buffer {name:?} has {n} values, the parameters {len}"
            )));
        }
        if buffers[..i].iter().any(|(other, _)| other == name) {
            return Err(SyncError::Invalid(format!(
                "buffer {name:?} is named twice"
            )));
        }
    }
    Ok(())
}

/// A donor's captured state: an owned copy, consistent because it was taken at one step
/// boundary (see [`StateView::capture`]).
#[derive(Debug, Clone, PartialEq)]
pub struct StateSnapshot {
    pub(crate) epoch: u64,
    pub(crate) schema_hash: u64,
    pub(crate) buffers: Vec<(String, Vec<f32>)>,
    pub(crate) counters: BTreeMap<String, u64>,
}

impl StateSnapshot {
    /// The epoch it was captured at.
    ///
    /// ```
    /// let params = starling_training::ParamSet::new();
    /// let s = starling_training::sync::StateView::new(4, &params).capture()?;
    /// assert_eq!(s.epoch(), 4);
    /// # Ok::<(), starling_training::sync::SyncError>(())
    /// ```
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// A buffer by its full name (`param`, `optim/<optimizer>/<state>`, `buffer/<name>`).
    ///
    /// ```
    /// let mut params = starling_training::ParamSet::new();
    /// params.add("w", &[1], &[2.0])?;
    /// let s = starling_training::sync::StateView::new(0, &params).capture()?;
    /// assert_eq!(s.buffer("param"), Some(&[2.0][..]));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn buffer(&self, name: &str) -> Option<&[f32]> {
        self.buffers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| &v[..])
    }

    /// Every counter.
    ///
    /// ```
    /// let params = starling_training::ParamSet::new();
    /// let s = starling_training::sync::StateView::new(0, &params).counter("k", 1).capture()?;
    /// assert_eq!(s.counters().len(), 1);
    /// # Ok::<(), starling_training::sync::SyncError>(())
    /// ```
    pub fn counters(&self) -> &BTreeMap<String, u64> {
        &self.counters
    }
}

impl StateTarget<'_> {
    /// The layout this target expects (pass it to [`sync_state`](super::sync_state)).
    ///
    /// ```
    /// let mut params = starling_training::ParamSet::new();
    /// params.add_zeros("w", &[3])?;
    /// assert_eq!(starling_training::sync::StateTarget::new(&mut params).layout().total_values(), 3);
    /// # Ok::<(), starling_training::ParamError>(())
    /// ```
    pub fn layout(&self) -> StateLayout {
        layout_of(
            self.params,
            self.optimizers
                .iter()
                .map(|(n, o)| (n.as_str(), &**o as &dyn Optimizer)),
            self.buffers.iter().map(|(n, v)| (n.as_str(), v.len())),
        )
    }

    /// Writes `synced` into the target, after checking that its layout is this target's (on a
    /// mismatch nothing is written). Zeroes the gradients; returns the synced epoch.
    ///
    /// ```no_run
    /// # async fn demo(node: starling_node::Node, mut params: starling_training::ParamSet, mut opt: starling_training::Sgd) -> Result<(), Box<dyn std::error::Error>> {
    /// use starling_training::sync::{sync_state, StateTarget, SyncConfig};
    /// let layout = StateTarget::new(&mut params).optimizer("opt", &mut opt).layout();
    /// let (synced, report) = sync_state(&node, &SyncConfig::new("my-run"), &layout).await?;
    /// let epoch = StateTarget::new(&mut params).optimizer("opt", &mut opt).apply(&synced)?;
    /// println!("at epoch {epoch}: {} bytes from {} donors", report.bytes, report.donors.len());
    /// # Ok(()) }
    /// ```
    pub fn apply(self, synced: &SyncedState) -> Result<u64, SyncError> {
        let layout = self.layout();
        if let Some(why) =
            layout.mismatch(synced.schema_hash, &synced.buffers, &synced.counters_vec())
        {
            return Err(SyncError::Layout(why));
        }
        let mut index = 0;
        synced.copy_buffer(index, self.params.params_mut());
        self.params.zero_grads();
        for (name, opt) in self.optimizers {
            opt.set_steps(
                synced
                    .counters
                    .get(&steps_counter(&name))
                    .copied()
                    .unwrap_or(0),
            );
            for (_, values) in opt.state_mut() {
                index += 1;
                synced.copy_buffer(index, values);
            }
        }
        for (_, values) in self.buffers {
            index += 1;
            synced.copy_buffer(index, values);
        }
        Ok(synced.epoch)
    }
}

/// A state downloaded from donors with every chunk's hash verified against the manifest they
/// agreed on; nothing has been written anywhere yet. Write it with [`StateTarget::apply`] or
/// [`CollaborativeOptimizer::restore_from`](crate::CollaborativeOptimizer::restore_from).
#[derive(Debug, Clone, PartialEq)]
pub struct SyncedState {
    pub(crate) epoch: u64,
    pub(crate) schema_hash: u64,
    pub(crate) manifest_hash: [u8; 32],
    pub(crate) buffers: Vec<(String, u64)>,
    pub(crate) counters: BTreeMap<String, u64>,
    /// (buffer index, range in it, values) for every chunk, in manifest order.
    pub(crate) chunks: Vec<(usize, Range<usize>, Vec<f32>)>,
}

impl SyncedState {
    /// The epoch of the donors' snapshot.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// SHA-256 of the manifest the donors agreed on.
    pub fn manifest_hash(&self) -> [u8; 32] {
        self.manifest_hash
    }

    /// Every counter the donors sent.
    pub fn counters(&self) -> &BTreeMap<String, u64> {
        &self.counters
    }

    /// A buffer by its full name, as one vector (a copy; for inspection and tests).
    pub fn buffer(&self, name: &str) -> Option<Vec<f32>> {
        let index = self.buffers.iter().position(|(n, _)| n == name)?;
        let mut out = vec![0.0; self.buffers[index].1 as usize];
        self.copy_buffer(index, &mut out);
        Some(out)
    }

    fn counters_vec(&self) -> Vec<(String, u64)> {
        self.counters.iter().map(|(k, v)| (k.clone(), *v)).collect()
    }

    /// Writes buffer `index` into `out` (whose length the layout check has matched).
    fn copy_buffer(&self, index: usize, out: &mut [f32]) {
        for (_, range, values) in self.chunks.iter().filter(|(b, _, _)| *b == index) {
            out[range.clone()].copy_from_slice(values);
        }
    }
}

/// `values` as little-endian bytes (borrowed on little-endian machines).
pub(crate) fn le_bytes(values: &[f32]) -> Cow<'_, [u8]> {
    if cfg!(target_endian = "little") {
        Cow::Borrowed(bytemuck::cast_slice(values))
    } else {
        Cow::Owned(values.iter().flat_map(|v| v.to_le_bytes()).collect())
    }
}

/// Little-endian bytes (a multiple of 4) as values.
pub(crate) fn from_le_bytes(bytes: &[u8]) -> Vec<f32> {
    let n = bytes.len() / 4;
    let mut out = vec![0f32; n];
    bytemuck::cast_slice_mut::<f32, u8>(&mut out).copy_from_slice(&bytes[..n * 4]);
    if cfg!(target_endian = "big") {
        out.iter_mut()
            .for_each(|v| *v = f32::from_bits(u32::from_le(v.to_bits())));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sync::manifest::{sha256, Manifest};
    use crate::{AdamW, AdamWConfig, Sgd, SgdConfig};

    /// What a joiner would hold after fetching every chunk of `s`'s manifest.
    fn synced_from(s: &StateSnapshot, chunk_elems: usize) -> SyncedState {
        let m = Manifest::of(s, chunk_elems);
        let chunks = m
            .spans()
            .unwrap()
            .into_iter()
            .map(|sp| {
                let values = s.buffers[sp.buffer].1[sp.range.clone()].to_vec();
                (sp.buffer, sp.range, values)
            })
            .collect();
        SyncedState {
            epoch: s.epoch,
            schema_hash: s.schema_hash,
            manifest_hash: sha256(&m.encode()),
            buffers: m.buffers.clone(),
            counters: m.counters.iter().cloned().collect(),
            chunks,
        }
    }

    fn model(values: &[f32]) -> ParamSet {
        let mut p = ParamSet::new();
        p.add("a", &[2], &values[..2]).unwrap();
        p.add("b", &[values.len() - 2], &values[2..]).unwrap();
        p
    }

    #[test]
    fn a_synced_state_lands_where_the_donor_had_it() {
        let values: Vec<f32> = (0..11).map(|i| i as f32 - 5.0).collect();
        let mut donor = model(&values);
        let mut opt = AdamW::new(AdamWConfig::new(1e-2), donor.len()).unwrap();
        donor.grads_mut().fill(0.5);
        opt.step_set(&mut donor).unwrap();
        let anchor: Vec<f32> = values.iter().map(|v| v * 2.0).collect();
        let view = StateView::new(6, &donor)
            .optimizer("opt", &opt)
            .buffer("anchor", &anchor);
        let synced = synced_from(&view.capture().unwrap(), 3);

        let mut params = model(&[0.0; 11]);
        params.grads_mut().fill(1.0);
        let mut mine = AdamW::new(AdamWConfig::new(1e-2), params.len()).unwrap();
        let mut my_anchor = vec![0.0; 11];
        let target = StateTarget::new(&mut params)
            .optimizer("opt", &mut mine)
            .buffer("anchor", &mut my_anchor);
        assert_eq!(target.layout(), view.layout());
        assert_eq!(target.apply(&synced).unwrap(), 6);
        assert_eq!(params.params(), donor.params());
        assert!(params.grads().iter().all(|&g| g == 0.0));
        assert_eq!(mine.state(), opt.state());
        assert_eq!(mine.steps(), 1);
        assert_eq!(my_anchor, anchor);
        assert_eq!(synced.buffer("param").unwrap(), donor.params());
    }

    #[test]
    fn a_state_that_does_not_fit_is_refused_before_anything_is_written() {
        let donor = model(&[1.0; 6]);
        let sgd = Sgd::new(SgdConfig::new(0.1).momentum(0.9), 6).unwrap();
        let synced = synced_from(
            &StateView::new(1, &donor)
                .optimizer("opt", &sgd)
                .capture()
                .unwrap(),
            4,
        );
        // Plain SGD keeps no momentum buffer: another layout.
        let mut params = model(&[0.0; 6]);
        let mut plain = Sgd::new(SgdConfig::new(0.1), 6).unwrap();
        let err = StateTarget::new(&mut params)
            .optimizer("opt", &mut plain)
            .apply(&synced)
            .unwrap_err();
        assert!(err.to_string().contains("momentum_buffer"), "{err}");
        assert_eq!(params.params(), &[0.0; 6]);
        // Another model: the schema hash differs.
        let mut other = model(&[0.0; 7]);
        assert!(matches!(
            StateTarget::new(&mut other).apply(&synced),
            Err(SyncError::Layout(_))
        ));
        // A view whose buffers are not one value per parameter cannot be captured.
        assert!(StateView::new(0, &donor)
            .buffer("x", &[1.0])
            .capture()
            .is_err());
        assert!(StateView::new(0, &donor)
            .buffer("x", &[0.0; 6])
            .buffer("x", &[0.0; 6])
            .capture()
            .is_err());
    }

    #[test]
    fn bytes_round_trip_little_endian() {
        let v = [1.5f32, -0.0, f32::MAX, f32::MIN_POSITIVE];
        let bytes = le_bytes(&v);
        assert_eq!(&bytes[..4], &1.5f32.to_le_bytes());
        assert_eq!(from_le_bytes(&bytes), v);
    }
}
