//! The kernel record decoder (`ingest::ebpf::record`): any byte string, as a kernel/user version
//! mismatch or a corrupt ring buffer could hand it over.
//!
//! Holds: no panic; a data record's bytes are exactly the `len` bytes after its header; an error
//! has a metric label and a message.
#![no_main]

use libfuzzer_sys::fuzz_target;
use monitor_common::DataHeader;
use revenant::ingest::ebpf::record::{self, Record};

fuzz_target!(|data: &[u8]| {
    match record::decode(data) {
        Ok(Record::Data(d)) => {
            let start = size_of::<DataHeader>();
            assert_eq!(d.bytes, &data[start..start + d.bytes.len()]);
            let _ = d.is_ingress();
        }
        Ok(_) => {}
        Err(e) => {
            assert!(!e.label().is_empty());
            assert!(!e.to_string().is_empty());
        }
    }
});
