"""`same_greedy`, the integration tests' comparison of greedy outputs with stock SGLang's: equal
token id lists pass, a first difference passes only at a near-tie in both runs' candidates, two
empty outputs and two ids that print alike never pass."""

from __future__ import annotations

import pytest
from integration.harness import TIE_NATS, same_greedy


def _resp(*steps: tuple[str, dict[str, float]], ids: list[int] | None = None) -> dict:
    """A chat response; its token ids are the tokens' letters' codes unless `ids` says."""
    content = [{"token": tok, "logprob": cands[tok],
                "top_logprobs": [{"token": t, "logprob": lp} for t, lp in cands.items()]}
               for tok, cands in steps]
    ids = [ord(tok) for tok, _ in steps] if ids is None else ids
    return {"choices": [{"message": {"content": "".join(t for t, _ in steps)},
                         "logprobs": {"content": content}, "response_token_ids": ids}]}


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


def test_two_empty_outputs_are_not_a_match():
    with pytest.raises(AssertionError, match="both outputs are empty"):
        same_greedy([_resp()], [_resp()])
    with pytest.raises(AssertionError, match="no responses"):
        same_greedy([], [])


def test_equal_text_with_other_token_ids_fails():
    """Byte-level tokens can print alike: identity is on ids, and no tie is granted."""
    want = _resp(("p", {"p": -0.3, "q": -1.3}), ids=[7])
    got = _resp(("p", {"p": -0.3, "q": -1.3}), ids=[8])
    with pytest.raises(AssertionError, match="id 8"):
        same_greedy([got], [want])


def test_a_response_without_token_ids_is_refused():
    resp = _resp(("p", {"p": -0.3}))
    del resp["choices"][0]["response_token_ids"]
    with pytest.raises(AssertionError, match="response_token_ids"):
        same_greedy([resp], [resp])


def test_generate_responses_compare_by_ids():
    def gen(ids, cands):
        return {"text": "", "output_ids": ids,
                "meta_info": {"output_token_logprobs": [(c[i], i, None) for i, c in
                                                        zip(ids, cands)],
                              "output_top_logprobs": [[(lp, t, None) for t, lp in c.items()]
                                                      for c in cands]}}
    a = gen([5, 6], [{5: -0.1, 9: -3.0}, {6: -0.2, 5: -2.0}])
    assert same_greedy([a], [a]) == []
    tie = gen([9], [{9: -0.69312, 5: -0.69318}])
    ref = gen([5], [{5: -0.69310, 9: -0.69320}])
    assert same_greedy([tie], [ref]) == [0]
    far = gen([9], [{9: -0.1, 5: -2.0}])
    with pytest.raises(AssertionError, match="token 0"):
        same_greedy([far], [gen([5], [{5: -0.1, 9: -2.0}])])
