//! Starling's decentralized mixture-of-experts (in progress).
//!
//! This crate will hold expert backends (forward, backward with their own optimizer), a server
//! that batches requests and declares its experts in the DHT, and the client side
//! (`RemoteExpert`, `RemoteMixtureOfExperts` with beam search over live experts and failure
//! tolerance).
//!
//! Nothing is exported yet: the API lands with the experts issue.
