//! Arbitrary and mutated inbound bytes never panic the validator or the store, and never get in.

use proptest::prelude::*;
use starling_dht::{now_ms, DhtStore, DictionaryRecord, Entry, OwnerKey, Validator};

fn valid_record_bytes(n: usize, value_len: usize) -> Vec<u8> {
    let owner = OwnerKey::from_secret_bytes(&[3; 32]);
    let mut r = DictionaryRecord::default();
    for i in 0..n {
        let mut e = Entry::new(format!("s{i}"), vec![i as u8; value_len], now_ms() + 60_000);
        if i % 2 == 0 {
            e.subkey = format!("{}{i}", owner.marker());
            owner.sign_entry("k", &mut e);
        }
        r.insert(e);
    }
    r.encode()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn random_bytes_never_panic(key in proptest::collection::vec(any::<u8>(), 0..600),
                                value in proptest::collection::vec(any::<u8>(), 0..2048)) {
        let v = Validator::default();
        let _ = v.validate(&key, &value, now_ms());
        let mut store = DhtStore::default();
        let _ = store.insert(&key, &value, None, now_ms());
    }

    #[test]
    fn mutated_valid_records_never_panic_and_forgeries_stay_out(
        n in 1usize..8, value_len in 0usize..64,
        flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..6),
        cut in any::<usize>(),
    ) {
        let mut bytes = valid_record_bytes(n, value_len);
        for (pos, x) in flips {
            let len = bytes.len();
            bytes[pos % len] ^= x | 1;
        }
        bytes.truncate(cut % (bytes.len() + 1) + 1);
        let mut store = DhtStore::default();
        if store.insert(b"k", &bytes, None, now_ms()).is_ok() {
            // Whatever got in must still pass validation on its own: no forged owner entry.
            if let Some(r) = store.get_live(b"k", now_ms()) {
                for e in r.entries() {
                    prop_assert!(starling_dht::owner::verify_entry("k", e).is_ok());
                }
            }
        }
    }
}
