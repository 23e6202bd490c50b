//! `nats-server -js` on loopback for the cluster-mode tests: one server, or a three-node
//! cluster, each with its own store under a scratch directory, on free ports, ready once its
//! monitoring endpoint says JetStream is healthy, killed (and its store removed) on drop.

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::{Proc, ScratchDir, free_port, http_get, system_bin};

/// How long a server (or a cluster) may take to report JetStream healthy. A three-node cluster
/// restarted whole brings its streams current again by Raft catch-up, which took over 20 s on a
/// loaded 2-core machine; the wait ends as soon as every node is healthy.
const READY_WITHIN: Duration = Duration::from_secs(60);

/// One `nats-server` process.
pub struct NatsNode {
    pub name: String,
    /// The client port on 127.0.0.1.
    pub port: u16,
    /// The monitoring port (`/healthz`).
    pub monitor: u16,
    /// The cluster (route) port, for a cluster member.
    pub cluster_port: Option<u16>,
    store: PathBuf,
    log: PathBuf,
    routes: Vec<u16>,
    cluster_name: Option<String>,
    proc: Option<Proc>,
}

impl NatsNode {
    /// `nats://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    fn command(&self) -> Command {
        let mut cmd = Command::new(system_bin("nats-server"));
        cmd.args(["-js", "-a", "127.0.0.1", "-n", &self.name])
            .args(["-p", &self.port.to_string()])
            .args(["-m", &self.monitor.to_string()])
            .arg("-sd")
            .arg(&self.store)
            .arg("-l")
            .arg(&self.log)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if let (Some(cp), Some(cn)) = (self.cluster_port, &self.cluster_name) {
            let routes: Vec<String> = self
                .routes
                .iter()
                .map(|p| format!("nats://127.0.0.1:{p}"))
                .collect();
            cmd.args(["--cluster_name", cn])
                .args(["--cluster", &format!("nats://127.0.0.1:{cp}")])
                .args(["--routes", &routes.join(",")]);
        }
        cmd
    }

    /// Starts the process (again, after [`NatsNode::kill`]: same ports, same store).
    pub fn start(&mut self) -> Result<()> {
        if self.proc.is_some() {
            return Ok(());
        }
        let proc = Proc::spawn(&format!("nats-server {}", self.name), &mut self.command())?
            .with_grace(Duration::ZERO);
        self.proc = Some(proc);
        Ok(())
    }

    /// SIGKILLs the process; its store stays for a restart.
    pub fn kill(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.stop(libc::SIGKILL, Duration::ZERO);
        }
    }

    /// The process id while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.proc.as_ref().map(Proc::pid)
    }

    pub fn is_running(&mut self) -> bool {
        self.proc.as_mut().is_some_and(|p| p.exited().is_none())
    }

    /// Whether the monitoring endpoint says JetStream is up (`/healthz?js-enabled-only=true`
    /// answers 200 once the JetStream subsystem runs; in a cluster, once it has a meta leader).
    fn healthy(&self) -> bool {
        let url = format!("http://127.0.0.1:{}/healthz", self.monitor);
        matches!(http_get(&url), Ok((200, _)))
            && TcpStream::connect(("127.0.0.1", self.port)).is_ok()
    }

    /// The end of the server's log, for failure messages.
    pub fn log_tail(&self) -> String {
        crate::tail(&self.log, 30)
    }
}

/// A single server or a cluster, with the scratch directory that holds their stores and logs.
pub struct Nats {
    pub nodes: Vec<NatsNode>,
    pub dir: ScratchDir,
}

impl Nats {
    /// One `nats-server -js` on free loopback ports, JetStream ready.
    pub fn single() -> Result<Nats> {
        let dir = ScratchDir::new("nats")?;
        let node = new_node(dir.path(), "n1", None, Vec::new())?;
        let mut nats = Nats {
            nodes: vec![node],
            dir,
        };
        nats.nodes[0].start()?;
        nats.wait_ready()?;
        Ok(nats)
    }

