//! Answering one request: checking it against the expert's schema and the server's limits,
//! queueing it in the expert's task pool, waiting for its rows of the batch and encoding them.
//! Errors are [`RemoteError`]s, sent back to the client as they are.

use std::time::Duration;

use candle_core::{Device, Tensor};
use starling_compression::{ChunkHeader, Codec};
use tokio::sync::oneshot;
use tokio::time::timeout;

use super::batcher::{Kind, Pool, Task};
use super::runtime::expert_info;
use super::Shared;
use crate::error::{RemoteError, RemoteErrorKind};
use crate::schema::ExpertSchema;
use crate::wire::{Request, Response, WireTensor};

/// A forward or backward request checked against the expert's schema and the server's limits,
/// its tensors decoded: what a [`Task`] is made of.
#[derive(Debug)]
pub(super) struct Prepared {
    inputs: Tensor,
    grads: Option<Tensor>,
    rows: usize,
    /// The answer is encoded with the codec the request came in.
    reply_codec: Codec,
}

/// Answers one request on a served stream.
pub(super) async fn handle(shared: &Shared, req: Request) -> Result<Response, RemoteError> {
    match req {
        Request::Hello => Ok(Response::Ready),
        Request::Info { uid } => expert_info(shared, &uid)
            .await
            .map(Response::Info)
            .ok_or_else(|| unknown_expert(&uid)),
        Request::Forward { uid, inputs } => run(shared, &uid, Kind::Forward, inputs, None).await,
        Request::Backward {
            uid,
            inputs,
            grad_outputs,
        } => run(shared, &uid, Kind::Backward, inputs, Some(grad_outputs)).await,
    }
}

/// The answer for a uid this server does not host.
fn unknown_expert(uid: &str) -> RemoteError {
    RemoteError::new(
        RemoteErrorKind::UnknownExpert,
        format!("no expert {uid} here"),
    )
}

/// Runs a forward or backward: checks, queues in the expert's pool, waits for the batch.
async fn run(
    shared: &Shared,
    uid: &str,
    kind: Kind,
    inputs: Vec<WireTensor>,
    grads: Option<Vec<WireTensor>>,
) -> Result<Response, RemoteError> {
    let hosted = shared.hosted.get(uid).ok_or_else(|| unknown_expert(uid))?;
    let cfg = &shared.cfg;
    let prepared = prepare(&hosted.schema, cfg.max_request_rows, inputs, grads)?;
    let reply_codec = prepared.reply_codec;
    let out = compute(hosted.pool(kind), prepared, cfg.compute_timeout).await?;
    encode_reply(&out, reply_codec)
}

/// Checks a request's tensors (one input, and for a backward one output gradient with as many
/// rows) against `schema` and `max_request_rows`, then decodes them. Cheap checks come first,
/// so an oversized or misshapen request is refused before its payload is decoded.
pub(super) fn prepare(
    schema: &ExpertSchema,
    max_request_rows: usize,
    inputs: Vec<WireTensor>,
    grads: Option<Vec<WireTensor>>,
) -> Result<Prepared, RemoteError> {
    let bad_schema = |m: String| RemoteError::new(RemoteErrorKind::BadSchema, m);
    let x = single(inputs, "inputs")?;
    let reply_codec = ChunkHeader::parse_prefix(&x.frame)
        .map(|h| h.codec)
        .unwrap_or(Codec::None);
    let rows = schema
        .input
        .check_batch("input", &x.dims(), x.dtype)
        .map_err(|e| bad_schema(e.to_string()))?;
    if rows > max_request_rows {
        return Err(RemoteError::new(
            RemoteErrorKind::TooLarge,
            format!("{rows} samples; this server takes at most {max_request_rows}"),
        ));
    }
    let inputs = to_tensor(&x)?;
    let grads = match grads {
        Some(g) => {
            let g = single(g, "output gradients")?;
            let g_rows = schema
                .output
                .check_batch("output gradient", &g.dims(), g.dtype)
                .map_err(|e| bad_schema(e.to_string()))?;
            if g_rows != rows {
                return Err(bad_schema(format!(
                    "{g_rows} gradient rows for {rows} input rows"
                )));
            }
            Some(to_tensor(&g)?)
        }
        None => None,
    };
    Ok(Prepared {
        inputs,
        grads,
        rows,
        reply_codec,
    })
}

/// The one tensor of a list that must hold exactly one.
fn single(ts: Vec<WireTensor>, what: &str) -> Result<WireTensor, RemoteError> {
    let n = ts.len();
    match <[WireTensor; 1]>::try_from(ts) {
        Ok([t]) => Ok(t),
        Err(_) => Err(RemoteError::new(
            RemoteErrorKind::BadSchema,
            format!("{what}: expected 1 tensor, got {n}"),
        )),
    }
}

/// Decodes a checked wire tensor; a frame that disagrees with its shape or holds NaN/Inf is
/// `Malformed`.
fn to_tensor(t: &WireTensor) -> Result<Tensor, RemoteError> {
    let malformed = |e: String| RemoteError::new(RemoteErrorKind::Malformed, e);
    let values = t.decode().map_err(|e| malformed(e.to_string()))?;
    Tensor::from_vec(values, t.dims(), &Device::Cpu).map_err(|e| malformed(e.to_string()))
}

