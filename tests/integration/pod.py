"""A stand-in for a pod, run as PID 1 of a fresh PID namespace by the agent tests.

It starts `--workers` idle processes (and, with --nested, one in a nested PID namespace),
then, for each line on stdin, asks the agent's socket for usage and prints the reply: the
caller the agent attests is this process, in this namespace. `hold N` opens N more
connections, subscribed, keeps them, and prints their first replies as a JSON list.
"""

import argparse
import contextlib
import json
import socket
import subprocess
import sys

p = argparse.ArgumentParser()
p.add_argument("--socket", required=True)
p.add_argument("--workers", type=int, default=2)
p.add_argument("--nested", action="store_true")
args = p.parse_args()

children = [subprocess.Popen(["sleep", "600"]) for _ in range(args.workers)]
if args.nested:
    children.append(
        subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "sleep", "600"])
    )
print("ready", flush=True)
conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
conn.connect(args.socket)
replies = conn.makefile("rb")
held = []
for line in sys.stdin:
    if line.startswith("hold "):  # open this many more connections, subscribed, and keep them
        answers = []
        for _ in range(int(line.split()[1])):
            extra = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            extra.settimeout(10)
            extra.connect(args.socket)
            # refused, the agent may have written its reason and closed before the request came
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                extra.sendall(b'{"v":1,"op":"subscribe"}\n')
            answers.append(json.loads(extra.makefile("rb").readline()))
            held.append(extra)
        print(json.dumps(answers), flush=True)
        continue
    conn.sendall(line.encode())
    sys.stdout.write(replies.readline().decode())
    sys.stdout.flush()
