"""gpufleet.core.policy: the never-signal list and every refusal reason, on processes taken from the
named scenario fixtures (tests/fixtures/scenarios/) and small variations of them."""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpufleet.core import evidence, policy
from gpufleet.core.model import ProcessInfo, Snapshot, parse_snapshot
from gpufleet.core.policy import PolicyContext, refusal_reason, signal_refusal

SCENARIOS = Path(__file__).resolve().parent.parent / "fixtures" / "scenarios"


def load(name: str) -> Snapshot:
    return parse_snapshot(json.loads((SCENARIOS / f"{name}.json").read_text()))


@pytest.fixture(scope="module")
def train() -> Snapshot:
    return load("train-node")


@pytest.fixture(scope="module")
def ctx(train: Snapshot) -> PolicyContext:
    return PolicyContext.from_snapshot(train)


def kind(proc: ProcessInfo, ctx: PolicyContext):
    found = signal_refusal(proc, ctx)
    return None if found is None else found[0]


def test_context_comes_from_the_agent_facts(train: Snapshot) -> None:
    ctx = PolicyContext.from_snapshot(train, protect=("*x*",), stop_units=True, is_sudo=True)
    assert ctx.agent_pid == 51212 and ctx.uid == 0 and ctx.is_root
    assert ctx.protect == ("*x*",) and ctx.stop_units and ctx.is_sudo
    assert ctx.own_container is None  # not in a container: no container is "ours"


def test_gpu_workers_are_allowed(train: Snapshot, ctx: PolicyContext) -> None:
    for pid in (4340, 4360, 4363, 4520):
        assert refusal_reason(train.processes[pid], ctx) is None, pid
        assert policy.may_signal(train.processes[pid], ctx)


def test_pid1_and_kernel_threads(train: Snapshot, ctx: PolicyContext) -> None:
    assert refusal_reason(train.processes[1], ctx) == "PID 1 (init)"
    assert refusal_reason(train.processes[2], ctx) == "kernel thread"
    kworker = ProcessInfo(pid=77, ppid=2, starttime=5, state="I", uid=0, user="root",
                          comm="kworker/3:1", cmdline="")
    assert refusal_reason(kworker, ctx) == "kernel thread"
    flagged = dataclasses.replace(train.processes[4360], kernel_thread=True)
    assert refusal_reason(flagged, ctx) == "kernel thread"


def test_agent_itself_ancestors_and_session(train: Snapshot, ctx: PolicyContext) -> None:
    assert refusal_reason(train.processes[51212], ctx) == "the gpufleet agent itself"
    for pid in (51190, 51205, 51206):
        assert "ancestor of the gpufleet agent" in refusal_reason(train.processes[pid], ctx)
    # the agent's PID alone protects it, even if the relation were lost
    bare = dataclasses.replace(train.processes[51212], relation=None, comm="python3",
                               cmdline="python3 -c pass")
    assert refusal_reason(bare, ctx) == "the gpufleet agent itself"
    job = load("agent-session").processes[2600]
    assert refusal_reason(job, ctx) == "in the gpufleet agent's own session"


@pytest.mark.parametrize(
    "comm,cmdline",
    [
        ("sshd", "sshd: /usr/sbin/sshd -D [listener] 0 of 10-100 startups"),
        ("sshd", "sshd: alice@pts/0"),
        ("sshd-session", "sshd-session: alice [priv]"),
        ("sshd-auth", "sshd-auth: alice [net]"),
        ("renamed", "/usr/sbin/sshd -D -e"),
        ("renamed", "sshd: bob@notty"),
    ],
)
def test_sshd_is_never_signalled(comm: str, cmdline: str, ctx: PolicyContext) -> None:
    proc = ProcessInfo(pid=900, ppid=1, starttime=10, state="S", uid=0, user="root",
                       comm=comm, cmdline=cmdline)
    assert refusal_reason(proc, ctx) == "sshd (never signalled)"
    assert kind(proc, ctx) == policy.PROTECTED


def test_ssh_client_is_not_sshd(ctx: PolicyContext) -> None:
    proc = ProcessInfo(pid=900, ppid=1, starttime=10, state="S", uid=0, user="root",
                       comm="ssh", cmdline="ssh -N -L 8000:localhost:8000 gpu-07")
    assert refusal_reason(proc, ctx) is None


@pytest.mark.parametrize(
    "comm,cmdline,daemon",
    [
        # comm is truncated to 15 bytes by the kernel
        ("nvidia-persiste", "/usr/bin/nvidia-persistenced --user nvidia-persistenced",
         "nvidia-persistenced"),
        ("nv-fabricmanage",
         "/usr/bin/nv-fabricmanager -c /usr/share/nvidia/nvswitch/fabricmanager.cfg",
         "nv-fabricmanager"),
        ("nv-hostengine", "/usr/bin/nv-hostengine -n", "nv-hostengine"),
        ("dcgm-exporter", "/usr/bin/dcgm-exporter -f /etc/dcgm-exporter/dcp-metrics-included.csv",
         "dcgm-exporter"),
        ("Xorg", "/usr/lib/xorg/Xorg vt2 -displayfd 3", "Xorg"),
        ("Xwayland", "/usr/bin/Xwayland :0 -rootless -noreset", "Xwayland"),
        # cmdline's argv0 alone is enough (comm rewritten, e.g. by prctl)
        ("worker", "/usr/bin/nvidia-persistenced --verbose", "nvidia-persistenced"),
        ("gnome-shell", "/usr/bin/gnome-shell", "gnome-shell"),
    ],
)
def test_driver_and_display_daemons(comm: str, cmdline: str, daemon: str,
                                    ctx: PolicyContext) -> None:
    proc = ProcessInfo(pid=1187, ppid=1, starttime=10, state="S", uid=0, user="root",
                       comm=comm, cmdline=cmdline)
    assert policy.protected_daemon(proc) == daemon
    reason = refusal_reason(proc, ctx)
    assert reason is not None and reason.startswith(daemon + " (") and "never signalled" in reason


