"""One benchmark client of the webhook: a kept-alive HTTPS connection sending one pod's
AdmissionReview back to back, as the API server does under load.

Usage: admission_client.py PORT CAFILE SECONDS BODYFILE. Waits for a line on stdin, runs
for SECONDS, then prints the round trips in microseconds as one JSON list.
"""

import http.client
import json
import ssl
import sys
import time

port, cafile, seconds, body_file = int(sys.argv[1]), sys.argv[2], float(sys.argv[3]), sys.argv[4]
body = open(body_file, "rb").read()  # noqa: SIM115 - read once, at start
conn = http.client.HTTPSConnection(
    "127.0.0.1", port, context=ssl.create_default_context(cafile=cafile)
)
headers = {"Content-Type": "application/json"}
conn.request("POST", "/mutate", body=body, headers=headers)  # handshake before the clock
assert conn.getresponse().read()
print("ready", flush=True)
sys.stdin.readline()
times = []
end = time.monotonic() + seconds
while time.monotonic() < end:
    t0 = time.perf_counter_ns()
    conn.request("POST", "/mutate", body=body, headers=headers)
    reply = conn.getresponse().read()
    times.append((time.perf_counter_ns() - t0) // 1000)
    assert b'"allowed":true' in reply
print(json.dumps(times), flush=True)
