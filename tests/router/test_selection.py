"""Scenarios for the router's choice of replica (``kvdrive.router.selection.choose``): a pure function of
what each replica holds of the prompt, the prefill already routed to it and how many requests it runs."""

from __future__ import annotations

from collections import Counter

import pytest

from kvdrive.router.selection import Candidate, NoReplicaError, Policy, affinity_key, choose

PAGE = 16
POLICY = Policy(load_tokens=128, max_imbalance=8)
DOC = 2000  # a prompt of 2,000 tokens (125 pages)


def test_a_repeated_document_goes_where_its_pages_are_even_if_that_replica_is_busier() -> None:
    # the document sits on b, which runs 2 requests; a and c are idle but would compute all 2,000 tokens
    cands = [Candidate("a", 0, 0), Candidate("b", 125, 2), Candidate("c", 0, 0)]
    d = choose(cands, POLICY, PAGE, first_page=b"doc", prompt_tokens=DOC)
    assert (d.name, d.reason, d.matched_tokens) == ("b", "prefix", 2000)


def test_the_prefill_already_queued_on_the_holder_counts_against_it() -> None:
    # b holds the document but has 6,000 prompt tokens still to compute for requests routed before: an idle
    # replica computing the 2,000 tokens itself answers first
    cands = [Candidate("a", 0, 0), Candidate("b", 125, 1, pending_tokens=6000)]
    d = choose(cands, POLICY, PAGE, first_page=b"doc", prompt_tokens=DOC)
    assert (d.name, d.reason) == ("a", "load")


def test_on_a_busy_fleet_the_holder_keeps_its_document_while_its_queue_is_not_far_longer() -> None:
    # every replica has prefill queued: b, which holds the document, 3,000 tokens more than a. Computing the
    # 2,000 tokens again on a would delay everything queued there and redo work the fleet has done: b wins
    cands = [Candidate("a", 0, 2, pending_tokens=2000), Candidate("b", 125, 3, pending_tokens=5000)]
    d = choose(cands, POLICY, PAGE, first_page=b"doc", prompt_tokens=DOC)
    assert (d.name, d.reason) == ("b", "prefix")
    # affinity, not the weight, decides here: even counting only this request's own wait (weight 1, by which
    # a's cost is lower) b keeps it, since a is not idle
    assert choose(cands, Policy(recompute_weight=1.0), PAGE, first_page=b"doc", prompt_tokens=DOC).name == "b"


def test_a_short_match_does_not_outweigh_a_queue() -> None:
    # b holds 4 pages (64 tokens) but runs 3 requests (384 tokens of cost): a computes 64 more and waits less
    cands = [Candidate("a", 0, 0), Candidate("b", 4, 3)]
    assert choose(cands, POLICY, PAGE, first_page=b"doc", prompt_tokens=DOC).name == "a"


def test_pages_every_replica_holds_are_no_reason() -> None:
    # a common system prompt (1 page) is on every replica: the choice is by load, and says so
    cands = [Candidate("a", 1, 2), Candidate("b", 1, 0), Candidate("c", 1, 1)]
    d = choose(cands, POLICY, PAGE, first_page=b"doc", prompt_tokens=DOC)
    assert (d.name, d.reason) == ("b", "load")


def test_a_hot_document_spills_over_once_its_replica_is_too_far_ahead() -> None:
    # everyone asks about the document held by b; each request there costs only its decode (128 tokens), so
    # b takes them while it is within max_imbalance requests of the least loaded; then they go elsewhere
    loads = {"a": 0, "b": 0, "c": 0}
    picked = []
    for _ in range(12):
        cands = [Candidate(n, 125 if n == "b" else 0, loads[n]) for n in loads]
        d = choose(cands, POLICY, PAGE, first_page=b"hot", prompt_tokens=DOC)
        loads[d.name] += 1
        picked.append(d.name)
    assert picked[:9] == ["b"] * 9  # 9 in flight on b: one more would be 9 above the idle ones
    assert picked[9] != "b"


def test_with_no_prefix_anywhere_repeats_converge_and_different_documents_spread() -> None:
    cands = [Candidate(n, 0, 0) for n in ("a", "b", "c")]
    first = choose(cands, POLICY, PAGE, first_page=b"new document", prompt_tokens=DOC)
    again = choose(list(reversed(cands)), POLICY, PAGE, first_page=b"new document", turn=7, prompt_tokens=DOC)
    assert first.name == again.name and first.reason == "load"
    spread = Counter(choose(cands, POLICY, PAGE, first_page=f"doc {i}".encode(), prompt_tokens=DOC).name
                     for i in range(300))
    assert set(spread) == {"a", "b", "c"} and min(spread.values()) > 60


