"""A pod's GPU program that asks the agent about itself, run inside a fresh PID namespace.

Usage: pod_alloc.py SOCKET MIB. Allocates MIB of GPU memory with PyTorch, then asks the
agent's socket until it lists a process holding at least that much (the agent's sample
may predate the allocation by one interval), prints our own pid (as this namespace
numbers it) and the reply as JSON lines, and holds the memory until stdin closes.
"""

import json
import os
import socket
import sys
import time

import torch

path, mib = sys.argv[1], int(sys.argv[2])
block = torch.empty(mib * 1024 * 1024, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
conn.connect(path)
replies = conn.makefile("rb")
deadline = time.monotonic() + 30
while True:
    conn.sendall(b'{"v":1,"op":"usage"}\n')
    reply = json.loads(replies.readline())
    held = sum(p["used_bytes"] or 0 for p in reply.get("processes", ()))
    if held >= mib * 1024 * 1024 or time.monotonic() > deadline:
        break
    time.sleep(0.1)
print(json.dumps({"pid": os.getpid(), "reply": reply}), flush=True)
sys.stdin.read()
del block
