//! pd-sim's wire protocol against SGLang 0.5.23's own code: `interop/zmq_interop.py` with
//! `--require-sglang` builds decode's registration and destinations with SGLang's
//! `build_receiver_registration_message` / `build_receiver_metadata_message`, parses prefill's
//! status and ABORT_ACK with `CommonKVManager.parse_kv_status_message` / `AbortAck.from_zmq`
//! and applies them with `apply_prefill_status`, and runs SGLang's real prefill bootstrap thread
//! (`MooncakeKVManager.start_prefill_thread`) on pd-sim decode's registration, destinations and
//! ABORT, whose ABORT_ACK SGLang sends itself.
//!
//! Ignored by default: it needs a Python with `sglang==0.5.23` (which brings pyzmq, numpy,
//! msgspec, torch; nothing else is needed to import the modules it uses), e.g.
//!   PD_SIM_SGLANG_PYTHON=/path/to/sglang-venv/bin/python \
//!     cargo test -p pd-sim --test suite -- --ignored sglang_interop::

use crate::support;

use support::run_interop;

#[test]
#[ignore = "needs PD_SIM_SGLANG_PYTHON pointing at a Python with sglang==0.5.23"]
fn sglang_builders_parsers_and_bootstrap_thread_interop() {
    let python = std::env::var("PD_SIM_SGLANG_PYTHON")
        .expect("set PD_SIM_SGLANG_PYTHON to a Python with sglang==0.5.23 installed");
    let v = run_interop(&python, &["--require-sglang"]);
    assert_eq!(v["sglang"], true);
    assert_eq!(v["prefill"], "ok");
    assert_eq!(v["decode"], "ok");
}
