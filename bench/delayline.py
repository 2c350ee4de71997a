"""A userspace "wire" with a fixed one-way delay between the controller and a network namespace.

Why not `tc netem`: this machine's kernel has no sch_netem (CONFIG_NET_SCH_NETEM unset: `tc
qdisc add ... netem` says "Specified qdisc kind is unknown"), and no `fq` for BPF timestamps.
So the link is two TUN devices, one in the controller's namespace (``near``, 10.250.0.1) and
one moved into the hosts' namespace (``far``, 10.250.0.2); this process copies every IPv4
packet from one to the other after ``delay`` ms (RTT = 2 x delay), in order, like netem's
plain ``delay``. Packets to the "blackhole" prefix are dropped (a host that never answers).

Run as its own process (its CPU is not the controller's): ``python3 delayline.py NEAR FAR NETNS
DELAY_MS BLACKHOLE_CIDR``; it prints "ready" once both ends are up; each later stdin line is
a new one-way delay in ms; EOF ends it (the TUN devices go with it).
"""
from __future__ import annotations

import fcntl
import heapq
import ipaddress
import os
import select
import struct
import subprocess
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000


def open_tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def main() -> int:
    near, far, netns, delay_ms, blackhole = sys.argv[1:6]
    delay = float(delay_ms) / 1000.0
    hole = ipaddress.ip_network(blackhole)
    hole_net = int(hole.network_address)
    hole_mask = int(hole.netmask)
    fd_near = open_tun(near)
    fd_far = open_tun(far)
    ip("link", "set", far, "netns", netns)
    for dev, ns in ((near, None), (far, netns)):
        pre = ["-n", ns] if ns else []
        # no IPv6 on the link (best effort; written directly: the GPU machine has no sysctl)
        knob = "/proc/sys/net/ipv6/conf/%s/disable_ipv6" % dev
        subprocess.run(["tee", knob] if not ns else ["ip", "netns", "exec", ns, "tee", knob],
                       input=b"1\n", capture_output=True)
        ip(*pre, "addr", "add", "10.250.0.%d/24" % (1 if ns is None else 2), "dev", dev)
        ip(*pre, "link", "set", dev, "up")
    ip("-n", netns, "link", "set", "lo", "up")
    ip("route", "add", blackhole, "dev", near)
    print("ready", flush=True)

    queue: list = []  # (due, seq, out_fd, packet)
    seq = 0
    stdin = sys.stdin.fileno()
    other = {fd_near: fd_far, fd_far: fd_near}
    watch = [fd_near, fd_far, stdin]
    dropped = 0
    while True:
        now = time.monotonic()
        while queue and queue[0][0] <= now:
            _, _, out, pkt = heapq.heappop(queue)
            try:
                os.write(out, pkt)
            except OSError:
                pass
        wait = max(0.0, queue[0][0] - now) if queue else None
        ready, _, _ = select.select(watch, [], [], wait)
        now = time.monotonic()
        for fd in ready:
            if fd == stdin:
                line = sys.stdin.readline()
                if not line:
                    return 0
                if line.strip():
                    delay = float(line) / 1000.0
                continue
            while True:
                try:
                    pkt = os.read(fd, 65536)
                except BlockingIOError:
                    break
                if len(pkt) < 20 or pkt[0] >> 4 != 4:
                    continue
                if fd == fd_near and (struct.unpack("!I", pkt[16:20])[0] & hole_mask) == hole_net:
                    dropped += 1
                    continue
                seq += 1
                heapq.heappush(queue, (now + delay, seq, other[fd], pkt))


if __name__ == "__main__":
    sys.exit(main())