def test_fixture_daemons_are_refused(train: Snapshot, ctx: PolicyContext) -> None:
    assert refusal_reason(train.processes[1187], ctx).startswith("nvidia-persistenced")
    assert refusal_reason(train.processes[1203], ctx).startswith("nv-hostengine")
    assert refusal_reason(train.processes[1290], ctx) == "sshd (never signalled)"


def test_similar_names_are_not_protected(ctx: PolicyContext) -> None:
    for comm, cmdline in [("nvidia-smi", "nvidia-smi -q"), ("python", "python xorg_tools.py"),
                          ("VLLM::Worker", "VLLM::Worker_TP0"), ("nvtop", "nvtop")]:
        proc = ProcessInfo(pid=700, ppid=1, starttime=10, state="S", uid=0, user="root",
                           comm=comm, cmdline=cmdline)
        assert refusal_reason(proc, ctx) is None, comm


def test_protect_globs_match_cmdline_or_comm(train: Snapshot) -> None:
    rank = train.processes[4520]
    worker = train.processes[4360]
    by_cmd = PolicyContext.from_snapshot(train, protect=("*configs/llama3-8b.yaml",))
    assert refusal_reason(rank, by_cmd) == "protected by '*configs/llama3-8b.yaml'"
    assert refusal_reason(worker, by_cmd) is None
    by_comm = PolicyContext.from_snapshot(train, protect=("nope", "VLLM::*"))
    assert refusal_reason(worker, by_comm) == "protected by 'VLLM::*'"
    assert kind(worker, by_comm) == policy.PROTECTED
    # fnmatch is case-sensitive here: a protect list is exact
    assert refusal_reason(worker, PolicyContext.from_snapshot(train, protect=("vllm::*",))) is None


def _proc(comm: str, cmdline: str) -> ProcessInfo:
    return ProcessInfo(pid=900, ppid=1, starttime=10, state="S", uid=0, user="root",
                       comm=comm, cmdline=cmdline)


@pytest.mark.parametrize("pattern, comm, cmdline, protected", [
    # a plain word is a substring of the command line or comm, as pgrep matches
    ("train_dflash", "python3", "python3 train_dflash.py --lr 3e-4", True),
    ("train_dflash", "train_dflash", "", True),
    ("dflash.py --lr", "python3", "python3 train_dflash.py --lr 3e-4", True),
    ("VLLM::Engine", "VLLM::EngineCor", "VLLM::EngineCore_DP0", True),
    ("train_dlfash", "python3", "python3 train_dflash.py --lr 3e-4", False),  # a typo
    ("Train_dflash", "python3", "python3 train_dflash.py", False),  # case-sensitive
    # a glob (* ? [) is fnmatch over the WHOLE command line or comm, as before
    ("*train*", "python3", "python3 train_dflash.py", True),
    ("prec*", "precompute", "precompute --shard 3", True),
    ("prec*", "python3", "python3 precompute.py", False),  # not a prefix of either
    ("python3 train_dflash.p?", "python3", "python3 train_dflash.py", True),
    ("[t]rain", "python3", "python3 train.py", False),
    ("[t]rain", "train", "train", True),
    ("", "python3", "python3 train.py", False),  # an empty pattern protects nothing
])
def test_protect_a_plain_word_by_substring_a_glob_by_the_whole_text(
        pattern: str, comm: str, cmdline: str, protected: bool) -> None:
    proc = _proc(comm, cmdline)
    ctx = PolicyContext(is_root=True, protect=("elsewhere_only", pattern))
    want = f"protected by {pattern!r}" if protected else None
    assert refusal_reason(proc, ctx) == want
    assert (policy.protect_matches(pattern, cmdline)
            or policy.protect_matches(pattern, comm)) is protected


def test_unmatched_protect_patterns_ignore_the_agents_own_processes() -> None:
    agent = dataclasses.replace(_proc("python3", "python3 -c import sys"), pid=50)
    parent = dataclasses.replace(_proc("sshd", "sshd: root@notty"), pid=49, relation="ancestor")
    trainer = dataclasses.replace(_proc("python3", "python3 train_dflash.py"), pid=60)
    procs = {p.pid: p for p in (agent, parent, trainer)}
    got = policy.unmatched_protect(procs, ("train_dflash", "train_dlfash", "import sys",
                                           "root@notty", "*train*", "*nothing*"), agent_pid=50)
    assert got == ("train_dlfash", "import sys", "root@notty", "*nothing*")


HELD_ELSEWHERE = ("holds nothing; any memory on its GPUs is held elsewhere (another process, "
                  "or the driver)")


def test_zombie_names_its_parent_and_says_it_holds_nothing() -> None:
    shared = load("shared-node")
    ctx = PolicyContext.from_snapshot(shared)
    assert signal_refusal(shared.processes[5310], ctx) == (
        policy.ZOMBIE, "zombie (exited, no thread left), parent PID 5300 (python): "
        + HELD_ELSEWHERE)
    orphan = dataclasses.replace(shared.processes[5310], ppid=424242)
    assert refusal_reason(orphan, ctx) == ("zombie (exited, no thread left), parent PID 424242 "
                                           "(?): " + HELD_ELSEWHERE)


