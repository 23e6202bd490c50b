//! Sources: everything that produces `LifecycleEvent`s into the pipeline.

pub mod ebpf;
