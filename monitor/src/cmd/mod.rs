//! The subcommands that are not the daemon: offline `check` and `rules` inspection. `revenant run`
//! lives in [`crate::run`].

pub mod check;
pub mod rules;