def _leader(threads: int, live: int = 0, stuck: tuple[tuple[int, str], ...] = ()) -> ProcessInfo:
    """alice's eval.py (shared-node) as the agent reports it once its main thread is gone."""
    d = json.loads((SCENARIOS / "shared-node.json").read_text())
    d["processes"]["5400"].update(state="Z", threads=threads, live_threads=live or None,
                                  stuck_threads=[{"tid": t, "wchan": w} for t, w in stuck])
    return parse_snapshot(d).processes[5400]


def test_zombie_leader_whose_threads_run_is_not_a_zombie_and_may_be_signalled() -> None:
    """Recorded on the H200 (probe-1.log part D): `Zl`, 19 threads, NVML listing 5638 MiB;
    SIGKILL of the PID freed it in 0.13 s. It holds what its threads hold."""
    ctx = PolicyContext.from_snapshot(load("shared-node"))  # the agent runs as alice
    leader = _leader(threads=19, live=18)
    assert policy.leader_gone(leader) and not policy.is_zombie(leader)
    assert signal_refusal(leader, ctx) is None
    # the other rules still apply to it: bob's is bob's
    bobs = dataclasses.replace(leader, uid=1001, user="bob")
    assert signal_refusal(bobs, ctx)[0] == policy.OWNER
    # one thread (the leader itself) or a count an older agent did not give: a true zombie
    for threads in (1, None):
        zombie = dataclasses.replace(leader, threads=threads)
        assert policy.is_zombie(zombie) and not policy.leader_gone(zombie)
        assert signal_refusal(zombie, ctx)[0] == policy.ZOMBIE


def test_zombie_leader_whose_every_live_thread_is_in_d_state_is_stuck() -> None:
    ctx = PolicyContext.from_snapshot(load("shared-node"))
    stuck = _leader(threads=2, live=1, stuck=((5412, "uvm_va_space_destroy"),))
    assert signal_refusal(stuck, ctx) == (
        policy.STUCK, "stuck: main thread gone, thread 5412 in D state in "
        "uvm_va_space_destroy; signals cannot end it")
    many = _leader(threads=6, live=5, stuck=tuple((5410 + n, "os_acquire_mutex")
                                                  for n in range(5)))
    assert signal_refusal(many, ctx) == (
        policy.STUCK, "stuck: main thread gone, threads 5410, 5411, 5412 and 2 more in D "
        "state in os_acquire_mutex; signals cannot end it")
    # a thread still runs: SIGKILL ends it, the rest is reported after the clean
    partly = _leader(threads=4, live=3, stuck=((5412, "uvm_va_space_destroy"),))
    assert policy.stuck_reason(partly) is None and signal_refusal(partly, ctx) is None
    # without live_threads (not given), the kernel's count less the leader decides
    counted = dataclasses.replace(stuck, live_threads=None)
    assert signal_refusal(counted, ctx)[0] == policy.STUCK


def test_other_users_need_root_or_sudo() -> None:
    shared = load("shared-node")  # the agent runs as alice, uid 1000, not root
    bob = shared.processes[6100]
    ctx = PolicyContext.from_snapshot(shared)
    assert signal_refusal(bob, ctx) == (policy.OWNER, "owned by bob; connect as root or with sudo")
    assert refusal_reason(shared.processes[5400], ctx) is None  # alice's own
    assert refusal_reason(bob, PolicyContext.from_snapshot(shared, is_sudo=True)) is None
    unknown = dataclasses.replace(shared.processes[5400], uid=None)
    assert signal_refusal(unknown, ctx)[0] == policy.OWNER
    nameless = dataclasses.replace(bob, user=None)
    assert refusal_reason(nameless, ctx) == "owned by uid 1001; connect as root or with sudo"


def test_containers_other_than_our_own() -> None:
    hidden = load("hidden-pids")  # the agent runs inside docker-7f3e2a91d0b4
    ctx = PolicyContext.from_snapshot(hidden)
    assert ctx.own_container == "docker-7f3e2a91d0b4"
    assert refusal_reason(hidden.processes[88], ctx) is None
    train = load("train-node")
    boxed = dataclasses.replace(train.processes[4520], container="docker-91ac0e55d2f1")
    assert signal_refusal(boxed, PolicyContext.from_snapshot(train)) == (
        policy.CONTAINER, "runs in container docker-91ac0e55d2f1; stop the container")
    # a container is never stopped for you, --stop-units or not
    assert signal_refusal(boxed, PolicyContext.from_snapshot(train, stop_units=True))[0] == \
        policy.CONTAINER


def test_systemd_services_need_stop_units() -> None:
    unit = load("unit-vllm")
    worker = unit.processes[2260]
    assert signal_refusal(worker, PolicyContext.from_snapshot(unit)) == (
        policy.UNIT, "belongs to vllm-minimax.service; stop the unit or pass --stop-units")
    assert refusal_reason(worker, PolicyContext.from_snapshot(unit, stop_units=True)) is None


@pytest.mark.parametrize(
    "unit,service",
    [("vllm-minimax.service", "vllm-minimax.service"), ("session-4.scope", None),
     ("init.scope", None), ("user@1000.service", None), ("user-runtime-dir@1000.service", None),
     ("run-u812.scope", None), ("vte-spawn-7c4e.scope", None), (None, None),
     ("ollama.service", "ollama.service")],
)
def test_service_unit(unit, service) -> None:
    proc = ProcessInfo(pid=10, ppid=1, starttime=1, state="S", uid=0, user="root", comm="x",
                       cmdline="x", unit=unit)
    assert policy.service_unit(proc) == service


def test_unknown_start_time_cannot_be_signalled(train: Snapshot, ctx: PolicyContext) -> None:
    proc = dataclasses.replace(train.processes[4360], starttime=None)
    assert signal_refusal(proc, ctx)[0] == policy.IDENTITY


