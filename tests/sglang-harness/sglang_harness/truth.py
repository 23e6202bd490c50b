"""Ground truth per room: one JSON object per line, appended and flushed as things happen, so a
test can read what SGLang's code did while the worker still runs.

Every record has `ts_ns` (CLOCK_REALTIME), `role`, `event`, and the ids it concerns (`room`,
`rid`). Values are ids, counts, statuses and digests: never prompt or completion text.
"""

import json
import os
import threading
import time
from typing import Any, Optional

# KVPoll values (sglang/srt/disaggregation/base/conn.py) by name, for readable records.
POLL_NAMES = {0: "Failed", 1: "Bootstrapping", 2: "WaitingForInput", 3: "Transferring", 4: "Success"}


def poll_name(poll: Optional[int]) -> Optional[str]:
    return None if poll is None else POLL_NAMES.get(int(poll), str(poll))


class TruthLog:
    def __init__(self, path: Optional[str], role: str):
        self.role = role
        self._lock = threading.Lock()
        self._file = open(path, "a", buffering=1) if path else None

    def emit(self, event: str, ts_ns: Optional[int] = None, **fields: Any) -> None:
        if self._file is None:
            return
        record = {
            "ts_ns": ts_ns if ts_ns is not None else time.time_ns(),
            "role": self.role,
            "pid": os.getpid(),
            "event": event,
        }
        record.update(fields)
        line = json.dumps(record, sort_keys=True, default=str)
        with self._lock:
            self._file.write(line + "\n")
            self._file.flush()
