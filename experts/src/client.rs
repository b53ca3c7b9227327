//! Calling experts: [`ExpertClient`] (streams, DHT lookups) and [`RemoteExpert`].
//!
//! A call takes a pooled stream to the server or opens one with
//! `starling_node::streams::open_confirmed` (hello, `Ready`, retried when the server's accept
//! queue dropped the stream), sends one request and reads one response within the call's
//! timeout. A server's refusal becomes [`ExpertError::Remote`].

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use candle_core::{Device, Tensor};
use starling_compression::Codec;
use starling_node::streams::{open_confirmed, Confirmed, OpenError, Retry};
use starling_node::{Multiaddr, Node, PeerId, Stream};
use tokio::time::Instant;

use crate::grid::{parse_declaration, prefix_key, ExpertHost, ExpertUid};
use crate::wire::{
    read_msg, write_msg, ExpertInfo, Request, Response, WireTensor, EXPERTS_PROTOCOL,
};
use crate::{ExpertError, RemoteError, Result};
use starling_node::lock::lock;

/// Streams [`ExpertClient`] opens to one server before it gives up on a call (each attempt
/// that the server's accept queue dropped costs one).
const OPEN_ATTEMPTS: u32 = 4;
/// Pause after the first dropped attempt; it grows linearly (`Retry`'s policy).
const OPEN_RETRY_PAUSE: Duration = Duration::from_millis(5);

/// Client settings.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// Codec for payloads sent (the server answers with the same codec).
    pub codec: Codec,
    /// Time to dial, open a stream and complete the hello.
    pub connect_timeout: Duration,
    /// Default time for a whole forward call.
    pub forward_timeout: Duration,
    /// Default time for a whole backward call.
    pub backward_timeout: Duration,
    /// Largest response frame accepted, in bytes.
    pub max_frame_bytes: usize,
    /// Open streams kept per server for reuse.
    pub max_idle_streams: usize,
    /// An idle stream older than this is not reused (servers close streams idle for 60 s).
    pub stream_idle: Duration,
}

impl Default for ClientConfig {
    fn default() -> Self {
        ClientConfig {
            codec: Codec::None,
            connect_timeout: Duration::from_secs(5),
            forward_timeout: Duration::from_secs(30),
            backward_timeout: Duration::from_secs(60),
            max_frame_bytes: 256 << 20,
            max_idle_streams: 16,
            stream_idle: Duration::from_secs(20),
        }
    }
}

/// What every clone of an [`ExpertClient`] shares.
struct Inner {
    node: Node,
    cfg: ClientConfig,
    idle: Mutex<HashMap<PeerId, Vec<(Stream, Instant)>>>,
}

/// Calls experts over the node's streams and finds them in the DHT. Cheap to clone.
///
/// ```no_run
/// # async fn demo(node: starling_node::Node) -> starling_experts::Result<()> {
/// use starling_experts::{ClientConfig, ExpertClient};
/// let client = ExpertClient::new(node, ClientConfig::default());
/// let expert = client.find("ffn.0.3").await?.expect("no live expert ffn.0.3");
/// let x = candle_core::Tensor::randn(0f32, 1.0, (4, 256), &candle_core::Device::Cpu)?;
/// let y = expert.forward(&x).await?;
/// let grad_x = expert.backward(&x, &y.ones_like()?).await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct ExpertClient {
    inner: Arc<Inner>,
}

impl ExpertClient {
    /// A client on `node`.
    pub fn new(node: Node, cfg: ClientConfig) -> ExpertClient {
        ExpertClient {
            inner: Arc::new(Inner {
                node,
                cfg,
                idle: Mutex::new(HashMap::new()),
            }),
        }
    }

    /// Its settings.
    pub fn config(&self) -> &ClientConfig {
        &self.inner.cfg
    }

    /// The node it calls through.
    pub fn node(&self) -> &Node {
        &self.inner.node
    }

    /// A handle on expert `uid` served by `peer` (reachable at `addrs` if not connected yet).
    pub fn expert(&self, uid: &str, peer: PeerId, addrs: Vec<Multiaddr>) -> RemoteExpert {
        RemoteExpert {
            uid: uid.to_string(),
            peer,
            addrs,
            client: self.clone(),
        }
    }