def test_most_final_reason_wins(train: Snapshot, ctx: PolicyContext) -> None:
    # an sshd zombie of another user in a unit: the never-signal list speaks first
    proc = ProcessInfo(pid=3901, ppid=3870, starttime=1, state="Z", uid=1001, user="bob",
                       comm="sshd", cmdline="", unit="ssh.service")
    nonroot = dataclasses.replace(ctx, is_root=False, uid=1000)
    assert signal_refusal(proc, nonroot)[0] == policy.PROTECTED
    zombie = dataclasses.replace(proc, comm="python")
    assert signal_refusal(zombie, nonroot)[0] == policy.ZOMBIE
    alive = dataclasses.replace(zombie, state="S")
    assert signal_refusal(alive, nonroot)[0] == policy.OWNER
    assert signal_refusal(alive, ctx)[0] == policy.UNIT


_procs = st.builds(
    ProcessInfo,
    pid=st.integers(0, 70000),
    ppid=st.one_of(st.none(), st.integers(0, 70000)),
    starttime=st.one_of(st.none(), st.integers(1, 10**9)),
    state=st.sampled_from(["S", "R", "D", "Z", "T", "I", None]),
    uid=st.one_of(st.none(), st.integers(0, 2000)),
    user=st.one_of(st.none(), st.sampled_from(["root", "alice", "bob"])),
    comm=st.sampled_from(["python", "sshd", "Xorg", "VLLM::Worker", "nvidia-persiste", "bash"]),
    cmdline=st.sampled_from(["", "python train.py", "sshd: alice@notty", "/usr/bin/nv-hostengine",
                             "VLLM::Worker_TP0", "-bash"]),
    unit=st.sampled_from([None, "session-3.scope", "vllm.service", "user@1000.service"]),
    container=st.sampled_from([None, "docker-1", "docker-2"]),
    kernel_thread=st.booleans(),
    relation=st.sampled_from([None, "self", "ancestor", "session"]),
)
_contexts = st.builds(
    PolicyContext,
    agent_pid=st.one_of(st.none(), st.integers(0, 70000)),
    uid=st.one_of(st.none(), st.integers(0, 2000)),
    is_root=st.booleans(),
    is_sudo=st.booleans(),
    protect=st.sampled_from([(), ("*train*",), ("VLLM::*",), ("train",)]),
    stop_units=st.booleans(),
    own_container=st.sampled_from([None, "docker-1"]),
)


@settings(max_examples=400, deadline=None)
@given(_procs, _contexts)
def test_never_signal_list_holds_under_every_option(proc: ProcessInfo,
                                                    ctx: PolicyContext) -> None:
    absolute = (
        proc.pid <= 1 or proc.kernel_thread or proc.ppid == 2 or proc.pid == 2
        or proc.relation is not None or proc.pid == ctx.agent_pid
        or proc.comm in ("sshd", "Xorg", "nvidia-persiste")
        or proc.cmdline.startswith("sshd") or proc.cmdline == "/usr/bin/nv-hostengine"
        or any((policy.fnmatch.fnmatchcase(s, g) if "*" in g else g in s)
               for g in ctx.protect for s in (proc.cmdline, proc.comm))
    )
    got = signal_refusal(proc, ctx)
    if absolute:
        assert got is not None and got[0] == policy.PROTECTED
    if got is None:
        # allowed: alive, known identity, ours (or root), not someone else's container/service
        assert proc.state not in ("Z",) and proc.starttime is not None
        assert ctx.is_root or ctx.is_sudo or (proc.uid is not None and proc.uid == ctx.uid)
        assert proc.container in (None, ctx.own_container)
        assert ctx.stop_units or policy.service_unit(proc) is None


def test_policy_is_the_only_place_with_the_never_signal_list() -> None:
    """plan/verdict may not carry their own name lists: names protect only through policy."""
    pkg = Path(policy.__file__).resolve().parent
    names = ["sshd", "persistenced", "hostengine", "fabricmanager", "dcgm", "Xorg", "Xwayland",
             "gnome-shell", "VLLM", "vllm", "python", "torchrun"]
    for path in [pkg / "verdict.py", *sorted((pkg / "plan").glob("*.py"))]:
        mod = path.name
        code = "\n".join(
            line for line in path.read_text().splitlines()
            if not line.lstrip().startswith("#")
        )
        code = re.sub(r'"""[\s\S]*?"""', "", code)  # docstrings may explain, not decide
        for name in names:
            assert name not in code, f"{mod} mentions {name!r}"


# ------------------------- GPU clients: no memory, never signalled (holder_role, one rule)

STATUS = SCENARIOS.parent / "status"
ALL_DEVS = ["/dev/nvidia-uvm", "/dev/nvidia0", "/dev/nvidiactl"]
CUDA_MAPS = ["/dev/nvidia-uvm", "/dev/nvidia0", "/dev/nvidiactl"]  # recorded, torch on GPU 0


def _doc(name: str, folder: Path = SCENARIOS) -> dict:
    return json.loads((folder / f"{name}.json").read_text())


def _with_holder(doc: dict, pid: int, devices, mapped, comm="python3",
                 cmdline="python3 poll.py", ppid=1) -> dict:
    """Add one process holding ``devices`` (mapped: list, or None = not available)."""
    entry = {"pid": pid, "devices": devices}
    if mapped is not None:
        entry["mapped"] = mapped
    doc["holders"].append(entry)
    doc["processes"][str(pid)] = {
        "pid": pid, "ppid": ppid, "starttime": 777, "state": "S", "uid": 0, "user": "root",
        "comm": comm, "cmdline": cmdline, "cgroup": None, "unit": None, "container": None,
        "session": pid, "pgid": pid, "kernel_thread": False, "wchan": None, "relation": None}
    return doc


def _role(doc: dict, pid: int, threshold: int = 64) -> policy.HolderRole:
    return policy.holder_role(parse_snapshot(doc), pid, threshold)


