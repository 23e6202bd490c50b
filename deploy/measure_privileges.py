"""Which capabilities does `revenant run --ebpf on` need? Measured, not assumed.

For each candidate set, as root: start the fake PD deployment of the probe tests (a prefill that
rejects with 400, a decode that bootstraps KV and answers, a router that sends both legs at once;
monitor/tests/fixtures), all running as root with every capability, as serving containers do.
Then start the real `revenant run` through `setpriv` with only that set in its bounding,
permitted and effective sets (and no_new_privs, as `allowPrivilegeEscalation: false` gives),
watching the three by pid; send one request and report whether the probes loaded, how many
processes are watched, whether the listeners were learnt and whether the eBPF source alone caught
the request that advanced after its rejection.

    sudo python3 deploy/measure_privileges.py target/release/revenant [SET ...]
    sudo python3 deploy/measure_privileges.py target/release/revenant --check SET

A SET is comma-separated capability names (`bpf,perfmon`); without any, the sets of
docs/deploy.md are measured. `--check SET` (what `cargo xtask test` runs with the chart's set)
exits 1 unless SET is enough (probes live, three processes watched, every socket of a root and
of another user's process named, the request caught) and each capability of it is needed (the
set without it fails to load, or cannot name those sockets). Loopback only; every process is
stopped at the end.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "..", "monitor", "tests", "fixtures")
DEFAULT_SETS = [
    "bpf,perfmon,sys_ptrace,dac_read_search",
    "bpf,perfmon,sys_ptrace",
    "bpf,perfmon",
    "perfmon,sys_ptrace,dac_read_search",
    "bpf,sys_ptrace,dac_read_search",
    "",
]
# What revenant reads of a watched process to find the sockets it held before it was watched
# and the ports it listens on (procs::socket_fds): the links of /proc/PID/fd.
SOCKETS = """
import os, sys
n = 0
for fd in os.listdir(f"/proc/{sys.argv[1]}/fd"):
    try:
        n += os.readlink(f"/proc/{sys.argv[1]}/fd/{fd}").startswith("socket:")
    except OSError:
        pass
