//! revenant's HTTP surface (axum): `/metrics` from the shared registry, `/healthz`, `/readyz`
//! from the readiness latch, `/api/violations` and the `/api/requests/{id}` timeline, and the
//! pages for people: `/requests/{alias}` and `/incidents` (drawn by `crate::report`).

pub mod config;
mod pages;
pub mod server;
pub mod state;
pub mod timeline;
pub mod violations;

pub use config::AdminArgs;
pub use server::{AdminError, AdminServer};
pub use state::AdminState;
pub use timeline::{RecentEvents, RecentEventsLimits, Timeline, TimelineProvider};