    /// Looks expert `uid` up in the DHT: the most recently declared live replica, or `None`.
    pub async fn find(&self, uid: &str) -> Result<Option<RemoteExpert>> {
        Ok(self.find_replicas(uid).await?.into_iter().next())
    }

    /// Every live replica of expert `uid` (one per serving peer), most recently declared first.
    pub async fn find_replicas(&self, uid: &str) -> Result<Vec<RemoteExpert>> {
        let parsed = ExpertUid::parse(uid)?;
        let last = parsed.coords.len() - 1;
        let mut children = self.children(&parsed.name, &parsed.coords[..last]).await?;
        Ok(children
            .remove(&parsed.coords[last])
            .unwrap_or_default()
            .into_iter()
            .filter_map(|h| Some(self.expert(uid, h.peer_id()?, h.multiaddrs())))
            .collect())
    }

    /// The live coordinates under a prefix (`name.prefix...`) and the servers that declared each,
    /// most recent declaration first. Declarations not signed by the peer they name are dropped.
    pub async fn children(
        &self,
        name: &str,
        prefix: &[u32],
    ) -> Result<HashMap<u32, Vec<ExpertHost>>> {
        let key = prefix_key(name, prefix);
        let mut entries: Vec<(String, ExpertHost, u64)> = self.inner.node.get(&key).await?;
        entries.sort_by_key(|e| std::cmp::Reverse(e.2));
        let mut out: HashMap<u32, Vec<ExpertHost>> = HashMap::new();
        for (sub, host, _) in entries {
            if let Some(c) = parse_declaration(&key, &sub, &host) {
                out.entry(c).or_default().push(host);
            }
        }
        Ok(out)
    }

    /// Every live expert of grid `name` (at most `limit`; one entry per replica), walking the DHT
    /// prefix by prefix: a coordinate whose own prefix key lists nothing is an expert.
    pub async fn list(&self, name: &str, limit: usize) -> Result<Vec<RemoteExpert>> {
        use futures::stream::StreamExt;
        let parallel = 16;
        let mut frontier: Vec<(Vec<u32>, Vec<ExpertHost>)> = vec![(vec![], vec![])];
        let mut found = Vec::new();
        for _level in 0..=crate::grid::MAX_GRID_DEPTH {
            if frontier.is_empty() || found.len() >= limit {
                break;
            }
            let lookups =
                futures::stream::iter(frontier.into_iter().map(|(prefix, host)| async move {
                    let children = self.children(name, &prefix).await;
                    (prefix, host, children)
                }))
                .buffer_unordered(parallel)
                .collect::<Vec<_>>()
                .await;
            let mut next = Vec::new();
            for (prefix, hosts, children) in lookups {
                let children = children?;
                if children.is_empty() && !hosts.is_empty() {
                    let uid = ExpertUid {
                        name: name.to_string(),
                        coords: prefix,
                    }
                    .to_string();
                    for host in hosts {
                        if let Some(peer) = host.peer_id() {
                            found.push(self.expert(&uid, peer, host.multiaddrs()));
                        }
                    }
                } else {
                    for (c, h) in children {
                        let mut p = prefix.clone();
                        p.push(c);
                        next.push((p, h));
                    }
                }
            }
            next.truncate(limit.saturating_mul(4).max(64));
            frontier = next;
        }
        found.sort_by(|a, b| {
            let key = |e: &RemoteExpert| {
                ExpertUid::parse(&e.uid)
                    .map(|u| u.coords)
                    .unwrap_or_default()
            };
            key(a).cmp(&key(b))
        });
        found.truncate(limit);
        Ok(found)
    }

