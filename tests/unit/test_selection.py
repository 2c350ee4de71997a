"""Host selection (--host/--group/--tag/--all) and --gpus parsing."""
from __future__ import annotations

import fnmatch
import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpufleet.errors import EXIT_USAGE, UsageError
from gpufleet.config.inventory import implicit_inventory, parse_inventory
from gpufleet.config.selection import (
    MAX_GPU_INDEX,
    format_gpu_list,
    parse_gpu_list,
    require_selection,
    select,
)

FLEET = parse_inventory(textwrap.dedent("""\
    hosts:
      bigmama: {address: bigmama.local, tags: [wsl2, workstation]}
      train-01: {address: 203.0.113.10, port: 10978, tags: [ada]}
      train-02: {address: 203.0.113.11, port: 10978, tags: [ada]}
      infer-01: {address: 198.51.100.20, tags: [blackwell]}
      infer-02: {address: 198.51.100.21, tags: [blackwell]}
      Workstation: {connection: local, tags: [workstation]}
    groups:
      training: [train-02, train-01]
      inference: [infer-01, infer-02]
      spare: []
    """), source="fleet.yaml")


def names(hosts):
    return [h.name for h in hosts]


def usage_error(**kw) -> str:
    with pytest.raises(UsageError) as info:
        select(FLEET, **kw)
    assert info.value.exit_code == EXIT_USAGE
    assert "\n" not in str(info.value)
    return str(info.value)


def test_no_criteria_selects_every_host_in_order():
    assert names(select(FLEET)) == list(FLEET.names)
    assert names(select(FLEET, [], [], [], False)) == list(FLEET.names)


def test_all_selects_every_host():
    assert names(select(FLEET, all_=True)) == list(FLEET.names)
    assert names(select(FLEET, hosts=["bigmama"], all_=True)) == list(FLEET.names)


def test_host_names_and_globs():
    assert names(select(FLEET, hosts=["train-01"])) == ["train-01"]
    assert names(select(FLEET, hosts=["train-*"])) == ["train-01", "train-02"]
    assert names(select(FLEET, hosts=["*-0[2]"])) == ["train-02", "infer-02"]
    assert names(select(FLEET, hosts=["?igmama"])) == ["bigmama"]


def test_result_is_in_inventory_order_and_unique():
    got = select(FLEET, hosts=["infer-02", "bigmama", "infer-*", "bigmama"])
    assert names(got) == ["bigmama", "infer-01", "infer-02"]


def test_union_of_hosts_groups_and_tags():
    got = select(FLEET, hosts=["bigmama"], groups=["training"], tags=["blackwell"])
    assert names(got) == ["bigmama", "train-01", "train-02", "infer-01", "infer-02"]
    assert names(select(FLEET, tags=["workstation"])) == ["bigmama", "Workstation"]


def test_group_order_does_not_change_inventory_order():
    assert names(select(FLEET, groups=["training"])) == ["train-01", "train-02"]


def test_comma_lists_equal_repeated_flags():
    assert select(FLEET, hosts=["bigmama,infer-*"]) == select(FLEET, hosts=["bigmama", "infer-*"])
    assert select(FLEET, groups=["training, inference"]) == select(
        FLEET, groups=["training", "inference"])
    assert select(FLEET, tags="ada,wsl2") == select(FLEET, tags=["ada", "wsl2"])


def test_globs_are_case_sensitive():
    assert names(select(FLEET, hosts=["W*"])) == ["Workstation"]
    message = usage_error(hosts=["workstation"])
    assert message == "no host matches 'workstation' (did you mean 'Workstation'?)"


def test_unknown_host_suggests_a_close_host():
    assert usage_error(hosts=["trian-01"]) == "no host matches 'trian-01' (did you mean 'train-01'?)"
    assert usage_error(hosts=["gpu-*"]) == "no host matches 'gpu-*'"


def test_host_flag_given_a_group_or_tag_suggests_the_right_flag():
    assert usage_error(hosts=["training"]) == \
        "no host matches 'training' (did you mean --group training?)"
    assert usage_error(hosts=["blackwell"]) == \
        "no host matches 'blackwell' (did you mean --tag blackwell?)"
    assert usage_error(groups=["bigmama"]) == \
        "unknown group 'bigmama' (did you mean --host bigmama?)"
    assert usage_error(tags=["inference"]) == \
        "no host has tag 'inference' (did you mean --group inference?)"


