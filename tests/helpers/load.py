"""A client that holds many idle and slow connections to a metrics endpoint: the load of
tests/test_metrics_load.py and bench/bench_metrics.py.

``python -c CLIENT PORT IDLE SLOW HOLD_S``: opens IDLE connections that say nothing and
SLOW that are slow (half send a request a byte at a time, half send one and never read
the answer), prints ``ready``, and holds them HOLD_S seconds or until its stdin closes.
A connection the server closes (its limits, its timeouts) is opened again, idle or slow
as before, so that the load lasts as long as the client.
"""

from __future__ import annotations

#: idle and slow connections (the test's and the benchmark's)
IDLE = 2000
SLOW = 200

CLIENT = r"""
import resource, selectors, socket, sys, threading, time
port, idle, slow, hold = (int(a) for a in sys.argv[1:5])
resource.setrlimit(resource.RLIMIT_NOFILE, (idle + slow + 256, idle + slow + 256))
def connect(timeout=5):
    s = socket.socket()
    s.settimeout(timeout)
    try:
        s.connect(("127.0.0.1", port))
    except OSError:
        s.close()
        raise
    return s
sel = selectors.DefaultSelector()
for _ in range(idle):                                  # connect, then say nothing
    sel.register(connect(), selectors.EVENT_READ)
reopen = 0                                             # idle ones closed by the server
senders = [connect() for _ in range(slow // 2)]        # a request, one byte at a time
readers = []                                           # a whole request, never read
for _ in range(slow - slow // 2):
    s = connect()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    readers.append(s)
print("ready", flush=True)
request = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"y" * 4000
pos = {id(s): 0 for s in senders}
end = time.monotonic() + hold
while time.monotonic() < end and not sys.stdin.closed:
    for key, _ in sel.select(timeout=0):               # readable: closed by the server
        sel.unregister(key.fileobj)
        key.fileobj.close()
        reopen += 1
    while reopen:                                      # opened again, at once
        try:
            sel.register(connect(0.2), selectors.EVENT_READ)
            reopen -= 1
        except OSError:                                # the backlog is full: the next round
            break
    for i, s in enumerate(senders):
        try:
            s.send(request[pos[id(s)]:pos[id(s)] + 1])
            pos[id(s)] += 1
        except OSError:  # closed by the server (its timeout): the next slow one
            s.close()
            try:
                senders[i] = connect()
                pos[id(senders[i])] = 0
            except OSError:
                pass
    time.sleep(0.5)
"""
