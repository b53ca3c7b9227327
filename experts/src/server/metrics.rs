//! The expert server's Prometheus metrics, in its node's registry
//! ([`starling_node::Node::metrics`]) under `starling_experts_*`: requests by kind (`info`,
//! `forward`, `backward`, `malformed`, `too_large`) and outcome (`ok`, `refused`), and their
//! latency (histogram per kind). The hosted uids go on the node's board (its heartbeat).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};
use starling_node::metrics::latency_buckets;
use starling_node::metrics::Metrics;

use crate::wire::Request;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    kind: &'static str,
    outcome: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    kind: &'static str,
}

/// The expert server's metrics on one node (cheap to clone; clones share values).
#[derive(Clone)]
pub(crate) struct ExpertMetrics {
    requests: Family<RequestLabels, Counter>,
    seconds: Family<KindLabels, Histogram>,
}

impl ExpertMetrics {
    /// The expert metrics in `metrics` (a node's: registered on first use).
    pub fn of(metrics: &Metrics) -> Self {
        metrics.component(|r: &mut Registry| {
            let m = ExpertMetrics {
                requests: Family::default(),
                seconds: Family::new_with_constructor(|| Histogram::new(latency_buckets())),
            };
            r.register(
                "experts_requests",
                "Expert requests served, by kind and outcome",
                m.requests.clone(),
            );
            r.register_with_unit(
                "experts_request",
                "Time to answer an expert request (batching and compute included), by kind",
                Unit::Seconds,
                m.seconds.clone(),
            );
            m
        })
    }

    /// The label of a request.
    pub fn kind_of(req: &Request) -> &'static str {
        match req {
            Request::Hello => "hello",
            Request::Info { .. } => "info",
            Request::Forward { .. } => "forward",
            Request::Backward { .. } => "backward",
        }
    }

    /// Records one request of `kind` answered after `seconds`.
    pub fn observe(&self, kind: &'static str, ok: bool, seconds: f64) {
        let outcome = if ok { "ok" } else { "refused" };
        self.requests
            .get_or_create(&RequestLabels { kind, outcome })
            .inc();
        self.seconds
            .get_or_create(&KindLabels { kind })
            .observe(seconds);
    }
}
