//! pd-sim's wire protocol against real libzmq (pyzmq) and SGLang 0.5.23's own code: a standalone
//! prefill and decode, and `interop/zmq_interop.py` playing their peers (see its docstring).
//! Ignored by default: they need a Python.
//!
//! With pyzmq alone (`cargo xtask test` sets PD_SIM_PYTHON to such a venv):
//!   python3 -m venv /tmp/zmqvenv && /tmp/zmqvenv/bin/pip install pyzmq
//!   PD_SIM_PYTHON=/tmp/zmqvenv/bin/python cargo test -p pd-sim --test suite -- --ignored zmq_interop::
//! The same script against SGLang's own code: `tests/suite/sglang_interop.rs`.

use crate::support;

use support::run_interop;

#[test]
#[ignore = "needs PD_SIM_PYTHON pointing at a Python with pyzmq"]
fn pyzmq_interop() {
    let python =
        std::env::var("PD_SIM_PYTHON").expect("set PD_SIM_PYTHON to a Python with pyzmq installed");
    let v = run_interop(&python, &[]);
    assert_eq!(v["prefill"], "ok");
    assert_eq!(v["decode"], "ok");
    // Two KV buffers and the metadata slot.
    assert_eq!(v["kv_blocks"], 3);
}