def test_one_gpu_host_nvml_client_by_maps_and_by_memory() -> None:
    """Real H200 shapes: the pynvml poller has every device file open and maps none."""
    doc = _with_holder(_doc("basic", STATUS), 600, ALL_DEVS, [])
    role = _role(doc, 600)
    assert role.role == policy.ROLE_CLIENT and "NVML client" in role.reason
    # a running nvidia-smi maps only nvidiactl: a client too
    assert _role(_with_holder(_doc("basic", STATUS), 600, ALL_DEVS, ["/dev/nvidiactl"]),
                 600).role == policy.ROLE_CLIENT
    # maps not available (older agent): nvidia-smi lists everyone and nothing is unexplained
    assert _role(_with_holder(_doc("basic", STATUS), 600, ALL_DEVS, None), 600).role == \
        policy.ROLE_CLIENT


def test_one_gpu_host_cuda_maps_with_unexplained_memory_is_a_holder() -> None:
    doc = _with_holder(_doc("basic", STATUS), 600, ALL_DEVS, CUDA_MAPS)
    assert _role(doc, 600).role == policy.ROLE_CLIENT  # a context, but no memory anywhere
    doc["gpus"][0]["memory_used_mib"] += 4000
    role = _role(doc, 600)
    assert role.role == policy.ROLE_HOLDER and "GPU 0: 4015 MiB" in role.reason
    assert _role(doc, 600, threshold=5000).role == policy.ROLE_CLIENT  # expected memory
    # maps not available on a host that lists every process: no evidence it is the holder
    doc["holders"][-1].pop("mapped")
    assert _role(doc, 600).role == policy.ROLE_CLIENT


def test_container_host_unexplained_memory_makes_device_holders_holders() -> None:
    doc = _with_holder(_doc("hidden-pids"), 700, ["/dev/nvidia4", "/dev/nvidia5",
                                                   "/dev/nvidiactl"], [])
    roles = policy.holder_roles(parse_snapshot(doc), 64)
    assert {p: r.role for p, r in roles.items()} == {
        57: policy.ROLE_HOLDER, 88: policy.ROLE_HOLDER, 89: policy.ROLE_HOLDER,
        700: policy.ROLE_CLIENT}  # maps not available for 57-89 (old agent), none for 700
    assert "container" in roles[88].reason


def test_hidepid_host_memory_of_hidden_pids_can_be_explained_by_a_visible_holder() -> None:
    doc = _with_holder(_doc("basic", STATUS), 600, ALL_DEVS, None)
    doc["facts"]["hidepid"] = True
    doc["facts"]["can_read_all_fds"] = False
    assert _role(doc, 600).role == policy.ROLE_CLIENT  # nothing unexplained
    doc["compute_apps"].append({"pid": 31337, "process_name": "python", "used_mib": 9000,
                                "gpu_uuid": doc["gpus"][0]["uuid"]})
    doc["gpus"][0]["memory_used_mib"] += 9000
    role = _role(doc, 600)
    assert role.role == policy.ROLE_HOLDER and "hidepid" in role.reason
    doc["holders"][-1]["mapped"] = []  # ...unless its maps say it is an NVML client
    assert _role(doc, 600).role == policy.ROLE_CLIENT


def test_wsl2_maps_are_uninformative_and_names_add_protection() -> None:
    doc = _doc("wsl2")
    for h in doc["holders"]:
        h["mapped"] = []  # what CUDA maps on WSL2 is unrecorded: proves nothing there
    roles = policy.holder_roles(parse_snapshot(doc), 64)
    assert roles[900].role == roles[950].role == policy.ROLE_HOLDER
    doc["processes"]["950"]["comm"] = "nvitop"
    assert _role(doc, 950).role == policy.ROLE_CLIENT
    assert _role(doc, 900).role == policy.ROLE_HOLDER
    doc["gpus"][0]["memory_used_mib"] = 0  # nothing unexplained: a client
    assert _role(doc, 900).role == policy.ROLE_CLIENT


def test_names_add_protection_but_never_make_a_holder() -> None:
    doc = _with_holder(_doc("basic", STATUS), 600, ALL_DEVS, CUDA_MAPS, comm="python3",
                       cmdline="python3 -m nvitop")
    doc["gpus"][0]["memory_used_mib"] += 4000
    role = _role(doc, 600)
    assert role.role == policy.ROLE_CLIENT and "nvitop" in role.reason
    for comm, cmd in (("gpustat", "gpustat -i"), ("nvidia-smi", "nvidia-smi dmon"),
                      ("python3", "/usr/bin/python3 /usr/local/bin/gpustat -i")):
        d = _with_holder(_doc("basic", STATUS), 601, ALL_DEVS, CUDA_MAPS, comm=comm, cmdline=cmd)
        d["gpus"][0]["memory_used_mib"] += 4000
        assert _role(d, 601).role == policy.ROLE_CLIENT, cmd
    # a client by maps stays a client whatever its name
    plain = _with_holder(_doc("basic", STATUS), 602, ALL_DEVS, [], comm="train.py",
                         cmdline="python3 train.py")
    plain["gpus"][0]["memory_used_mib"] += 4000
    assert _role(plain, 602).role == policy.ROLE_CLIENT


def test_family_root_of_listed_processes_is_a_holder_whatever_its_maps() -> None:
    """vLLM's EngineCore above its Workers: it may use NVML only (no CUDA maps) and still be
    the family's root."""
    doc = _doc("train-node")
    doc["compute_apps"] = [a for a in doc["compute_apps"] if a["pid"] not in (4340, 4341)]
    for h in doc["holders"]:
        if h["pid"] in (4340, 4341):
            h["mapped"] = []
    role = _role(doc, 4340)
    assert role.role == policy.ROLE_HOLDER and "family root" in role.reason


