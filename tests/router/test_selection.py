"""Scenarios for the router's choice of replica (``kvdrive.router.selection.choose``): a pure function of
what each replica holds of the prompt and how loaded it is."""

from __future__ import annotations

from collections import Counter

import pytest

from kvdrive.router.selection import Candidate, NoReplicaError, Policy, choose

PAGE = 16
POLICY = Policy(load_tokens=512, max_imbalance=4)


def test_a_repeated_document_goes_where_its_pages_are_even_if_that_replica_is_busier() -> None:
    # a 2,000-token document sits on b; b runs 2 requests, a and c are idle
    cands = [Candidate("a", 0, 0), Candidate("b", 125, 2), Candidate("c", 0, 0)]
    d = choose(cands, POLICY, PAGE, first_page=b"doc")
    assert (d.name, d.reason, d.matched_tokens) == ("b", "prefix", 2000)


def test_a_short_match_does_not_outweigh_a_queue() -> None:
    # b holds only 4 pages (64 tokens) but runs 3 requests: computing 64 tokens elsewhere is cheaper
    cands = [Candidate("a", 0, 0), Candidate("b", 4, 3)]
    d = choose(cands, POLICY, PAGE, first_page=b"doc")
    assert (d.name, d.reason) == ("a", "load")


def test_a_hot_document_spills_over_once_its_replica_is_too_far_ahead() -> None:
    # everyone asks about the same document held by b: b takes them while it is within max_imbalance of the
    # least loaded replica; past that the next one goes elsewhere, however long the match
    loads = {"a": 0, "b": 0, "c": 0}
    held = {"b": 200}
    picked = []
    for _ in range(8):
        cands = [Candidate(n, held.get(n, 0), loads[n]) for n in loads]
        d = choose(cands, POLICY, PAGE, first_page=b"hot")
        loads[d.name] += 1
        picked.append(d.name)
    assert picked[:5] == ["b"] * 5  # 5 in flight on b: 5 > 0 + 4 would be next
    assert picked[5] != "b"
    assert max(loads.values()) - min(loads.values()) <= POLICY.max_imbalance + 1


def test_with_no_prefix_anywhere_repeats_converge_and_different_documents_spread() -> None:
    cands = [Candidate(n, 0, 0) for n in ("a", "b", "c")]
    first = choose(cands, POLICY, PAGE, first_page=b"new document")
    again = choose(list(reversed(cands)), POLICY, PAGE, first_page=b"new document", turn=7)
    assert first.name == again.name and first.reason == "load"
    spread = Counter(choose(cands, POLICY, PAGE, first_page=f"doc {i}".encode()).name for i in range(300))
    assert set(spread) == {"a", "b", "c"} and min(spread.values()) > 60


def test_with_no_prefix_the_least_loaded_replica_wins_over_the_hash() -> None:
    cands = [Candidate("a", 0, 3), Candidate("b", 0, 1), Candidate("c", 0, 2)]
    assert {choose(cands, POLICY, PAGE, first_page=f"d{i}".encode()).name for i in range(50)} == {"b"}


def test_an_unreadable_prompt_falls_back_to_load_and_rotates_among_the_idle() -> None:
    cands = [Candidate("a", 0, 0), Candidate("b", 0, 0), Candidate("c", 0, 5)]
    names = {choose(cands, POLICY, PAGE, readable=False, turn=t).name for t in range(6)}
    assert names == {"a", "b"}
    assert choose(cands, POLICY, PAGE, readable=False).reason == "fallback"


def test_a_prompt_shorter_than_a_page_is_placed_by_load() -> None:
    cands = [Candidate("a", 0, 2), Candidate("b", 0, 0)]
    d = choose(cands, POLICY, PAGE, first_page=None)
    assert (d.name, d.reason) == ("b", "load")


def test_round_robin_ignores_what_replicas_hold() -> None:
    cands = [Candidate("a", 0, 0), Candidate("b", 500, 0), Candidate("c", 0, 0)]
    rr = Policy(mode="round-robin")
    assert [choose(cands, rr, PAGE, b"x", turn=t).name for t in range(6)] == ["a", "b", "c"] * 2
    assert choose(cands, rr, PAGE, b"x").reason == "round-robin"


def test_no_replica_is_an_error_not_a_guess() -> None:
    with pytest.raises(NoReplicaError):
        choose([], POLICY, PAGE, b"x")