    /// A three-node JetStream cluster on loopback (cluster name `revenant-test`), every member
    /// healthy.
    pub fn cluster3() -> Result<Nats> {
        let dir = ScratchDir::new("nats-cluster")?;
        let ports = [free_port()?, free_port()?, free_port()?];
        let mut nodes = Vec::new();
        for (i, cp) in ports.iter().enumerate() {
            let routes = ports.iter().copied().filter(|p| p != cp).collect();
            nodes.push(new_node(
                dir.path(),
                &format!("n{}", i + 1),
                Some((*cp, "revenant-test")),
                routes,
            )?);
        }
        let mut nats = Nats { nodes, dir };
        for n in &mut nats.nodes {
            n.start()?;
        }
        nats.wait_ready()?;
        Ok(nats)
    }

    /// The client URLs of every node, comma-separated (what `--nats` takes).
    pub fn urls(&self) -> String {
        self.nodes
            .iter()
            .map(NatsNode::url)
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Waits until every running node reports JetStream healthy.
    pub fn wait_ready(&mut self) -> Result<()> {
        let deadline = Instant::now() + READY_WITHIN;
        loop {
            let mut all = true;
            for n in &mut self.nodes {
                if n.proc.is_none() {
                    continue;
                }
                if !n.is_running() {
                    bail!("{} exited at start:\n{}", n.name, n.log_tail());
                }
                all &= n.healthy();
            }
            if all {
                return Ok(());
            }
            if Instant::now() > deadline {
                let logs: Vec<String> = self
                    .nodes
                    .iter()
                    .map(|n| format!("--- {}\n{}", n.name, n.log_tail()))
                    .collect();
                bail!(
                    "nats not healthy within {READY_WITHIN:?}:\n{}",
                    logs.join("\n")
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

fn new_node(
    dir: &Path,
    name: &str,
    cluster: Option<(u16, &str)>,
    routes: Vec<u16>,
) -> Result<NatsNode> {
    let store = dir.join(format!("{name}-store"));
    std::fs::create_dir_all(&store).with_context(|| store.display().to_string())?;
    Ok(NatsNode {
        name: name.into(),
        port: free_port()?,
        monitor: free_port()?,
        cluster_port: cluster.map(|c| c.0),
        store,
        log: dir.join(format!("{name}.log")),
        routes,
        cluster_name: cluster.map(|c| c.1.to_owned()),
        proc: None,
    })
}

impl Drop for Nats {
    fn drop(&mut self) {
        for n in &mut self.nodes {
            n.kill();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sends `PING` on the client port and expects the server's `INFO` then `PONG`.
    fn ping(port: u16) -> bool {
        use std::io::{BufRead, BufReader, Write};
        let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
            return false;
        };
        let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
        let mut r = BufReader::new(s.try_clone().unwrap());
        let mut line = String::new();
        if r.read_line(&mut line).is_err() || !line.starts_with("INFO ") {
            return false;
        }
        if !line.contains("\"jetstream\":true") {
            return false;
        }
        if s.write_all(b"CONNECT {\"verbose\":false}\r\nPING\r\n")
            .is_err()
        {
            return false;
        }
        line.clear();
        r.read_line(&mut line).is_ok() && line.starts_with("PONG")
    }

    #[test]
    fn a_single_server_runs_jetstream_and_is_gone_after_drop() {
        if crate::on_path("nats-server").is_none() {
            panic!("nats-server is not on PATH: run `cargo xtask setup`");
        }
        let nats = Nats::single().unwrap();
        let port = nats.nodes[0].port;
        let store = nats.dir.path().to_path_buf();
        assert!(ping(port), "no INFO with jetstream, or no PONG");
        drop(nats);
        assert!(TcpStream::connect(("127.0.0.1", port)).is_err());
        assert!(!store.exists(), "store left behind");
    }

    #[test]
    fn a_three_node_cluster_comes_up_and_survives_one_member() {
        let mut nats = Nats::cluster3().unwrap();
        for n in &nats.nodes {
            assert!(ping(n.port), "{} does not answer", n.name);
        }
        nats.nodes[0].kill();
        assert!(ping(nats.nodes[1].port) && ping(nats.nodes[2].port));
        nats.nodes[0].start().unwrap();
        nats.wait_ready().unwrap();
        assert!(ping(nats.nodes[0].port));
    }
}
