"""`same_greedy`, the integration tests' comparison of greedy outputs with stock SGLang's: equal
token lists pass, a first difference passes only at a near-tie in both runs' candidates."""

from __future__ import annotations

import pytest
from integration.harness import TIE_NATS, same_greedy


def _resp(*steps: tuple[str, dict[str, float]]) -> dict:
    content = [{"token": tok, "logprob": cands[tok],
                "top_logprobs": [{"token": t, "logprob": lp} for t, lp in cands.items()]}
               for tok, cands in steps]
    return {"choices": [{"message": {"content": "".join(t for t, _ in steps)},
                         "logprobs": {"content": content}}]}


def test_equal_outputs_pass():
    a = _resp(("x", {"x": -0.1, "y": -2.0}), ("z", {"z": -0.5, "x": -0.9}))
    assert same_greedy([a, a], [a, a]) == []


def test_a_near_tie_in_both_runs_is_reported_not_raised():
    want = _resp(("x", {"x": -0.1, "y": -2.0}), ("p", {"p": -0.69310, "q": -0.69320}))
    got = _resp(("x", {"x": -0.1, "y": -2.0}), ("q", {"q": -0.69312, "p": -0.69318}))
    assert same_greedy([want, got], [want, want]) == [1]


@pytest.mark.parametrize("gap", [10 * TIE_NATS, 0.5])
def test_a_difference_beyond_a_tie_fails(gap):
    want = _resp(("p", {"p": -0.6, "q": -0.6 - gap}))
    got = _resp(("q", {"q": -0.6, "p": -0.6 - gap}))
    with pytest.raises(AssertionError, match="request 0, token 0"):
        same_greedy([got], [want])


def test_a_tie_in_one_run_only_fails():
    """The reference was sure (gap 1 nat) though the other run saw a tie: not float noise."""
    want = _resp(("p", {"p": -0.3, "q": -1.3}))
    got = _resp(("q", {"q": -0.69312, "p": -0.69318}))
    with pytest.raises(AssertionError):
        same_greedy([got], [want])


def test_a_chosen_token_missing_from_the_other_runs_candidates_fails():
    want = _resp(("p", {"p": -0.3, "r": -1.3}))
    got = _resp(("q", {"q": -0.3, "p": -0.3001}))
    with pytest.raises(AssertionError):
        same_greedy([got], [want])


def test_a_shorter_output_fails():
    a = _resp(("x", {"x": -0.1}), ("y", {"y": -0.1}))
    b = _resp(("x", {"x": -0.1}))
    with pytest.raises(AssertionError, match="request 0"):
        same_greedy([b], [a])
