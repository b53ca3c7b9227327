//! Starling's averager (in progress): how peers agree on a group and average tensors.
//!
//! This crate will hold, on top of [`starling_node`] and [`starling_compression`]:
//! - matchmaking through the DHT (group keys with expirations, leaders and followers, timeouts);
//! - the chunked, quantized, bandwidth-aware, fault-tolerant butterfly all-reduce;
//! - gossip averaging, load balancing, and local (intra-node) collectives;
//! - the `Averager` handle an ML engineer calls once per averaging step.
//!
//! Nothing is exported yet: the API lands with the averager issue, and no placeholder types are
//! published in the meantime.