def test_unknown_group_and_tag():
    assert usage_error(groups=["trainig"]) == "unknown group 'trainig' (did you mean 'training'?)"
    assert usage_error(tags=["blackwel"]) == "no host has tag 'blackwel' (did you mean 'blackwell'?)"
    assert usage_error(tags=["zzz"]) == "no host has tag 'zzz'"


def test_empty_group_is_an_error():
    assert usage_error(groups=["spare"]) == "group 'spare' has no hosts"


def test_a_typo_is_reported_even_with_all():
    assert "nope" in usage_error(hosts=["nope"], all_=True)


def test_empty_names_are_errors():
    assert "empty name" in usage_error(hosts=[""])
    assert "empty name" in usage_error(groups=["training,"])


def test_implicit_inventory_selects_localhost():
    assert names(select(implicit_inventory())) == ["localhost"]
    assert names(select(implicit_inventory(), hosts=["local*"])) == ["localhost"]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(list(FLEET.names) + ["*", "train-*", "*-0?", "b*"]), max_size=4),
       st.lists(st.sampled_from(["training", "inference"]), max_size=2),
       st.lists(st.sampled_from(["ada", "wsl2", "blackwell", "workstation"]), max_size=2))
def test_selection_is_an_ordered_union(hosts, groups, tags):
    got = names(select(FLEET, hosts=hosts, groups=groups, tags=tags))
    if not (hosts or groups or tags):
        assert got == list(FLEET.names)
        return
    assert got == [n for n in FLEET.names if n in set(got)]  # inventory order, no repeats
    for g in groups:
        assert set(FLEET.groups[g]) <= set(got)
    for t in tags:
        assert {h.name for h in FLEET.hosts if t in h.tags} <= set(got)
    for h in select(FLEET, hosts=hosts, groups=groups, tags=tags):
        assert (any(fnmatch.fnmatchcase(h.name, p) for p in hosts)
                or any(h.name in FLEET.groups[g] for g in groups)
                or any(t in h.tags for t in tags))


# --------------------------------------------------------------------------- --gpus


@pytest.mark.parametrize("text,expected", [
    ("all", None), ("ALL", None), (" all ", None),
    ("0", (0,)), ("7", (7,)),
    ("0-3", (0, 1, 2, 3)), ("2-2", (2,)),
    ("0,2,5", (0, 2, 5)), ("5,2,0", (0, 2, 5)), ("0, 2 ,5", (0, 2, 5)),
    ("0-1,4", (0, 1, 4)), ("4,0-1", (0, 1, 4)), ("0-2,1-3", (0, 1, 2, 3)), ("1,1", (1,)),
    (f"{MAX_GPU_INDEX}", (MAX_GPU_INDEX,)),
])
def test_parse_gpu_list_valid(text, expected):
    assert parse_gpu_list(text) == expected


@pytest.mark.parametrize("text,fragment", [
    ("", "empty GPU list"), ("  ", "empty GPU list"),
    ("a", "invalid GPU list"), ("0,", "invalid GPU list"), (",0", "invalid GPU list"),
    ("0-", "invalid GPU list"), ("-1", "invalid GPU list"), ("0--3", "invalid GPU list"),
    ("1.5", "invalid GPU list"), ("0 1", "invalid GPU list"), ("٣", "invalid GPU list"),
    ("0-3-5", "invalid GPU list"), ("al", "invalid GPU list"), ("all,0", "invalid GPU list"),
    ("3-0", "reversed range '3-0' (write 0-3)"),
    (f"0-{MAX_GPU_INDEX + 1}", "too large"), ("99999999999999999999", "too large"),
])
def test_parse_gpu_list_invalid(text, fragment):
    with pytest.raises(UsageError) as info:
        parse_gpu_list(text)
    assert info.value.exit_code == EXIT_USAGE and fragment in str(info.value)
    assert str(info.value).startswith("--gpus: ")


def test_parse_gpu_list_checks_available_indices():
    assert parse_gpu_list("0-3", available=range(8), host="train-01") == (0, 1, 2, 3)
    assert parse_gpu_list("all", available=range(8), host="train-01") is None
    with pytest.raises(UsageError) as info:
        parse_gpu_list("0,9", available=range(8), host="train-01")
    assert str(info.value) == "GPU 9 does not exist on train-01 (has 0-7)"
    with pytest.raises(UsageError, match=r"^GPU 2 does not exist on h \(has 0-1,3\)$"):
        parse_gpu_list("0-3", available=[0, 1, 3], host="h")
    with pytest.raises(UsageError, match=r"^GPU 0 does not exist on h \(has no GPUs\)$"):
        parse_gpu_list("0", available=[], host="h")
    with pytest.raises(UsageError, match=r"^GPU 1 does not exist \(has 0\)$"):
        parse_gpu_list("1", available=[0])