def test_unreadable_processes_matter_only_with_unexplained_memory() -> None:
    doc = _doc("basic", STATUS)
    assert not policy.unreadable_could_matter(parse_snapshot(doc), 64)
    doc["gpus"][0]["memory_used_mib"] += 100
    assert policy.unreadable_could_matter(parse_snapshot(doc), 64)
    assert not policy.unreadable_could_matter(parse_snapshot(doc), 200)
    doc["nvidia_smi"] = {"ok": False, "error": "x", "exit_code": 9, "seconds": 0.1}
    assert policy.unreadable_could_matter(parse_snapshot(doc), 200)  # memory unknown


RECORDED = SCENARIOS.parent / "recorded"


def test_recorded_h200_maps_tell_clients_from_cuda_processes() -> None:
    """tests/fixtures/recorded/clients_maps.txt (real H200): the same files open, different
    maps. The rule must call the poller and nvidia-smi dmon clients, from maps alone."""
    import ast

    lines = (RECORDED / "clients_maps.txt").read_text().splitlines()
    seen = {}
    for line in lines[:3]:
        m = re.search(r"pid=(\d+) fds=(\[.*?\]) maps=(\[.*?\])$", line)
        assert m, line
        seen[int(m.group(1))] = (ast.literal_eval(m.group(2)), ast.literal_eval(m.group(3)))
    assert {evidence.maps_kind(tuple(maps), False) for pid, (_, maps) in seen.items()
            if pid != 436} == {evidence.MAPS_CLIENT}
    assert evidence.maps_kind(tuple(seen[436][1]), False) == evidence.MAPS_CUDA
    pid, name, mib = [x.strip() for x in lines[4].replace(" MiB", "").split(",")]
    doc = _doc("basic", STATUS)
    uuid = doc["gpus"][0]["uuid"]
    doc["compute_apps"] = [{"pid": int(pid), "process_name": name, "used_mib": int(mib),
                            "gpu_uuid": uuid}]
    doc["gpus"][0]["memory_used_mib"] = int(mib) + 2  # recorded driver share: a few MiB
    doc["holders"] = []
    for p, (fds, maps) in seen.items():
        _with_holder(doc, p, fds, maps, comm="python3", cmdline="python3 x.py")
    roles = policy.holder_roles(parse_snapshot(doc), 64)
    assert set(roles) == {434, 461}  # 436 is listed by nvidia-smi
    assert all(r.role == policy.ROLE_CLIENT for r in roles.values())


def test_display_server_with_unexplained_memory_stays_a_holder_in_status() -> None:
    """Xorg's graphics memory is not in compute-apps: with memory unexplained it is shown as
    a holder (policy refuses it anyway), without any it is a client like the rest."""
    snap = load("agent-session")
    roles = policy.holder_roles(snap, 64)
    assert roles[1650].role == policy.ROLE_HOLDER and "display server" in roles[1650].reason
    assert policy.holder_roles(snap, 5000)[1650].role == policy.ROLE_CLIENT


def test_the_tolerance_and_comm_length_have_one_definition() -> None:
    """One definition each: the 64 MiB tolerance is core/policy.DEFAULT_TOLERANCE_MIB everywhere (plan,
    clean options and --tolerance-mib, runbook clean steps, status's "busy"), and the comm
    length is core/model.COMM_MAX; no other module spells either number."""
    import inspect

    from gpufleet.core import model
    from gpufleet.core.plan import make_plan
    from gpufleet.ops.clean import CleanOptions
    from gpufleet.render import status

    assert inspect.signature(make_plan).parameters["tolerance_mib"].default == \
        policy.DEFAULT_TOLERANCE_MIB
    assert CleanOptions().tolerance_mib == status.BUSY_TOLERANCE_MIB == policy.DEFAULT_TOLERANCE_MIB
    assert model.COMM_MAX == 15 and not hasattr(policy, "COMM_LEN")
    root = Path(policy.__file__).resolve().parent.parent
    spelled = re.compile(r"(?i)toleran\w*\W[^\n]*\b64\b(?! MiB)|COMM_\w+ = ")
    for path in root.rglob("*.py"):
        if path.name == "agent.py":  # the agent is sent alone: it cannot import the core
            continue
        text = path.read_text()
        hits = [m.group(0) for m in spelled.finditer(text)]
        if path == root / "core" / "policy.py":
            hits = [h for h in hits if h != "TOLERANCE_MIB = 64"]  # DEFAULT_TOLERANCE_MIB
        if path == root / "core" / "model.py":
            hits = [h for h in hits if not h.startswith("COMM_MAX = ")]
        assert not hits, (path, hits)


def _probe3() -> tuple[dict[int, tuple[list, list]], list[list[str]], dict]:
    """tests/fixtures/recorded/clients_maps_probe3.txt (real H200, driver 580.159.04): five
    processes with the same device files open, and nvidia-smi's rows while they all run."""
    import ast

    lines = (RECORDED / "clients_maps_probe3.txt").read_text().splitlines()
    seen = {}
    for line in lines[:5]:
        m = re.search(r"pid=(\d+) fds=(\[.*?\]) maps=(\[.*?\])$", line)
        assert m, line
        seen[int(m.group(1))] = (ast.literal_eval(m.group(2)), ast.literal_eval(m.group(3)))
    assert lines[5] == "== compute apps while all run"
    rows = [[x.strip() for x in line.replace(" MiB", "").split(",")] for line in lines[6:8]]
    doc = _doc("basic", STATUS)
    doc["gpus"][0].update(uuid=rows[0][3], memory_used_mib=2075)  # recorded: 2075 MiB used
    doc["compute_apps"] = [{"pid": int(p), "process_name": n, "used_mib": int(mib),
                            "gpu_uuid": u} for p, n, mib, u in rows]
    doc["holders"] = []
    for pid, (fds, maps) in seen.items():
        _with_holder(doc, pid, fds, maps, comm="python3", cmdline="python3 probe.py")
    return seen, rows, doc


