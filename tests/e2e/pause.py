"""PID 1 of a simulated pod, standing in for the pause container: it reaps orphans."""

import os
import signal
import sys

signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
print("ready", flush=True)
while True:
    try:
        os.wait()
    except ChildProcessError:
        signal.pause()
