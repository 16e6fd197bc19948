"""Scenarios for the router's choice of replica (``kvdrive.router.selection.choose``): a pure function of
what each replica holds of the prompt (or could fetch from the fleet's shared tier), the prefill already routed
to it and how many requests it runs; and the router's ``pick``, which feeds it from the prefix index."""

from __future__ import annotations

import argparse
from collections import Counter

import pytest

from kvdrive.router.backends import RoutingInfo
from kvdrive.router.cli import add_parser
from kvdrive.router.core import Router, RouterConfig
from kvdrive.router.discovery import StaticDiscovery
from kvdrive.router.index import Match
from kvdrive.router.selection import Candidate, NoReplicaError, Policy, affinity_key, choose
from kvdrive.runtime.protocol.kv_event_wire import SHARED_MEDIUM, fold

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


# --- the fleet's shared tier -------------------------------------------------------------------------------------
def test_a_prefix_only_in_the_shared_tier_is_worth_something_and_less_than_a_local_copy() -> None:
    # three idle replicas: a holds nothing, b could fetch the whole document from the shared tier, c holds it
    fetch = Candidate("b", 125, 0, shared_pages=125)
    assert choose([Candidate("a", 0, 0), fetch], POLICY, PAGE, first_page=b"doc", prompt_tokens=DOC).name == "b"
    d = choose([Candidate("a", 0, 0), fetch, Candidate("c", 125, 0)], POLICY, PAGE, first_page=b"doc",
               prompt_tokens=DOC)
    assert (d.name, d.reason, d.matched_tokens, d.shared_tokens) == ("c", "prefix", 2000, 0)
    # at weight 0 the shared tier is ignored: a and b tie, and each document's hash decides
    ignore = Policy(shared_weight=0.0)
    picks = {choose([Candidate("a", 0, 0), fetch], ignore, PAGE, first_page=f"doc {i}".encode(),
                    prompt_tokens=DOC).name for i in range(40)}
    assert picks == {"a", "b"}


def test_a_replica_holding_the_prefix_keeps_it_though_every_other_could_fetch_it() -> None:
    # the document is in the shared tier, so every replica can reuse it; b also holds it itself and runs 3
    # requests: it is still the holder, where the others would fetch 2,000 tokens first
    cands = [Candidate("a", 125, 1, shared_pages=125), Candidate("b", 125, 3),
             Candidate("c", 125, 1, shared_pages=125)]
    d = choose(cands, POLICY, PAGE, first_page=b"doc", prompt_tokens=DOC)
    assert (d.name, d.reason) == ("b", "prefix")
    # part local: b holds the first 10 pages and would fetch the rest, like everyone else: it still saves the most
    part = [Candidate("a", 125, 0, shared_pages=125), Candidate("b", 125, 0, shared_pages=115)]
    d = choose(part, POLICY, PAGE, first_page=b"doc", prompt_tokens=DOC)
    assert (d.name, d.reason) == ("b", "prefix")


def test_a_prefix_only_in_the_shared_tier_leaves_the_choice_to_load() -> None:
    # every replica would fetch the same document: it is common to all, like a system prompt, so load decides
    cands = [Candidate(n, 125, load, shared_pages=125) for n, load in (("a", 2), ("b", 0), ("c", 1))]
    d = choose(cands, POLICY, PAGE, first_page=b"doc", prompt_tokens=DOC)
    assert (d.name, d.reason, d.matched_tokens, d.shared_tokens) == ("b", "load", 2000, 2000)
    idle = [Candidate(n, 125, 0, shared_pages=125) for n in ("a", "b", "c")]
    spread = Counter(choose(idle, POLICY, PAGE, first_page=f"doc {i}".encode(), prompt_tokens=DOC).name
                     for i in range(300))
    assert set(spread) == {"a", "b", "c"}  # ties by the document's hash, as with no prefix anywhere


def _router(roots: dict[str, bytes]) -> Router:
    router = Router(RouterConfig(), StaticDiscovery(tuple(roots)))
    router.pool.set_urls(roots)
    for url, root in roots.items():
        router.pool.backends[url].info = RoutingInfo("demo", root, PAGE, "i-" + url)
    return router


def test_the_router_s_pick_counts_shared_pages_for_every_replica_of_the_root() -> None:
    """``Router.pick``, which the HTTP proxy and the ext_proc endpoint picker both call: pages a announced in the
    shared tier count for b, which announced nothing, and not for c, a replica of another model (its prompt's
    pages chain from another root)."""
    root, other = bytes(16), bytes([1]) * 16
    router = _router({"http://a": root, "http://b": root, "http://c": other})
    tokens = list(range(3, 3 + 40 * PAGE))
    digests = router.digests_for(tokens)
    mine = digests[(root, PAGE)]
    router.index.events_stored("http://a", [fold(d) for d in mine[:30]], SHARED_MEDIUM)
    router.pool.backends["http://a"].in_flight = 1
    router.pool.backends["http://c"].in_flight = 0
    _, d, _ = router.pick(digests, exclude=set(), prompt_tokens=len(tokens))
    assert (d.name, d.reason, d.matched_tokens, d.shared_tokens) == ("http://b", "prefix", 30 * PAGE, 30 * PAGE)
    assert router.index.match("http://c", digests[(other, PAGE)]).pages == 0
    # b holds the first 20 pages itself (say it fetched them): it is picked over a, which would fetch them all
    router.index.events_stored("http://b", mine[:20], "GPU")
    router.pool.backends["http://a"].in_flight = 0
    router.pool.backends["http://b"].in_flight = 1
    _, d, _ = router.pick(digests, exclude=set(), prompt_tokens=len(tokens))
    assert (d.name, d.matched_tokens, d.shared_tokens) == ("http://b", 30 * PAGE, 10 * PAGE)
    # gone from the store (some replica's fetch missed): nobody can reuse them; b keeps its own
    router.index.events_removed("http://c", [fold(d) for d in mine[:30]], SHARED_MEDIUM)
    assert [router.index.match(u, mine) for u in ("http://a", "http://b")] == [Match(0, 0), Match(20, 0)]


def test_the_shared_tier_weight_is_a_flag_of_kvdrive_route_below_one() -> None:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    assert parser.parse_args(["route", "--backend", "http://a"]).shared_tier_weight == 0.5
    assert parser.parse_args(["route", "--shared-tier-weight", "0.25"]).shared_tier_weight == 0.25
    assert parser.parse_args(["route", "--shared-tier-weight", "0"]).shared_tier_weight == 0.0
    for bad in ("1", "1.5", "-0.1", "nan"):
        with pytest.raises(SystemExit):
            parser.parse_args(["route", "--shared-tier-weight", bad])
