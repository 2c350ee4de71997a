"""``connection: exec``: the host's shell is reached through a local command, an argv prefix
from the inventory (``exec: [docker, exec, -i, CTR]``, ``[kubectl, exec, -i, -n, NS, POD,
--]``, ``[nsenter, -t, PID, -m, -p, -u]``). The agent's constant command is appended to it as
words (no shell on this side) and its data goes on stdin, as over SSH.

One way of reaching a host (gpufleet.transport.reach's table). Why ``timeout`` on the host as
over SSH: ending the local client (``docker exec``, ``kubectl exec``) does not end the process
it started in the container, so the argv bounds itself there.
"""
from __future__ import annotations

from typing import Sequence

from gpufleet.transport.local import LocalSession
from gpufleet.transport.reply import remote_timeout


class ExecSession(LocalSession):
    """A local session whose argv is prefixed by the host's ``exec``."""

    def _argv(self, argv: Sequence[str]) -> list[str]:
        return [str(a) for a in getattr(self.host, "exec", None) or ()] + list(argv)

    def _wrap_timeout(self, argv: list[str], timeout: float) -> list[str]:
        return remote_timeout(argv, timeout)
