"""The clean's optional GPU reset (``nvidia-smi --gpu-reset``): a piece of the remote agent.

A reset with a process still holding the GPU fails or takes that process down, and one from
inside a container or WSL2 is not the agent's to do; so a GPU is reset only by root, on the
host itself, with no process left holding its device file. The controller shows the same
rule in its plan (gpufleet/core/policy.py).
"""
from .jobs import run_cmd, smi_failure  # joined
from .parse import first_line  # joined


def reset_refusal(is_root, in_container, wsl2, holder_pids):
    """Why `nvidia-smi --gpu-reset` must not run on a GPU, or None when it may."""
    if not is_root:
        return "not root"
    if wsl2:
        return "WSL2: GPU reset is done by the Windows host"
    if in_container:
        return "in a container: reset the GPU from the host"
    if holder_pids:
        return "held by PID %s" % ", ".join(str(p) for p in sorted(holder_pids))
    return None


def reset_gpus(req, scope, snap, deadline, res):
    """``nvidia-smi --gpu-reset -i N`` for each GPU in scope that reset_refusal allows, judged
    on ``snap`` (a snapshot taken after the memory wait); one entry per GPU in res["reset"].
    Whether any reset was attempted (then the clean takes a new snapshot after)."""
    facts = snap.get("facts") or {}
    smi = facts.get("nvidia_smi")
    by_index = dict((g["index"], g) for g in snap.get("gpus") or ())
    attempted = False
    for index in scope:
        entry = {"index": index, "ok": False, "message": None}
        res["reset"].append(entry)
        gpu = by_index.get(index)
        if gpu is None:
            entry["message"] = "no GPU with index %s" % index
            continue
        minor = gpu.get("minor") if gpu.get("minor") is not None else index
        dev = "/dev/nvidia%d" % minor
        holders = [h["pid"] for h in snap.get("holders") or () if dev in h["devices"]]
        why = reset_refusal(bool(facts.get("is_root")), bool(facts.get("in_container")),
                            bool(facts.get("wsl2")), holders)
        if why is None and smi is None:
            why = "nvidia-smi not found"
        if why is not None:
            entry["message"] = "not reset: " + why
            continue
        attempted = True
        r = run_cmd([smi, "--gpu-reset", "-i", str(index)], max(req["smi_timeout_s"], 30.0),
                    deadline, "nvidia-smi --gpu-reset")
        fail = smi_failure(r)
        entry["ok"] = fail is None
        entry["message"] = fail[0] if fail else first_line(r.out, r.err)
    return attempted
