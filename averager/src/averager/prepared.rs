//! Pre-scheduled matchmaking: a search started ahead of its step ([`Averager::prepare`]),
//! taken by the step that averages the same tensors, or ended.

use std::sync::atomic::Ordering;

use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::Instrument;

use super::schema::{wire_label, Schema};
use super::{member_info, Averager};
use crate::group::Group;
use crate::matchmaking::find_group;
use crate::AveragerError;
use starling_node::lock::lock;

/// A search started by [`Averager::prepare`] for the step with this schema and grid cell.
pub(super) struct Prepared {
    schema: u64,
    grid: u32,
    tag: u64,
    task: JoinHandle<Result<Group, AveragerError>>,
}

impl Averager {
    /// Starts matchmaking for the next step in the background, so that its group is ready when
    /// the tensors are (hivemind's pre-scheduled matchmaking): call it when the step is about
    /// one matchmaking time away, with the sizes of the tensors that step will pass, then call
    /// [`Averager::step`] as usual. The step uses the prepared search if it averages tensors of
    /// these sizes (and the codec in force); otherwise it ends it and searches afresh. The
    /// members of a group formed ahead wait for this peer's tensors in the all-reduce, so
    /// prepare only a step that will follow soon, and [`Averager::cancel_prepared`] one that
    /// will not. Returns `false`, starting nothing, while a step's own matchmaking runs (once
    /// its group has formed, the next step's search may start during its all-reduce: see
    /// [`Averager::searches_done`]), when a search for the same tensors is already prepared,
    /// for empty tensors or a deadline already past.
    ///
    /// ```no_run
    /// # async fn demo(averager: starling_averager::Averager, mut grads: Vec<f32>) -> Result<(), starling_averager::AveragerError> {
    /// use std::time::{Duration, Instant};
    /// let deadline = Instant::now() + Duration::from_secs(30);
    /// averager.prepare(&[grads.len()], deadline);
    /// // ... the last batches of the step are computed meanwhile ...
    /// averager.step(&mut [&mut grads[..]], 1.0, deadline).await?;
    /// # Ok(()) }
    /// ```
    pub fn prepare(&self, sizes: &[usize], deadline: std::time::Instant) -> bool {
        if sizes.iter().sum::<usize>() == 0 {
            return false;
        }
        self.prepare_schema(Schema::of(sizes, &wire_label(&self.config)), deadline)
    }

    /// [`Averager::prepare`] for a step averaging `schema`.
    pub(super) fn prepare_schema(&self, schema: Schema, deadline: std::time::Instant) -> bool {
        if self.searching.load(Ordering::Acquire) || deadline <= std::time::Instant::now() {
            return false;
        }
        let cfg = &self.config;
        let grid = *lock(&self.grid_index);
        let tag = self.round_tag();
        let mut prepared = lock(&self.prepared);
        if prepared
            .as_ref()
            .is_some_and(|p| p.schema == schema.hash && p.grid == grid && p.tag == tag)
        {
            return false;
        }
        if let Some(old) = prepared.take() {
            old.task.abort();
        }
        self.announce(&schema);
        let (group_key, mm) = self.search_inputs(schema.hash, grid);
        let (transport, mode, bandwidth) =
            (self.transport.clone(), cfg.mode, self.bandwidth.current());
        let span = tracing::debug_span!(parent: transport.node().span(), "averager");
        let search = async move {
            let me = member_info(&transport, mode, bandwidth, tag).await?;
            find_group(&mm, &group_key, me, Instant::from_std(deadline)).await
        };
        *prepared = Some(Prepared {
            schema: schema.hash,
            grid,
            tag,
            task: self.runtime.spawn(search.instrument(span)),
        });
        true
    }

    /// Ends a search started by [`Averager::prepare`] whose step will not come (the members of
    /// a group it formed see this peer as failed). Does nothing when none is prepared.
    pub fn cancel_prepared(&self) {
        if let Some(p) = lock(&self.prepared).take() {
            p.task.abort();
        }
    }

    /// The prepared search for `schema` in grid cell `grid` with the current round tag, if
    /// any; a prepared search for anything else ends.
    pub(super) fn take_prepared(
        &self,
        schema: u64,
        grid: u32,
    ) -> Option<JoinHandle<Result<Group, AveragerError>>> {
        let p = lock(&self.prepared).take()?;
        if p.schema == schema && p.grid == grid && p.tag == self.round_tag() {
            Some(p.task)
        } else {
            p.task.abort();
            None
        }
    }
}