print(n)
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_fake(args):
    p = subprocess.Popen(
        [sys.executable] + args,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    deadline = time.time() + 20
    while time.time() < deadline:
        line = p.stdout.readline()
        if not line:
            break
        if line.startswith("READY"):
            return p
    stop(p)
    raise RuntimeError(f"{args[0]} never printed READY")


def stop(p):
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def cap_eff(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("CapEff:"):
                return line.split()[1]
    return "?"


def get(url):
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def metric(text, name):
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def sockets_seen(pid, bounding):
    """Sockets of `pid` a process with this bounding set (as revenant runs) can name."""
    prefix = ["setpriv", "--no-new-privs", f"--bounding-set={bounding}", "--inh-caps=-all", "--"]
    out = subprocess.run(prefix + ["/usr/bin/python3", "-c", SOCKETS, str(pid)],
                         capture_output=True, text=True)
    return int(out.stdout.strip() or 0) if out.returncode == 0 else 0


def measure(revenant, caps):
    work = tempfile.mkdtemp(prefix="revenant-caps-")
    pp, dp, bp, kp = free_port(), free_port(), free_port(), free_port()
    worker = os.path.join(FIXTURES, "fake_worker.py")
    room = 9066467638188682269 - pp
    fakes = []
    rv = None
    result = {"caps": caps or "(none)"}
    try:
        fakes.append(spawn_fake([worker, "--role", "prefill", "--port", str(pp),
                                 "--bootstrap-port", str(bp), "--kv-port", str(kp)]))
        fakes.append(spawn_fake([worker, "--role", "decode", "--port", str(dp)]))
        router = spawn_fake([os.path.join(FIXTURES, "fake_router.py"), "--prefill", str(pp),
                             "--decode", str(dp), "--bootstrap-port", str(bp), "--room", str(room),
                             "--prompt-bytes", "3000", "--request-id", "req-caps"])
        fakes.append(router)
        bounding = "-all" + "".join(f",+{c}" for c in caps.split(",") if c)
        # A serving process of another user (as in a container that is not root).
        nobody = subprocess.Popen(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3",
             "-c", "import socket, sys, time; s = socket.socket(); s.bind(('127.0.0.1', 0)); "
                   "s.listen(); print('READY', flush=True); time.sleep(120)"],
            stdout=subprocess.PIPE, text=True, start_new_session=True)
        fakes.append(nobody)
        nobody.stdout.readline()
        result["sockets_of_root_worker"] = (
            f"{sockets_seen(fakes[0].pid, bounding)}/{sockets_seen(fakes[0].pid, '+all')}")
        result["sockets_of_other_user"] = (
            f"{sockets_seen(nobody.pid, bounding)}/{sockets_seen(nobody.pid, '+all')}")
        ready = os.path.join(work, "ready.json")
        alerts = os.path.join(work, "alerts.jsonl")
        log = open(os.path.join(work, "revenant.log"), "w")
        cmd = ["setpriv", "--no-new-privs", f"--bounding-set={bounding}", "--inh-caps=-all",
               "--", revenant, "run", "--ebpf", "on", "--node", "caps",
               "--pid", f"prefill={fakes[0].pid}", "--pid", f"decode={fakes[1].pid}",
               "--pid", f"router={router.pid}",
               # Only the three fakes: a serving process elsewhere on the machine (another
               # test's router or worker) must not be watched by command-line convention.
               "--no-sglang-conventions",
               "--otlp-grpc", "off", "--otlp-http", "off", "--admin", "127.0.0.1:0",
               "--alerts-jsonl", alerts, "--spool-dir", os.path.join(work, "spool"),
               "--ready-file", ready, "--group-wait", "0s"]
        rv = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
        deadline = time.time() + 30
        while time.time() < deadline and not os.path.exists(ready) and rv.poll() is None:
            time.sleep(0.05)
        if not os.path.exists(ready):
            result["started"] = f"exit {rv.wait(timeout=30)}"
            with open(os.path.join(work, "revenant.log")) as f:
                errs = [l.strip() for l in f if "rror" in l or "eBPF" in l]
            result["error"] = errs[-1][:300] if errs else ""
            return result
        result["started"] = "ready"
        result["cap_eff"] = cap_eff(rv.pid)
        time.sleep(0.2)
        admin = json.load(open(ready))["admin"]
        result["ebpf"] = json.load(open(ready)).get("ebpf")
        deadline = time.time() + 10
        watched = 0
        while time.time() < deadline:
            _, m = get(f"http://{admin}/metrics")
            watched = metric(m, "revenant_ebpf_watched_processes")
            if watched >= 3:
                break
            time.sleep(0.1)
        result["watched"] = int(watched)
        router.stdin.write("go\n")
        router.stdin.flush()
        caught = False
        deadline = time.time() + 30
        while time.time() < deadline and not caught:
            if os.path.exists(alerts):
                with open(alerts) as f:
                    caught = any("activity-after-rejection" in l and "req-caps" in l for l in f)
            time.sleep(0.1)
        result["caught"] = caught
        rules = set()
        if os.path.exists(alerts):
            with open(alerts) as f:
                for line in f:
                    for finding in json.loads(line).get("findings", []):
                        rules.add(finding.get("rule"))
        result["rules"] = sorted(r for r in rules if r)
        _, m = get(f"http://{admin}/metrics")
        result["ebpf_events"] = int(metric(m, "revenant_ebpf_lifecycle_events_total"))
        with open(os.path.join(work, "revenant.log")) as f:
            warns = [l.strip() for l in f if "WARN" in l or "cannot" in l]
        result["warnings"] = len(warns)
        if warns:
            result["first_warning"] = warns[0][:200]
        return result
    finally:
        if rv is not None:
            stop(rv)
        for p in fakes:
            stop(p)
        if result.get("caught") is False:
            result["kept"] = work  # to read revenant.log and alerts.jsonl
        else:
            shutil.rmtree(work, ignore_errors=True)


def enough(r):
    return (r.get("ebpf") == "live" and r.get("watched") == 3 and r.get("caught")
            and r["sockets_of_root_worker"].split("/")[0] == r["sockets_of_root_worker"].split("/")[1]
            and r["sockets_of_other_user"].split("/")[0] == r["sockets_of_other_user"].split("/")[1])


def check(revenant, caps):
    """0 when `caps` is enough and minimal, else 1; one JSON line per measured set."""
    wanted = [c for c in caps.split(",") if c]
    failures = []
    # A miss of unknown cause was seen in 1 of 6 runs, none in 28 later ones (docs/deploy.md):
    # it is retried, twice at most.
    for attempt in range(3):
        r = measure(revenant, caps)
        print(json.dumps(r), flush=True)
        if enough(r):
            break
    else:
        failures.append(f"{caps} is not enough")
    for c in wanted:
        rest = ",".join(x for x in wanted if x != c)
        r = measure(revenant, rest)
        print(json.dumps(r), flush=True)
        if r.get("started") == "ready" and enough(r):
            failures.append(f"{c} is not needed: {rest} is enough")
    for f in failures:
        print(f"measure_privileges: {f}", file=sys.stderr)
    return 1 if failures else 0


def main():
    if os.geteuid() != 0:
        sys.exit("run as root: the point is which of root's capabilities revenant keeps")
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    revenant = os.path.abspath(sys.argv[1])
    if sys.argv[2:3] == ["--check"] and len(sys.argv) == 4:
        sys.exit(check(revenant, sys.argv[3]))
    sets = sys.argv[2:] or DEFAULT_SETS
    for caps in sets:
        print(json.dumps(measure(revenant, caps)), flush=True)


if __name__ == "__main__":
    main()
