//! Records shared between the kernel programs (`monitor-ebpf`) and the daemon (`monitor`).
//!
//! Everything here is `#[repr(C)]` with explicit padding so both sides agree byte for byte.
#![no_std]