def test_recorded_probe3_only_a_mapped_nvidia_uvm_is_a_cuda_context() -> None:
    """A cuInit-only process maps /dev/nvidia0 and /dev/nvidiactl, holds no memory and is not
    listed: a mapped nvidiaN alone is not a CUDA context; a mapped nvidia-uvm is (recorded)."""
    seen, rows, doc = _probe3()
    kinds = {pid: evidence.maps_kind(tuple(maps), False) for pid, (_, maps) in seen.items()}
    listed = {int(r[0]) for r in rows}
    assert listed == {440, 461}  # the two CUDA processes with a context
    assert {p for p, k in kinds.items() if k == evidence.MAPS_CUDA} == listed
    assert seen[464][1] == ["/dev/nvidia0", "/dev/nvidiactl"] and kinds[464] == evidence.MAPS_CLIENT
    roles = policy.holder_roles(parse_snapshot(doc), 64)
    assert set(roles) == {438, 464, 466}  # NVML client (nvidiactl), cuInit only, smi loop
    assert all(r.role == policy.ROLE_CLIENT for r in roles.values()), roles


def test_recorded_probe3_when_the_listing_is_missing_only_contexts_are_holders() -> None:
    """The same processes on a host whose nvidia-smi cannot list them (agent in a container,
    2075 MiB unexplained): the CUDA processes are holders; the cuInit-only process, the NVML
    client and the nvidia-smi loop stay clients (before, the cuInit-only one was a holder)."""
    _, _, doc = _probe3()
    doc["compute_apps"] = []
    doc["facts"]["in_container"] = True
    roles = policy.holder_roles(parse_snapshot(doc), 64)
    assert {p: r.role for p, r in roles.items()} == {
        438: policy.ROLE_CLIENT, 440: policy.ROLE_HOLDER, 461: policy.ROLE_HOLDER,
        464: policy.ROLE_CLIENT, 466: policy.ROLE_CLIENT}
    assert "nvidia-uvm" in roles[440].reason


def test_a_user_service_is_refused_with_the_command_and_never_stopped(train: Snapshot,
                                                                       ctx: PolicyContext) -> None:
    """A unit under user@UID.service is that user's: no --stop-units makes gpufleet stop it
    (a system unit of that name is something else); a user's scope restricts nothing."""
    proc = next(p for p in train.processes.values() if policy.may_signal(p, ctx))
    mine = dataclasses.replace(proc, unit="user@65534.service", user_unit="cron.service",
                               user_unit_uid=65534)
    for c in (ctx, dataclasses.replace(ctx, stop_units=True)):
        found = signal_refusal(mine, c)
        assert found is not None and found[0] == policy.UNIT
        assert "systemctl --user -M 65534@ stop cron.service" in found[1]
        assert policy.service_unit(mine) is None
    scope = dataclasses.replace(mine, user_unit="app-tmux-42.scope")
    assert policy.may_signal(scope, ctx)


def test_protected_names_need_the_binary(train: Snapshot, ctx: PolicyContext) -> None:
    """sshd and the daemons are protected on evidence: the executable is root's binary of that
    name. A claim without it is a target; no evidence at all (an older agent) keeps the name's
    protection."""
    base = next(p for p in train.processes.values() if policy.may_signal(p, ctx))
    cases = [
        ("sshd: alice@pts/3", "sshd", "/usr/sbin/sshd", True, False),
        ("sshd-session: alice@pts/3", "sshd-session", "/usr/lib/openssh/sshd-session", True,
         False),
        ("sshd: alice@pts/3", "sshd", "/usr/bin/python3.11", True, True),
        ("sshd: alice@pts/3", "sshd", "/data/alice/sshd", False, True),  # alice's own copy
        ("sshd: alice@pts/3", "sshd", None, None, False),  # no evidence: the name protects
        ("nvidia-persistenced --user nvidia", "nvidia-persiste",
         "/usr/bin/nvidia-persistenced", True, False),
        ("nvidia-persistenced", "nvidia-persiste", "/usr/bin/python3", True, True),
        ("/usr/bin/X :0", "Xorg", "/usr/lib/xorg/Xorg", True, False),
        ("/usr/sbin/sshd -D (deleted)", "sshd", "/usr/sbin/sshd (deleted)", True, False),
    ]
    for cmdline, comm, exe, root, target in cases:
        p = dataclasses.replace(base, cmdline=cmdline, comm=comm, exe=exe, exe_root=root)
        assert policy.may_signal(p, ctx) is target, (cmdline, exe, root)
        assert (policy.false_claim(p) is not None) is target, (cmdline, exe, root)
    nvtop = dataclasses.replace(base, comm="nvtop", cmdline="nvtop", exe="/usr/bin/nvtop",
                                exe_root=True)
    assert policy.client_name(nvtop) == "nvtop"
    fake = dataclasses.replace(nvtop, exe="/usr/bin/python3.11")
    assert policy.client_name(fake) is None


def _family_proc(pid: int, ppid: int, comm: str, cmdline: str, **kw) -> ProcessInfo:
    return ProcessInfo(pid=pid, ppid=ppid, starttime=pid * 10, state="S", uid=0, user="root",
                       comm=comm, cmdline=cmdline, **kw)