    /// Opens a stream to `peer` that its server confirmed with `Ready` (the hello tells us the
    /// stream was taken: under bursts libp2p-stream drops inbound streams). When the first
    /// stream cannot be opened at all, dials `addrs` once and tries again at once. Gives up
    /// after [`OPEN_ATTEMPTS`] or `connect_timeout`.
    async fn open(&self, peer: PeerId, addrs: &[Multiaddr]) -> Result<Stream> {
        let node = &self.inner.node;
        let deadline = Instant::now() + self.inner.cfg.connect_timeout;
        let dialed = AtomicBool::new(false);
        let open = || {
            let mut control = node.stream_control();
            let dialed = &dialed;
            async move {
                match control.open_stream(peer, EXPERTS_PROTOCOL).await {
                    Ok(s) => Ok(s),
                    Err(e) if dialed.swap(true, Ordering::Relaxed) => Err(e.to_string()),
                    Err(_) => {
                        // Not connected yet (or the connection closed): dial the declared
                        // addresses. A failed dial is not final: libp2p may still know a way.
                        node.connect_if_needed(peer, addrs)
                            .await
                            .map_err(|e| e.to_string())?;
                        control
                            .open_stream(peer, EXPERTS_PROTOCOL)
                            .await
                            .map_err(|e| e.to_string())
                    }
                }
            }
        };
        let retry = Retry {
            attempts: OPEN_ATTEMPTS,
            pause: OPEN_RETRY_PAUSE,
            ..Retry::default()
        };
        let opened = open_confirmed(open, &Request::Hello, 1024, deadline, retry).await;
        match opened {
            Ok(Confirmed {
                stream,
                reply: Response::Ready,
                ..
            }) => Ok(stream),
            Ok(Confirmed { reply, .. }) => Err(ExpertError::Protocol(format!(
                "{peer} answered the hello with {reply:?}, expected Ready"
            ))),
            Err(OpenError::BadReply(e)) => Err(ExpertError::Protocol(format!(
                "{peer} answered the hello with garbage: {e}"
            ))),
            Err(OpenError::Unanswered { last, .. }) => Err(ExpertError::Timeout(format!(
                "cannot open an expert stream to {peer} ({last})"
            ))),
        }
    }

    /// A pooled stream to `peer` that has not idled past `stream_idle`, if any.
    fn take_idle(&self, peer: PeerId) -> Option<Stream> {
        let mut idle = lock(&self.inner.idle);
        let list = idle.get_mut(&peer)?;
        while let Some((s, since)) = list.pop() {
            if since.elapsed() < self.inner.cfg.stream_idle {
                return Some(s);
            }
        }
        None
    }

    /// Returns a stream to the pool after a successful call (at most `max_idle_streams` per
    /// peer; an extra one is dropped).
    fn put_idle(&self, peer: PeerId, stream: Stream) {
        let mut idle = lock(&self.inner.idle);
        let list = idle.entry(peer).or_default();
        if list.len() < self.inner.cfg.max_idle_streams {
            list.push((stream, Instant::now()));
        }
    }

    /// Forgets pooled streams to `peer` (after it failed).
    fn forget(&self, peer: PeerId) {
        lock(&self.inner.idle).remove(&peer);
    }

    /// Sends one request and reads its response within `limit`. Idempotent requests retry once
    /// on a fresh stream when a reused one turns out to be dead.
    async fn call(
        &self,
        peer: PeerId,
        addrs: &[Multiaddr],
        req: &Request,
        limit: Duration,
    ) -> Result<Response> {
        let deadline = Instant::now() + limit;
        let idempotent = !matches!(req, Request::Backward { .. });
        let exchange = |mut stream: Stream| async move {
            write_msg(&mut stream, req).await?;
            let resp = read_msg::<_, Response>(&mut stream, self.inner.cfg.max_frame_bytes).await?;
            Ok::<_, ExpertError>((stream, resp))
        };
        let run = async {
            if let Some(stream) = self.take_idle(peer) {
                match exchange(stream).await {
                    Ok(r) => return Ok(r),
                    Err(e) if !idempotent => return Err(e),
                    Err(_) => {}
                }
            }
            let stream = self.open(peer, addrs).await?;
            exchange(stream).await
        };
        match tokio::time::timeout_at(deadline, run).await {
            Ok(Ok((stream, resp))) => {
                self.put_idle(peer, stream);
                Ok(resp)
            }
            Ok(Err(e)) => {
                self.forget(peer);
                Err(e)
            }
            Err(_) => Err(ExpertError::Timeout(format!(
                "no answer from {peer} within {limit:?}"
            ))),
        }
    }
}

