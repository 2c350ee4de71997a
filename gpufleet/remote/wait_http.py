"""The `wait_http` runbook step's probe: runs ON the host (Python 3.6+, standard library only).

Sent as the program of ``PYTHON -S -E -s -c`` (gpufleet.runbook.steps reads this file at send time);
it polls a URL until it answers the wanted status, or until ``wait_s`` is spent, and prints
one JSON line: ``{"ok": bool, "attempts": n, "last": "HTTP 503" | "URLError: ..." | null}``.
Everything variable arrives as JSON on stdin (url, status, interval, attempt_s, wait_s):
nothing becomes shell text. Proxies are ignored (the URL is the host's own).
"""
import json
import sys
import time
import urllib.error
import urllib.request


def main():
    r = json.loads(sys.stdin.read())
    end = time.monotonic() + r["wait_s"]
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    n, last = 0, None
    while True:
        n += 1
        code = None
        try:
            left = max(0.2, min(r["attempt_s"], end - time.monotonic()))
            with opener.open(r["url"], timeout=left) as resp:
                code = resp.getcode()
        except urllib.error.HTTPError as e:
            code = e.code
        except Exception as e:
            last = (type(e).__name__ + ": " + str(e))[:200]
        if code is not None:
            last = "HTTP %d" % code
        if code == r["status"]:
            print(json.dumps({"ok": True, "attempts": n, "last": last}))
            break
        if time.monotonic() + r["interval"] >= end:
            print(json.dumps({"ok": False, "attempts": n, "last": last}))
            break
        time.sleep(r["interval"])


if __name__ == "__main__":
    main()
