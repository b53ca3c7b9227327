//! Flat writes across tensor boundaries and the schema hash, without a swarm.

use super::schema::{group_schema_hash as schema_hash, Schema};
use super::step::write_flat;

#[test]
fn flat_writes_land_across_tensor_boundaries() {
    let mut a = vec![0.0f32; 3];
    let mut b = vec![0.0f32; 0];
    let mut c = vec![0.0f32; 4];
    {
        let mut ts: Vec<&mut [f32]> = vec![&mut a, &mut b, &mut c];
        write_flat(&mut ts, 2, &[1.0, 2.0, 3.0]);
        write_flat(&mut ts, 6, &[9.0]);
        write_flat(&mut ts, 0, &[]);
    }
    assert_eq!(a, vec![0.0, 0.0, 1.0]);
    assert_eq!(c, vec![2.0, 3.0, 0.0, 9.0]);
}

#[test]
fn schema_hash_separates_sizes_order_and_codec() {
    let a = schema_hash(&[10, 20], "none");
    assert_eq!(a, schema_hash(&[10, 20], "none"));
    assert_ne!(a, schema_hash(&[20, 10], "none"));
    assert_ne!(a, schema_hash(&[30], "none"));
    assert_ne!(a, schema_hash(&[10, 20], "f16"));
    let s = Schema::of(&[10, 20], "f16");
    assert!(
        s.summary.contains("2 tensors of 30 elements"),
        "{}",
        s.summary
    );
    assert!(s.summary.contains("codec f16"), "{}", s.summary);
}