/// An expert served somewhere in the swarm.
#[derive(Clone)]
pub struct RemoteExpert {
    uid: String,
    peer: PeerId,
    addrs: Vec<Multiaddr>,
    client: ExpertClient,
}

impl std::fmt::Debug for RemoteExpert {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RemoteExpert({} at {})", self.uid, self.peer)
    }
}

impl RemoteExpert {
    /// Its uid.
    pub fn uid(&self) -> &str {
        &self.uid
    }

    /// The server hosting it.
    pub fn peer(&self) -> PeerId {
        self.peer
    }

    /// Asks the server for the expert's description.
    pub async fn info(&self) -> Result<ExpertInfo> {
        let req = Request::Info {
            uid: self.uid.clone(),
        };
        match self
            .client
            .call(
                self.peer,
                &self.addrs,
                &req,
                self.client.inner.cfg.connect_timeout * 2,
            )
            .await?
        {
            Response::Info(i) => Ok(i),
            other => Err(self.unexpected(other)),
        }
    }

    /// Runs the expert on `x` (`[batch, ..]`, f32) with the client's default forward timeout.
    pub async fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_within(x, self.client.inner.cfg.forward_timeout)
            .await
    }

    /// Runs the expert on `x`, giving up after `limit`.
    pub async fn forward_within(&self, x: &Tensor, limit: Duration) -> Result<Tensor> {
        let req = Request::Forward {
            uid: self.uid.clone(),
            inputs: vec![self.to_wire(x)?],
        };
        self.tensor_reply(
            self.client
                .call(self.peer, &self.addrs, &req, limit)
                .await?,
            x.dims(),
        )
    }

    /// Sends the inputs of a forward and the gradient of the loss with respect to its outputs;
    /// returns the gradient with respect to the inputs. The server takes an optimizer step.
    pub async fn backward(&self, x: &Tensor, grad_out: &Tensor) -> Result<Tensor> {
        self.backward_within(x, grad_out, self.client.inner.cfg.backward_timeout)
            .await
    }

    /// [`Self::backward`] giving up after `limit`.
    pub async fn backward_within(
        &self,
        x: &Tensor,
        grad_out: &Tensor,
        limit: Duration,
    ) -> Result<Tensor> {
        let req = Request::Backward {
            uid: self.uid.clone(),
            inputs: vec![self.to_wire(x)?],
            grad_outputs: vec![self.to_wire(grad_out)?],
        };
        self.tensor_reply(
            self.client
                .call(self.peer, &self.addrs, &req, limit)
                .await?,
            x.dims(),
        )
    }

    /// `t` as f32 values in the client's codec.
    fn to_wire(&self, t: &Tensor) -> Result<WireTensor> {
        let values = t
            .flatten_all()?
            .to_dtype(candle_core::DType::F32)?
            .to_vec1::<f32>()?;
        WireTensor::encode(t.dims(), &values, self.client.inner.cfg.codec)
    }

    /// The tensor of a forward or backward answer, which must keep the batch size.
    fn tensor_reply(&self, resp: Response, batch_dims: &[usize]) -> Result<Tensor> {
        match resp {
            Response::Tensors(ts) if ts.len() == 1 => {
                let t = &ts[0];
                let dims = t.dims();
                if dims.first() != batch_dims.first() {
                    return Err(ExpertError::Protocol(format!(
                        "{}: answer has shape {dims:?} for a batch of {:?}",
                        self.uid,
                        batch_dims.first()
                    )));
                }
                Ok(Tensor::from_vec(t.decode()?, dims, &Device::Cpu)?)
            }
            other => Err(self.unexpected(other)),
        }
    }

    /// The error for an answer that is not the expected one: the server's [`RemoteError`],
    /// or a protocol error.
    fn unexpected(&self, resp: Response) -> ExpertError {
        match resp {
            Response::Error { kind, message } => {
                RemoteError { kind, message }.into_expert_error(&self.uid, self.peer)
            }
            other => ExpertError::Protocol(format!("{}: unexpected answer {other:?}", self.uid)),
        }
    }
}
