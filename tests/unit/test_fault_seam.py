"""The test-only donor-row fault of the debug seam (`SWIFTCACHE_FAULT_DONOR_ROW`): installed only
when the variable is set, refused by name when malformed, gone after `reset`; a store ticket's
tokens are read up its node's path. Its effect on a live borrower is
tests/integration/test_negative_control.py."""

from __future__ import annotations

import json
from array import array
from types import SimpleNamespace

import pytest

from sglang_swift.integration import debug_seam


@pytest.fixture(autouse=True)
def clean():
    debug_seam.reset()
    yield
    debug_seam.reset()


def test_no_variable_installs_nothing():
    assert debug_seam.install_from_env({}) is None
    assert debug_seam.OBSERVERS.donor_stored is None and not debug_seam.OBSERVERS.any()


def test_the_variable_installs_the_fault_and_reset_removes_it(tmp_path):
    spec = {"targets": [[1900, 3], [1901, 7]], "row": 20, "report": str(tmp_path / "r")}
    name = debug_seam.install_from_env({debug_seam.FAULT_ENV: json.dumps(spec)})
    assert name and debug_seam.FAULT_ENV in name
    fault = debug_seam.OBSERVERS.donor_stored
    assert isinstance(fault, debug_seam.DonorRowFault)
    assert fault.targets == {1900: 3, 1901: 7} and fault.row == 20
    debug_seam.reset()
    assert debug_seam.OBSERVERS.donor_stored is None


@pytest.mark.parametrize("bad", ["not json", json.dumps({"row": 1, "report": "x"}),
                                 json.dumps({"targets": [], "row": 1, "report": "x"}),
                                 json.dumps({"targets": [[1, 0]], "row": -1, "report": "x"})])
def test_a_malformed_fault_is_refused_by_name(bad):
    with pytest.raises(debug_seam.InstrumentsUnavailable, match=debug_seam.FAULT_ENV):
        debug_seam.install_from_env({debug_seam.FAULT_ENV: bad})


def test_a_ticket_that_matches_no_target_is_left_alone(tmp_path):
    report = tmp_path / "r"
    fault = debug_seam.DonorRowFault({1900: 0}, 1, str(report))
    node = SimpleNamespace(key=array("q", [5, 6, 7]), parent=None)
    fault(runtime=None, lease_key=("d", 1), tickets=[SimpleNamespace(node=node, num_tokens=3)])
    assert fault.targets == {1900: 0} and not report.exists()


def test_ticket_tokens_follow_the_path_up_from_the_node():
    root = SimpleNamespace(key=array("q"), parent=None)
    a = SimpleNamespace(key=array("q", [1, 2, 3]), parent=root)
    b = SimpleNamespace(key=array("q", [4, 5]), parent=a)
    tokens = debug_seam._ticket_tokens
    assert tokens(SimpleNamespace(node=b, num_tokens=2)) == [4, 5]
    assert tokens(SimpleNamespace(node=b, num_tokens=4)) == [2, 3, 4, 5]
    assert tokens(SimpleNamespace(node=b, num_tokens=1)) == [5]