@pytest.mark.parametrize("parent,kind,restarts", [
    (("sh", "sh -c while :; do python3 train.py; sleep 1; done"), policy.OWNER_SUPERVISOR, True),
    (("bash", "bash -c for i in 1 2 3; do python3 train.py; done"), policy.OWNER_SUPERVISOR, True),
    (("sh", "sh -c python3 train.py"), policy.OWNER_PARENT, None),  # no loop: runs it once
    (("sh", "sh -c while :; do other; done"), policy.OWNER_PARENT, None),  # loops another one
    (("bash", "-bash"), policy.OWNER_PARENT, None),  # an interactive shell is a parent only
    (("supervisord", "/usr/bin/python3 /usr/bin/supervisord -n"), policy.OWNER_SUPERVISOR, True),
    (("python3", "/usr/bin/python3 -m torch.distributed.run --nproc-per-node 8 train.py"),
     policy.OWNER_SUPERVISOR, True),
    (("raylet", "/opt/ray/raylet --node-ip 10.0.0.1"), policy.OWNER_SUPERVISOR, True),
])
def test_the_owner_of_a_target_comes_from_its_parent(parent, kind, restarts) -> None:
    comm, cmd = parent
    procs = {1: _family_proc(1, 0, "systemd", "/sbin/init"), 50: _family_proc(50, 1, comm, cmd),
             60: _family_proc(60, 50, "python3", "python3 train.py")}
    owner = policy.owner_of(procs[60], procs)
    assert owner is not None and (owner.kind, owner.pid, owner.restarts) == (kind, 50, restarts)
    assert "--owner 50" in owner.action


def test_no_owner_under_init_sshd_or_the_agents_session_and_targets_are_skipped() -> None:
    procs = {1: _family_proc(1, 0, "systemd", "/sbin/init"),
             40: _family_proc(40, 1, "sshd", "sshd: root@pts/0", exe="/usr/sbin/sshd", exe_root=True),
             41: _family_proc(41, 40, "bash", "-bash", relation="ancestor"),
             60: _family_proc(60, 1, "python3", "python3 train.py"),
             61: _family_proc(61, 40, "python3", "python3 train.py"),
             62: _family_proc(62, 41, "python3", "python3 train.py"),
             70: _family_proc(70, 1, "sh", "sh -c while :; do VLLM::EngineCore; done"),
             71: _family_proc(71, 70, "VLLM::EngineCor", "VLLM::EngineCore"),
             72: _family_proc(72, 71, "VLLM::Worker", "VLLM::Worker")}
    assert policy.owner_of(procs[60], procs) is None
    assert policy.owner_of(procs[61], procs) is None
    assert policy.owner_of(procs[62], procs) is None
    # a family's members: the owner is the loop above the whole family
    owner = policy.owner_of(procs[72], procs, frozenset({71, 72}))
    assert owner is not None and owner.pid == 70 and owner.restarts


def test_units_pods_containers_and_jobs_own_what_runs_in_them() -> None:
    pod = "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod12ab_34cd.slice/x.scope"
    cases = [
        (dict(unit="vllm.service"), policy.OWNER_UNIT, "vllm.service"),
        (dict(unit="user@1000.service", user_unit="job.service", user_unit_uid=1000),
         policy.OWNER_USER_UNIT, "job.service (uid 1000)"),
        (dict(container="k8s:0123456789ab", cgroup=pod), policy.OWNER_POD,
         "pod 12ab-34cd (k8s:0123456789ab)"),
        (dict(container="docker:0123456789ab"), policy.OWNER_CONTAINER, "docker:0123456789ab"),
        (dict(cgroup="/system.slice/slurmstepd.scope/job_4711/step_0/user/task_0"),
         policy.OWNER_SLURM, "Slurm job 4711"),
    ]
    for extra, kind, name in cases:
        proc = _family_proc(60, 1, "python3", "python3 train.py", **extra)
        owner = policy.owner_of(proc, {60: proc})
        assert owner is not None and (owner.kind, owner.name) == (kind, name), extra


def test_a_gpu_reset_is_advised_only_where_the_agent_would_do_it() -> None:
    """The agent's reset_refusal, in words: root, the host itself, not WSL2, and nothing with
    the GPU's device file open; else the node is drained and rebooted."""
    d = json.loads((SCENARIOS / "train-node.json").read_text())
    snap = parse_snapshot(d)
    # the vLLM ranks, the trainer's and the driver daemons hold every device file
    assert policy.gpu_reset_blockers(snap, 3) == ["its device file is open in 12 processes"]
    assert policy.reset_or_drain(snap, (3,), "train-node") == (
        "no GPU reset here (its device file is open in 12 processes): drain the node (Slurm: "
        "scontrol update nodename=train-node state=drain reason=...) and reboot")
    d["holders"] = [h for h in d["holders"] if "/dev/nvidia3" not in h["devices"]]
    free = parse_snapshot(d)
    assert policy.gpu_reset_blockers(free, 3) == []
    assert policy.reset_or_drain(free, (3,)) == "a GPU reset frees it: clean again with --reset"
    d["facts"].update(is_root=False, in_container=True, container="docker-1", wsl2=True)
    assert policy.gpu_reset_blockers(parse_snapshot(d), 3) == [
        "not root", "in container docker-1", "WSL2 has no GPU reset"]


def test_a_containers_owner_restarts_by_the_runtimes_policy() -> None:
    for restart, restarts in [("always", True), ("unless-stopped", True), ("on-failure", True),
                              ("no", False), (None, None)]:
        proc = _family_proc(60, 1, "python3", "python3 serve.py",
                            container="docker:0123456789ab", container_restart=restart)
        owner = policy.owner_of(proc, {60: proc})
        assert owner is not None and owner.kind == policy.OWNER_CONTAINER
        assert owner.restarts is restarts and (restart or "not read") in owner.evidence