def test_with_no_prefix_the_least_loaded_replica_wins_over_the_hash() -> None:
    cands = [Candidate("a", 0, 3), Candidate("b", 0, 1), Candidate("c", 0, 2)]
    assert {choose(cands, POLICY, PAGE, first_page=f"d{i}".encode(), prompt_tokens=DOC).name
            for i in range(50)} == {"b"}


def test_an_unreadable_prompt_falls_back_to_load_and_rotates_among_the_idle() -> None:
    cands = [Candidate("a", 0, 0), Candidate("b", 0, 0), Candidate("c", 0, 5)]
    names = {choose(cands, POLICY, PAGE, readable=False, turn=t).name for t in range(6)}
    assert names == {"a", "b"}
    assert choose(cands, POLICY, PAGE, readable=False).reason == "fallback"


def test_a_prompt_shorter_than_a_page_is_placed_by_load() -> None:
    cands = [Candidate("a", 0, 2), Candidate("b", 0, 0)]
    d = choose(cands, POLICY, PAGE, first_page=None, prompt_tokens=10)
    assert (d.name, d.reason) == ("b", "load")


def test_round_robin_ignores_what_replicas_hold() -> None:
    cands = [Candidate("a", 0, 0), Candidate("b", 500, 0), Candidate("c", 0, 0)]
    rr = Policy(mode="round-robin")
    assert [choose(cands, rr, PAGE, b"x", turn=t).name for t in range(6)] == ["a", "b", "c"] * 2
    assert choose(cands, rr, PAGE, b"x").reason == "round-robin"


def test_no_replica_is_an_error_not_a_guess() -> None:
    with pytest.raises(NoReplicaError):
        choose([], POLICY, PAGE, b"x")


def test_on_a_saturated_fleet_a_holder_keeps_its_document_even_behind_a_long_queue() -> None:
    # no replica is idle; b holds the document but has 9,000 prompt tokens more queued than a. By cost alone
    # (weight 3) a would compute the 2,000 tokens again; but a is busy too: computing them there delays
    # everything queued on a, redoes work the fleet has done and caches the document twice
    cands = [Candidate("a", 0, 2, pending_tokens=1000), Candidate("b", 125, 4, pending_tokens=10000)]
    d = choose(cands, POLICY, PAGE, first_page=b"doc", prompt_tokens=DOC)
    assert (d.name, d.reason) == ("b", "prefix")
    # the same queues, with a idle: idle capacity delays nobody, so it takes the request
    idle = [Candidate("a", 0, 0), Candidate("b", 125, 4, pending_tokens=10000)]
    assert choose(idle, POLICY, PAGE, first_page=b"doc", prompt_tokens=DOC).name == "a"


def test_among_several_holders_the_cheapest_wins() -> None:
    # a hot document spilled over earlier and now sits on a and c: the less loaded holder gets the repeat,
    # never b, which would compute it a third time
    cands = [Candidate("a", 125, 5), Candidate("b", 0, 1, pending_tokens=500), Candidate("c", 125, 2)]
    d = choose(cands, POLICY, PAGE, first_page=b"doc", prompt_tokens=DOC)
    assert (d.name, d.reason) == ("c", "prefix")


def test_a_holder_of_less_than_the_affinity_share_competes_on_cost() -> None:
    # b holds the first 40% of the prompt (a shared preamble, another document after it): it is not a
    # holder, so a busy b loses to a less busy a even though nobody is idle
    cands = [Candidate("a", 0, 1, pending_tokens=500), Candidate("b", 50, 3, pending_tokens=9000)]
    assert choose(cands, POLICY, PAGE, first_page=b"doc", prompt_tokens=DOC).name == "a"
    assert choose(cands, Policy(affinity_share=0.3), PAGE, first_page=b"doc", prompt_tokens=DOC).name == "b"


def test_the_affinity_key_names_the_prompt_past_a_common_first_page() -> None:
    # a chat template puts the same system prompt in every prompt's first page: the key is deeper, so two
    # new documents hash apart while two questions about one document (same first 16 pages) hash together
    system = [b"sys"]
    doc_a = system + [f"a{i}".encode() for i in range(1, 140)]
    doc_b = system + [f"b{i}".encode() for i in range(1, 140)]
    assert affinity_key(doc_a) != affinity_key(doc_b)
    assert affinity_key(doc_a + [b"question 1"]) == affinity_key(doc_a + [b"question 2"])
    assert affinity_key([b"p0", b"p1"]) == b"p1" and affinity_key([]) is None