/// Queues the work in `pool` and waits at most `compute_timeout` for its rows of the batch.
async fn compute(
    pool: &Pool,
    p: Prepared,
    compute_timeout: Duration,
) -> Result<Tensor, RemoteError> {
    let (tx, rx) = oneshot::channel();
    pool.submit(Task {
        inputs: p.inputs,
        grads: p.grads,
        rows: p.rows,
        reply: tx,
    })?;
    match timeout(compute_timeout, rx).await {
        Ok(Ok(result)) => result,
        Ok(Err(_)) => Err(RemoteError::new(
            RemoteErrorKind::ShuttingDown,
            "the server is stopping",
        )),
        Err(_) => Err(RemoteError::new(
            RemoteErrorKind::Overloaded,
            "not computed within the compute timeout",
        )),
    }
}

/// The result as a response, in the codec the request used.
fn encode_reply(out: &Tensor, codec: Codec) -> Result<Response, RemoteError> {
    let encode = || -> crate::Result<WireTensor> {
        let values = out.flatten_all()?.to_vec1::<f32>()?;
        WireTensor::encode(out.dims(), &values, codec)
    };
    encode().map(|t| Response::Tensors(vec![t])).map_err(|e| {
        RemoteError::new(
            RemoteErrorKind::Internal,
            format!("cannot encode the result: {e}"),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::TensorSpec;

    fn schema() -> ExpertSchema {
        ExpertSchema {
            input: TensorSpec::f32(&[4]),
            output: TensorSpec::f32(&[4]),
        }
    }

    fn wire(shape: &[usize], codec: Codec) -> WireTensor {
        let n = shape.iter().product();
        WireTensor::encode(shape, &vec![0.5; n], codec).unwrap()
    }

    fn kind(r: Result<Prepared, RemoteError>) -> RemoteErrorKind {
        r.unwrap_err().kind
    }

    #[test]
    fn requests_are_checked_before_they_are_queued() {
        let s = schema();
        let ok = prepare(&s, 8, vec![wire(&[3, 4], Codec::Float16)], None).unwrap();
        assert_eq!((ok.rows, ok.reply_codec), (3, Codec::Float16));
        assert_eq!(ok.inputs.dims(), &[3, 4]);
        assert!(ok.grads.is_none());
        let back = prepare(
            &s,
            8,
            vec![wire(&[2, 4], Codec::None)],
            Some(vec![wire(&[2, 4], Codec::None)]),
        )
        .unwrap();
        assert_eq!(back.grads.map(|g| g.dims().to_vec()), Some(vec![2, 4]));

        use RemoteErrorKind::*;
        assert_eq!(kind(prepare(&s, 8, vec![], None)), BadSchema);
        let two = vec![wire(&[1, 4], Codec::None), wire(&[1, 4], Codec::None)];
        assert_eq!(kind(prepare(&s, 8, two, None)), BadSchema);
        assert_eq!(
            kind(prepare(&s, 8, vec![wire(&[2, 5], Codec::None)], None)),
            BadSchema
        );
        assert_eq!(
            kind(prepare(&s, 8, vec![wire(&[9, 4], Codec::None)], None)),
            TooLarge
        );
        let mismatched = Some(vec![wire(&[3, 4], Codec::None)]);
        let r = prepare(&s, 8, vec![wire(&[2, 4], Codec::None)], mismatched);
        assert_eq!(kind(r), BadSchema);
        let mut lying = wire(&[2, 4], Codec::None);
        lying.shape = vec![1, 4];
        assert_eq!(kind(prepare(&s, 8, vec![lying], None)), Malformed);
    }

    #[tokio::test]
    async fn a_full_pool_or_a_stopped_server_is_a_clear_error() {
        let (tx, mut rx) = tokio::sync::mpsc::channel(4);
        let pool = Pool {
            tx,
            queued_rows: Default::default(),
            max_queue_rows: 2,
        };
        let p = prepare(&schema(), 8, vec![wire(&[3, 4], Codec::None)], None).unwrap();
        let err = compute(&pool, p, Duration::from_secs(1)).await.unwrap_err();
        assert_eq!(err.kind, RemoteErrorKind::Overloaded);
        // A batcher that stops drops the tasks it holds, and with them their reply senders.
        let stopping = tokio::spawn(async move { drop(rx.recv().await) });
        let p = prepare(&schema(), 8, vec![wire(&[1, 4], Codec::None)], None).unwrap();
        let err = compute(&pool, p, Duration::from_secs(5)).await.unwrap_err();
        assert_eq!(err.kind, RemoteErrorKind::ShuttingDown, "{err}");
        stopping.await.unwrap();
        // Nobody takes the work: the compute timeout answers.
        let p = prepare(&schema(), 8, vec![wire(&[1, 4], Codec::None)], None).unwrap();
        let err = compute(&pool, p, Duration::from_millis(10))
            .await
            .unwrap_err();
        assert_eq!(err.kind, RemoteErrorKind::Overloaded, "{err}");
    }

    #[test]
    fn results_go_back_in_the_request_codec() {
        let out = Tensor::new(&[[1f32, 2.0], [3.0, 4.0]], &Device::Cpu).unwrap();
        match encode_reply(&out, Codec::Float16).unwrap() {
            Response::Tensors(ts) => {
                let h = ChunkHeader::parse_prefix(&ts[0].frame).unwrap();
                assert_eq!(h.codec, Codec::Float16);
                assert_eq!(ts[0].decode().unwrap(), vec![1.0, 2.0, 3.0, 4.0]);
            }
            other => panic!("{other:?}"),
        }
    }
}