def test_parse_gpu_list_rejects_non_text():
    with pytest.raises(UsageError):
        parse_gpu_list(3)  # type: ignore[arg-type]


def test_format_gpu_list():
    assert format_gpu_list([]) == ""
    assert format_gpu_list([0]) == "0"
    assert format_gpu_list(range(8)) == "0-7"
    assert format_gpu_list([5, 0, 1, 2, 3, 3]) == "0-3,5"
    assert format_gpu_list([1, 3, 5]) == "1,3,5"


@settings(max_examples=300, deadline=None)
@given(st.sets(st.integers(0, MAX_GPU_INDEX), min_size=1, max_size=40))
def test_format_and_parse_round_trip(indices):
    assert parse_gpu_list(format_gpu_list(indices)) == tuple(sorted(indices))


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="0123456789,- al", max_size=12))
def test_parse_gpu_list_never_raises_anything_else(text):
    try:
        result = parse_gpu_list(text)
    except UsageError:
        return
    assert result is None or (result == tuple(sorted(set(result)))
                              and all(0 <= i <= MAX_GPU_INDEX for i in result))


# ------------------------------------------------------------ Slurm/ClusterShell host ranges

NODES = parse_inventory(textwrap.dedent("""\
    hosts:
      node01: {address: 10.0.0.1}
      node02: {address: 10.0.0.2}
      node03: {address: 10.0.0.3}
      node04: {address: 10.0.0.4}
      node08: {address: 10.0.0.8}
      nodea: {address: 10.0.0.10}
    groups:
      rack1: ['node[01-03]', node08]
    """), source="fleet.yaml")


def test_host_ranges_select_what_they_name():
    assert names(select(NODES, hosts=["node[01-04,08]"])) == ["node01", "node02", "node03",
                                                              "node04", "node08"]
    assert names(select(NODES, hosts=["node[02-03],nodea"])) == ["node02", "node03", "nodea"]
    assert names(select(NODES, hosts=["node[01-02]", "node08"])) == ["node01", "node02", "node08"]
    # fnmatch classes stay globs: [ab] is one letter
    assert names(select(NODES, hosts=["node[ab]"])) == ["nodea"]
    assert names(select(NODES, hosts=["node0[1-2]*"])) == ["node01", "node02"]


def test_host_range_naming_a_missing_host_is_an_error():
    with pytest.raises(UsageError, match=r"no host 'node05' \(from 'node\[01-05\]'\)"):
        select(NODES, hosts=["node[01-05]"])
    with pytest.raises(UsageError, match="bad host range"):
        select(NODES, hosts=["node[3-1]"])


def test_inventory_groups_accept_host_ranges():
    assert NODES.groups["rack1"] == ("node01", "node02", "node03", "node08")
    assert names(select(NODES, groups=["rack1"])) == ["node01", "node02", "node03", "node08"]
    with pytest.raises(UsageError, match=r"unknown host 'node09'.*\(from 'node\[08-09\]'\)"):
        parse_inventory("hosts:\n  node08: {address: a}\ngroups:\n  g: ['node[08-09]']\n")


@pytest.mark.parametrize("named", [
    {"hosts": ["train-01"]}, {"groups": ["training"]}, {"tags": ["ada"]}, {"all_": True},
])
def test_a_command_that_changes_hosts_accepts_any_selection(named) -> None:
    require_selection("clean changes hosts", **named)  # no error


def test_a_command_that_changes_hosts_without_a_selection_says_how() -> None:
    with pytest.raises(UsageError) as err:
        require_selection("clean changes hosts")
    assert str(err.value) == ("clean changes hosts: name them with --host NAME, -g GROUP, "
                              "--tag TAG or --all")
    assert err.value.exit_code == EXIT_USAGE
    with pytest.raises(UsageError) as err:
        require_selection("clean changes hosts", implicit=True)
    assert str(err.value) == ("clean changes hosts: name them with --host localhost or --all "
                              "(no inventory: this machine only)")
