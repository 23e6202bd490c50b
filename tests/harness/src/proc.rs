use std::process::{Child, Command, ExitStatus};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// A child in its own process group. Dropping it stops the whole group: SIGTERM, then SIGKILL
/// after the grace period.
pub struct Proc {
    pub name: String,
    child: Child,
    status: Option<ExitStatus>,
    /// Grace between SIGTERM and SIGKILL on drop.
    pub grace: Duration,
}

impl Proc {
    /// Starts `cmd` in a new process group that gets SIGKILL when the thread that forked it
    /// exits (PR_SET_PDEATHSIG): fork from a thread that outlives the child.
    pub fn spawn(name: &str, cmd: &mut Command) -> Result<Proc> {
        use std::os::unix::process::CommandExt;
        cmd.process_group(0);
        // SAFETY: prctl only, in the forked child before exec.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let child = cmd
            .spawn()
            .with_context(|| format!("starting {name} ({cmd:?})"))?;
        Ok(Proc {
            name: name.into(),
            child,
            status: None,
            grace: Duration::from_secs(10),
        })
    }

    /// The same child with another grace on drop; `Duration::ZERO`: SIGKILL at once (servers a
    /// test owns, whose shutdown it does not test).
    pub fn with_grace(mut self, grace: Duration) -> Proc {
        self.grace = grace;
        self
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn child_mut(&mut self) -> &mut Child {
        &mut self.child
    }

    /// The exit status if it has exited (reaped once, remembered).
    pub fn exited(&mut self) -> Option<ExitStatus> {
        if self.status.is_none() {
            self.status = self.child.try_wait().ok().flatten();
        }
        self.status
    }

    fn signal_group(&self, sig: i32) {
        // SAFETY: kill(2) on the process group we created (pgid = the child's pid).
        unsafe {
            libc::kill(-(self.child.id() as i32), sig);
        }
    }

    /// Sends `sig` to the group and waits up to `grace` for the leader; then SIGKILLs the group
    /// (strays included) and reaps the leader.
    pub fn stop(&mut self, sig: i32, grace: Duration) -> Option<ExitStatus> {
        self.stop_in_time(sig, grace).0
    }

    /// [`Proc::stop`], also telling whether the leader exited within `grace` (false: killed).
    pub fn stop_in_time(&mut self, sig: i32, grace: Duration) -> (Option<ExitStatus>, bool) {
        if self.exited().is_none() {
            self.signal_group(sig);
            let deadline = Instant::now() + grace;
            while self.exited().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        let in_time = self.status.is_some();
        self.signal_group(libc::SIGKILL);
        if self.status.is_none() {
            self.status = self.child.wait().ok();
        }
        (self.status, in_time)
    }

    /// Waits for the child to exit by itself; `Ok(None)` if `interrupted` was raised first.
    pub fn wait_until(
        &mut self,
        timeout: Duration,
        interrupted: Option<&AtomicBool>,
    ) -> Result<Option<ExitStatus>> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(s) = self.exited() {
                return Ok(Some(s));
            }
            if interrupted.is_some_and(|f| f.load(Ordering::Relaxed)) {
                return Ok(None);
            }
            if Instant::now() > deadline {
                bail!("{} still running after {timeout:?}", self.name);
            }
            std::thread::sleep(Duration::from_millis(25));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let grace = self.grace;
        self.stop(libc::SIGTERM, grace);
    }
}
