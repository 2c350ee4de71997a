"""Who runs a process, as its runtime says: systemd's units, a container's restart policy.

A piece of the remote agent. A cgroup path names units and containers, but a user can make
cgroups (under its own ``user@UID.service``) and name them anything: what the path says is a
claim, confirmed by the system itself (systemd's ControlGroup for a unit; the container
runtime's own record for a container's restart policy), never taken from the name alone.
"""
from .jobs import run_cmd, which  # joined
from .parse import cgroup_units, parse_systemctl_show  # joined

SYSTEMCTL_FALLBACKS = ("/usr/bin/systemctl", "/bin/systemctl")
SYSTEMCTL_TIMEOUT_S = 3.0


def confirm_units(processes, req, deadline, warnings):
    """Each process's unit as systemd itself says: the innermost unit its cgroup path claims
    (cgroup_units) whose ControlGroup, asked of systemd, is exactly that part of the path.
    A user can create a cgroup named ``cron.service`` under its own ``user@UID.service``; the
    system's cron.service has another ControlGroup, so the claim is not confirmed. Under a
    confirmed ``user@UID.service`` the first unit below is that user's own (user_unit)."""
    names = sorted(set(n for e in processes.values() for n, _ in e.get("unit_claims") or ()))
    if not names:
        return
    systemctl = req.get("systemctl") or which("systemctl", SYSTEMCTL_FALLBACKS)
    groups, why = {}, None
    if systemctl is None:
        why = "systemctl not found"
    else:
        res = run_cmd([systemctl, "show", "--property=Id", "--property=ControlGroup", "--"]
                      + names, min(SYSTEMCTL_TIMEOUT_S, deadline.remaining()), deadline,
                      "systemctl show")
        if res.error or res.rc != 0:
            why = res.error or (res.err or "").strip()[:200] or "exit %s" % res.rc
        else:
            groups = parse_systemctl_show(res.out)
    unconfirmed = []
    for entry in processes.values():
        claims = entry.pop("unit_claims", None) or []
        ok = [(n, cg) for n, cg in claims if groups.get(n) == cg]
        if ok:
            entry["unit"] = ok[-1][0]
            user = cgroup_units(entry.get("cgroup"))[1]
            if user is not None and entry["unit"] == "user@%d.service" % user[1]:
                entry["user_unit"], entry["user_unit_uid"] = user
        elif claims:
            unconfirmed.append(entry["pid"])
    if why is not None and unconfirmed:
        warnings.append("systemd could not confirm the units of PID(s) %s (%s): they are "
                        "treated as no unit's" % (", ".join(str(p) for p in unconfirmed[:10]), why))


CONTAINER_CLIS = {"docker": ("/usr/bin/docker", "/usr/local/bin/docker"),
                  "podman": ("/usr/bin/podman", "/usr/local/bin/podman")}
#: A restart policy that starts the container again after its process is killed.
RESTARTING_POLICIES = ("always", "unless-stopped", "on-failure")
INSPECT_TIMEOUT_S = 2.0


def container_restarts(processes, req, deadline, warnings):
    """Each docker or podman container's restart policy and name, as the runtime's own CLI
    says (``inspect``): processes[...]["container_restart"] is "always", "unless-stopped",
    "on-failure", "no", or None (not asked, not answered); ["container_name"] its name."""
    asked = {}
    for entry in processes.values():
        name = entry.get("container") or ""
        kind, _, ident = name.partition(":")
        if kind not in CONTAINER_CLIS or not ident:
            continue
        if name not in asked:
            asked[name] = _inspect(kind, ident, req, deadline, warnings)
        entry["container_restart"], entry["container_name"] = asked[name]


def _inspect(kind, ident, req, deadline, warnings):
    """(restart policy or None, name or None) of one container, from its runtime's inspect."""
    cli = (req.get("container_cli") or {}).get(kind) or which(kind, CONTAINER_CLIS[kind])
    if cli is None or not all(c in "0123456789abcdef" for c in ident):
        return None, None
    res = run_cmd([cli, "inspect", "--format", "{{.HostConfig.RestartPolicy.Name}} {{.Name}}",
                   "--", ident], min(INSPECT_TIMEOUT_S, deadline.remaining()), deadline,
                  kind + " inspect")
    if res.error or res.rc != 0:
        warnings.append("%s inspect %s: %s" % (kind, ident, res.error or (res.err or "").strip()[:200]
                                               or "exit %s" % res.rc))
        return None, None
    words = (res.out or "").strip().split(" ", 1)
    policy = words[0] if words[0] in RESTARTING_POLICIES + ("no",) else None
    name = words[1].lstrip("/")[:128] if len(words) > 1 and words[1].strip("/") else None
    return policy, name
