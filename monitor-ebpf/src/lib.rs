#![no_std]
// This file exists so that `monitor/build.rs` can name this crate as a build-dependency.
