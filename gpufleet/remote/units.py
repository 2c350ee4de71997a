"""Stopping the systemd units the plan names, before their processes are signalled.

A piece of the remote agent. A unit that restarts its service would bring the GPU's holder
back right after the signal, so the controller names the units to stop (and to disable); the
names are data passed as argv to systemctl, and still anything that is not a unit name is
refused here.
"""
import re

from .jobs import run_cmd, smi_failure, which  # joined
from .owners import SYSTEMCTL_FALLBACKS  # joined


UNIT_RE = re.compile(
    r"^[A-Za-z0-9_][A-Za-z0-9:_.@\\-]*\."
    r"(?:service|scope|socket|target|timer|slice|mount|path|swap|automount|device)$"
)


def valid_unit(name):
    """Unit names are data passed as argv; still, refuse anything that is not a unit name."""
    return isinstance(name, str) and len(name) <= 255 and bool(UNIT_RE.match(name))


def stop_units(units, req, deadline, reserve, res):
    """``systemctl stop`` (and ``disable`` when asked) each unit of the request, in order; one
    entry per unit in res["units_stopped"], its failure a value. ``reserve``: time kept back
    from the deadline for the rest of the clean."""
    systemctl = req.get("systemctl") or which("systemctl", SYSTEMCTL_FALLBACKS)
    for u in units:
        name = u.get("unit") if isinstance(u, dict) else None
        entry = {"unit": name, "ok": False, "error": None}
        res["units_stopped"].append(entry)
        if not valid_unit(name):
            entry["error"] = "invalid unit name"
            continue
        if systemctl is None:
            entry["error"] = "systemctl not found"
            continue
        steps = ["stop"] + (["disable"] if u.get("disable") else [])
        for verb in steps:
            r = run_cmd([systemctl, "--no-ask-password", verb, name],
                        max(0.0, deadline.remaining() - reserve), deadline, "systemctl " + verb)
            fail = smi_failure(r)
            if fail is not None:
                entry["error"] = "systemctl %s: %s" % (verb, fail[0])
                break
        else:
            entry["ok"] = True
