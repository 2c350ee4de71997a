"""gpufleet.config.validators: the one validator family of the inventory and runbooks."""
from __future__ import annotations

from typing import NoReturn

import pytest

from gpufleet.config import validators as v
from gpufleet.config.inventory import parse_inventory
from gpufleet.errors import UsageError
from gpufleet.runbook.load import parse_runbook


class Failed(Exception):
    pass


def fail(message: str) -> NoReturn:
    raise Failed(message)


def message(check, value, **options) -> str:
    with pytest.raises(Failed) as info:
        check(value, fail, **options)
    return str(info.value)


def test_one_message_names_the_whole_expectation() -> None:
    assert message(v.timeout, "soon") == "expected a positive number of seconds, got the string 'soon'"
    assert message(v.timeout, 0) == "expected a positive number of seconds (at most 86400), got 0"
    for bad in ("soon", 0, None, float("nan"), True):
        assert message(v.timeout, bad, one_message=True) == (
            f"expected a positive number of seconds (at most 86400), got {v.describe(bad)}")
    assert message(v.mib, -1) == "expected a whole number of MiB >= 0, got -1"
    assert message(v.mib, -1, one_message=True) == "expected a whole number of MiB >= 0, got the integer -1"


def test_values_from_variables_are_read_as_numbers() -> None:
    assert v.timeout(v.Templated("5"), fail) == 5.0
    assert v.mib(v.Templated("64"), fail) == 64
    assert v.boolean(v.Templated("True"), fail) is True
    assert message(v.boolean, "true") == "expected true or false, got the string 'true'"


def _error(parse, text: str) -> str:
    with pytest.raises(UsageError) as info:
        parse(text)
    return str(info.value)


def test_inventory_and_runbooks_say_the_same_thing() -> None:
    inventory = _error(parse_inventory, "hosts:\n  a: {address: a, sudo: 1}\n")
    runbook = _error(parse_runbook, "steps:\n  - {kind: clean, shm: 1}\n")
    said = "expected true or false, got the integer 1"
    assert inventory.endswith(said) and runbook.endswith(said)
