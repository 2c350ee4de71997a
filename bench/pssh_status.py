"""The parallel-ssh contender: remote_work.SCRIPT on every host, outputs parsed; one JSON line.

Usage: pssh_status.py HOSTS_JSON FORKS CONNECT_TIMEOUT. Uses pssh.clients.ParallelSSHClient
(the native ssh2-python client, gevent). Note: it does not check host keys (parallel-ssh has
no known_hosts check); gpufleet and the other contenders do.
"""
import json
import sys
import time

from pssh.clients import ParallelSSHClient
from pssh.config import HostConfig

from remote_work import SCRIPT, parse


def main() -> int:
    doc = json.load(open(sys.argv[1]))
    forks, timeout = int(sys.argv[2]), float(sys.argv[3])
    hosts = [h["address"] for h in doc["hosts"]]
    config = [HostConfig(port=h["port"], user="root", private_key=doc["key"], alias=h["name"],
                         num_retries=1, timeout=timeout, allow_agent=False, identity_auth=False)
              for h in doc["hosts"]]
    t0 = time.monotonic()
    client = ParallelSSHClient(hosts, host_config=config, pool_size=forks, num_retries=1,
                               timeout=timeout, allow_agent=False, identity_auth=False)
    output = client.run_command(SCRIPT, stop_on_errors=False)
    client.join(output)
    results = []
    for out in output:
        name = out.alias or out.host
        if out.exception is not None:
            results.append({"host": name, "ok": False, "error": repr(out.exception)[:200]})
            continue
        text = "\n".join(out.stdout or ())
        try:
            data = parse(text)
            results.append({"host": name, "ok": out.exit_code == 0, "gpus": len(data["gpus"]),
                            "holders": len(data["holders"])})
        except (ValueError, IndexError, KeyError) as exc:
            results.append({"host": name, "ok": False, "error": "parse: %s" % exc})
    ok = sum(1 for r in results if r["ok"])
    print(json.dumps({"ok": ok, "hosts": len(results), "seconds": round(time.monotonic() - t0, 3),
                      "failed": [r for r in results if not r["ok"]][:5]}))
    return 0 if ok == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
