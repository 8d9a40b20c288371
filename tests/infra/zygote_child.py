"""A child for tests/infra/test_zygote.py, run as ``python -m tests.infra.zygote_child ACTION``:
prints what it is (one JSON line), then the readiness line, then does ACTION (``exit N``,
``sleep``, or ``finish``: a non-daemon thread and an atexit handler print on the way out)."""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time

TORCH_AT_START = "torch" in sys.modules  # a fresh interpreter has not imported it yet


def main() -> None:
    with open("/proc/self/cmdline", "rb") as f:
        cmdline = f.read().rstrip(b"\0").replace(b"\0", b" ").decode()
    facts = {
        "torch_at_start": TORCH_AT_START,
        "name": __name__,
        "mark": os.environ.get("ZYGOTE_TEST_MARK"),
        "cwd": os.getcwd(),
        "argv": sys.argv[1:],
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "pgid": os.getpgid(0),
        "sid": os.getsid(0),
        "stdin": os.readlink("/proc/self/fd/0"),
        "cmdline": cmdline,
    }
    print(json.dumps(facts), flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    print("STRATA_READY", flush=True)
    action = sys.argv[1:]
    if action[:1] == ["exit"]:
        sys.exit(int(action[1]))
    if action == ["sleep"]:
        time.sleep(120)
    if action == ["finish"]:
        atexit.register(lambda: print("atexit ran", flush=True))

        def late() -> None:
            time.sleep(0.3)
            print("thread finished", flush=True)

        threading.Thread(target=late).start()


if __name__ == "__main__":
    main()
