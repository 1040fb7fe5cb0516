"""One benchmark "pod": PID 1 of its own PID namespace, with one GPU process (a `sleep`),
asking the agent for usage at a fixed rate and recording each round trip (or, with
--subscribe, receiving each sample as it is pushed and recording its age on arrival).

Prints `ready <pid of the sleep, as the pod sees it>`, waits for a line on stdin, runs for
`--seconds`, then prints the times in microseconds as one JSON list.
"""

import argparse
import json
import socket
import subprocess
import sys
import time

p = argparse.ArgumentParser()
p.add_argument("--socket", required=True)
p.add_argument("--rate", type=float, default=10.0)
p.add_argument("--seconds", type=float, default=30.0)
p.add_argument("--subscribe", action="store_true", help="receive pushes instead of asking")
args = p.parse_args()

gpu_process = subprocess.Popen(["sleep", "3600"])
print(f"ready {gpu_process.pid}", flush=True)
sys.stdin.readline()
conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
conn.connect(args.socket)
replies = conn.makefile("rb")
times = []
if args.subscribe:
    # Pushed replies: record how old each one is on arrival (sampled_at to now).
    conn.sendall(b'{"v":1,"op":"subscribe"}\n')
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        reply = replies.readline()
        age = time.time() - json.loads(reply)["sampled_at"]
        times.append(int(age * 1_000_000))
    print(json.dumps(times), flush=True)
    gpu_process.kill()
    sys.exit(0)
request = b'{"v":1,"op":"usage"}\n'
period = 1.0 / args.rate
next_at = time.monotonic()
end = next_at + args.seconds
while next_at < end:
    time.sleep(max(0.0, next_at - time.monotonic()))
    started = time.perf_counter_ns()
    conn.sendall(request)
    reply = replies.readline()
    times.append((time.perf_counter_ns() - started) // 1000)
    assert b'"processes":[{' in reply, reply[:200]  # it sees its own GPU process
    next_at += period
print(json.dumps(times), flush=True)
gpu_process.kill()
