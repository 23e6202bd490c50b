//! The pages an on-call engineer reads: one request's swimlanes (`request`), the recent
//! incidents (`incidents`) and the offline report of `revenant check --report` (`summary`),
//! server-rendered HTML with inline SVG and no script. The admin server serves the first two;
//! `check` writes all three into one file. This module knows nothing of HTTP: it turns a
//! [`Timeline`] and violations into strings, and everything it shows from an event or a
//! violation is escaped (`html`).

pub mod html;
pub mod incidents;
pub mod model;
pub mod request;
pub mod summary;

pub use model::{Aliases, CancelWindow, Timeline, TimelineEvent};

#[cfg(test)]
mod tests;
