//! Re-reads the TLS and token files when they change. The kubelet updates a mounted Secret by
//! swapping a symlink, and cert-manager may rewrite files in place: a file's identity
//! (device, inode, size, modification time), read through symlinks, catches both.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use super::Access;
use super::metrics::Reloaded;

/// How often the files are looked at: a rotation is in force within this.
pub const RELOAD_INTERVAL: Duration = Duration::from_secs(2);

#[derive(Debug, Clone, PartialEq, Eq)]
struct Stamp(Option<(u64, u64, u64, SystemTime)>);

fn stamp(path: &Path) -> Stamp {
    use std::os::unix::fs::MetadataExt;
    Stamp(std::fs::metadata(path).ok().map(|m| {
        (
            m.dev(),
            m.ino(),
            m.len(),
            m.modified().unwrap_or(SystemTime::UNIX_EPOCH),
        )
    }))
}

/// The stamps of a set of files, and whether they changed since last time.
struct Watched {
    paths: Vec<PathBuf>,
    last: Vec<Stamp>,
}

impl Watched {
    fn new(paths: Vec<PathBuf>) -> Watched {
        let last = paths.iter().map(|p| stamp(p)).collect();
        Watched { paths, last }
    }

    fn changed(&mut self) -> bool {
        let now: Vec<Stamp> = self.paths.iter().map(|p| stamp(p)).collect();
        let changed = now != self.last;
        self.last = now;
        changed
    }
}

pub async fn watch(access: Access, every: Duration, stop: impl std::future::Future<Output = ()>) {
    let mut tls = access.tls.as_ref().map(|t| {
        let f = t.files();
        let mut paths = vec![f.cert.clone(), f.key.clone()];
        paths.extend(f.client_ca.clone());
        Watched::new(paths)
    });
    let mut token = access
        .token
        .as_ref()
        .map(|t| Watched::new(vec![t.path().to_path_buf()]));
    let mut stop = std::pin::pin!(stop);
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = &mut stop => return,
            _ = tick.tick() => {}
        }
        if let (Some(w), Some(t)) = (tls.as_mut(), access.tls.as_ref())
            && w.changed()
        {
            let r = t.reload();
            access.stats.reloaded(Reloaded::Tls, r.is_ok());
            match r {
                Ok(()) => {
                    tracing::info!(cert = %t.files().cert.display(), "TLS certificate reloaded")
                }
                Err(e) => {
                    tracing::error!(error = %e, "TLS files changed but do not load; the previous certificate stays in force")
                }
            }
        }
        if let (Some(w), Some(t)) = (token.as_mut(), access.token.as_ref())
            && w.changed()
        {
            let r = t.reload();
            access.stats.reloaded(Reloaded::Token, r.is_ok());
            match r {
                Ok(()) => tracing::info!(file = %t.path().display(), "auth token reloaded"),
                Err(e) => {
                    tracing::error!(error = %e, "auth token file changed but does not load; the previous token stays in force")
                }
            }
        }
    }
}
