#!/usr/bin/env bash
# Throughput/CPU benchmark of the simulator: starts a release cluster on ephemeral ports,
# drives `pd-sim load` at each rate, and prints achieved rate, latency and CPU time per
# request of every process (utime+stime from /proc, so other load on the box matters less).
# Usage: tests/pd-sim/bench/throughput.sh [MODE] [RATES...]   e.g. correct 1000 2000 4000
set -euo pipefail
cd "$(dirname "$0")/../../.."
MODE=${1:-correct}; shift || true
RATES=${*:-1000 2000 4000}
# PD_SIM_BIN: a prebuilt binary (skips the build); LOAD_ARGS: extra `pd-sim load` flags.
if [ -n "${PD_SIM_BIN:-}" ]; then B=$PD_SIM_BIN; else
  cargo build -q -p pd-sim --release
  B=${CARGO_TARGET_DIR:-target}/release/pd-sim
fi
OUT=$(mktemp); ERR=$(mktemp)
PD_SIM_LOG=warn $B cluster --ephemeral --mode "$MODE" ${CLUSTER_ARGS:-} >"$OUT" 2>"$ERR" &
CL=$!
trap 'kill $CL 2>/dev/null; wait $CL 2>/dev/null; rm -f "$OUT" "$ERR"' EXIT
for _ in $(seq 100); do grep -q '"role":"cluster"' "$OUT" && break; sleep 0.1; done
READY=$(grep '"role":"cluster"' "$OUT" | sed 's/^READY //')
ROUTER=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["router"])' "$READY")
PIDS=$(python3 -c 'import json,sys; p=json.loads(sys.argv[1])["pids"]; print(p["router"], p["prefill"], p["decode"])' "$READY")
TCK=$(getconf CLK_TCK)
cpu() { awk '{print $14+$15}' /proc/$1/stat; }
for R in $RATES; do
  N=$((R * 8))
  declare -A before; for p in $PIDS; do before[$p]=$(cpu $p); done
  S=$(mktemp)
  /usr/bin/time -f "%U %S" -o "$S.time" $B load --router "$ROUTER" --rate "$R" --requests "$N" \
     --prompt-len 16..128 --over-capacity-share 0.02 --stream-share 0.1 ${LOAD_ARGS:-} --quiet --summary-json "$S" 2>/dev/null
  LG=$(awk '{print ($1+$2)}' "$S.time")
  per=""; for p in $PIDS; do per="$per $(python3 -c "print(round(($(cpu $p)-${before[$p]})/$TCK*1e6/$N))")"; done
  python3 - "$S" "$N" "$LG" $per <<'PY'
import json, sys
s = json.load(open(sys.argv[1])); n = int(sys.argv[2]); lg = float(sys.argv[3])
r, p, d = (int(x) for x in sys.argv[4:7])
print(f"target {s['target_rate']:.0f}/s achieved {s['achieved_rate']:.0f}/s ok {s['ok']} rejected {s['rejected_by_status']} errors {s['errors']} "
      f"p50 {s['latency_ms_p50']:.2f} ms p99 {s['latency_ms_p99']:.2f} ms | CPU us/request router {r} prefill {p} decode {d} load {lg/n*1e6:.0f}")
PY
  rm -f "$S" "$S.time"
done
