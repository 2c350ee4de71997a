"""A rolling run's arithmetic, as Ansible does it (pure): which hosts make each batch, and when
a batch's failures stop every later batch.

Read from ansible-core's own code (2.19): ``PlaybookExecutor._get_serialized_batches`` and
``ansible.utils.helpers.pct_to_int`` split the hosts; ``plugins/strategy/linear.py`` stops the
play when ``failed / batch size > max_fail_percentage / 100`` (GREATER than: 1 failure in a
batch of 4 is 25%, within a budget of 25), and ``PlaybookExecutor.run`` stops it when every
host of a batch failed, whatever the budget. tests/unit/test_runbook_rolling.py holds
``split_batches`` to Ansible's function itself; tests/integration/test_rolling_ansible_lab.py
holds whole runs to ``ansible-playbook`` on the same lab hosts.
"""
from __future__ import annotations

from typing import Optional, Sequence, TypeVar, Union

T = TypeVar("T")


def batch_size(item: Union[int, str], total: int) -> int:
    """Ansible's ``pct_to_int``: ``"N%"`` of ALL the hosts (not of those left), rounded down,
    at least 1; a count as it is (0: every host left)."""
    if isinstance(item, str) and item.endswith("%"):
        return int(int(item[:-1]) / 100.0 * total) or 1
    return int(item)


def split_batches(hosts: Sequence[T], serial: Sequence[Union[int, str]]) -> list[list[T]]:
    """The hosts in consecutive batches: one per ``serial`` entry, the last entry repeating;
    no serial (or a 0) puts every host left in one batch."""
    left = list(hosts)
    total = len(left)
    items = list(serial) or [0]
    batches: list[list[T]] = []
    i = 0
    while left:
        size = batch_size(items[i], total)
        if size <= 0:
            batches.append(left)
            break
        batches.append(left[:size])
        left = left[size:]
        i = min(i + 1, len(items) - 1)
    return batches


def over_budget(failed: int, size: int, max_fail_percentage: Optional[float]) -> bool:
    """More than ``max_fail_percentage`` of the batch failed (None: no budget)."""
    return max_fail_percentage is not None and size > 0 and failed * 100 > max_fail_percentage * size


def stop_reason(failed: int, size: int, max_fail_percentage: Optional[float]) -> Optional[str]:
    """Why no later batch may start after this one (None: go on)."""
    if size and failed == size:
        return f"every host of the batch failed ({failed} of {size})"
    if over_budget(failed, size, max_fail_percentage):
        assert max_fail_percentage is not None
        return (f"{failed} of {size} host(s) failed ({failed * 100 / size:.0f}% > "
                f"max_fail_percentage {max_fail_percentage:g}%)")
    return None


def serial_text(serial: Sequence[Union[int, str]]) -> str:
    """``1,2,25%`` (what --serial takes); ``all`` for one batch."""
    return ",".join(str(s) for s in serial) if serial else "all"


__all__ = ["batch_size", "over_budget", "serial_text", "split_batches", "stop_reason"]
