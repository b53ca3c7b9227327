//! Examples of Starling in training loops. Run one with
//! `cargo run --release -p starling-examples --example collaborative_regression`.
