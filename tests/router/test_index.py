"""The router's prefix index: what each replica's poll reports, what routed prompts taught it, and
forgetting (evictions, restarts, replicas leaving); pages in the fleet's shared tier, which every replica can
reuse."""

from __future__ import annotations

from kvdrive.router.index import Match, PrefixIndex
from kvdrive.runtime.protocol.kv_event_wire import SHARED_MEDIUM, fold

DOC = [bytes([i]) * 16 for i in range(10)]


def test_a_match_is_the_run_of_leading_pages_held_and_stops_at_the_first_gap() -> None:
    index = PrefixIndex()
    index.replace("a", DOC[:3] + DOC[5:], polled_at=0.0)
    assert index.matched("a", DOC) == 3
    assert index.matched("b", DOC) == 0


def test_a_poll_replaces_what_was_known_so_evicted_pages_are_forgotten() -> None:
    index = PrefixIndex()
    index.replace("a", DOC, polled_at=0.0)
    index.replace("a", DOC[:2], polled_at=5.0)  # the replica evicted the rest
    assert index.matched("a", DOC) == 2


def test_pages_learned_from_a_routed_prompt_count_at_once_and_survive_an_older_poll() -> None:
    index = PrefixIndex(recent_seconds=10.0)
    index.learn("a", DOC, now=3.0)
    assert index.matched("a", DOC) == 10
    index.replace("a", [], polled_at=2.0)  # a poll that started before the prompt went in
    assert index.matched("a", DOC) == 10
    index.replace("a", DOC[:4], polled_at=4.0)  # one that started after: the replica's word wins
    assert index.matched("a", DOC) == 4


def test_learned_pages_expire_unless_a_poll_confirms_them() -> None:
    index = PrefixIndex(recent_seconds=10.0)
    index.learn("a", DOC, now=0.0)
    index.expire(now=9.0)
    assert index.matched("a", DOC) == 10
    index.expire(now=11.0)
    assert index.matched("a", DOC) == 0


def test_a_replica_that_restarts_or_leaves_is_forgotten() -> None:
    index = PrefixIndex()
    index.replace("a", DOC, polled_at=0.0)
    index.learn("a", DOC, now=1.0)
    index.forget("a")
    assert index.matched("a", DOC) == 0 and index.pages("a") == 0


def test_a_prompt_in_flight_stays_on_its_replica_through_polls_until_it_ends() -> None:
    """The router sent a document to a; for the minute a's queue and prefill take, a's polls cannot list
    pages it has not computed. A repeat meanwhile must still find them on a, or it is sent elsewhere and
    computed twice. Once the request ends they are learned then: a poll that started later decides."""
    index = PrefixIndex(recent_seconds=10.0)
    index.pin("a", DOC)
    for t in (2.0, 30.0, 55.0):  # polls (each started after the request was sent) and expiry
        index.replace("a", [], polled_at=t)
        index.expire(now=t)
        assert index.matched("a", DOC) == 10
    index.unpin("a", DOC, now=60.0)
    index.replace("a", [], polled_at=59.0)  # started before the request ended: not the last word
    assert index.matched("a", DOC) == 10
    index.replace("a", DOC[:6], polled_at=61.0)  # a evicted some since: the replica's word wins
    assert index.matched("a", DOC) == 6


def test_two_requests_pin_a_page_twice_and_a_refused_one_teaches_nothing() -> None:
    index = PrefixIndex()
    index.pin("a", DOC)
    index.pin("a", DOC[:5])  # a second question about the same document start
    index.unpin("a", DOC[:5], now=1.0, learned=False)  # refused (429): a did not take it
    index.replace("a", [], polled_at=2.0)
    assert index.matched("a", DOC) == 10  # the first request still pins all ten
    index.unpin("a", DOC, now=3.0, learned=False)  # it failed before answering
    assert index.matched("a", DOC) == 0 and index.pages("a") == 0


def test_a_forgotten_replica_drops_its_pins_and_a_late_unpin_is_harmless() -> None:
    index = PrefixIndex()
    index.pin("a", DOC)
    index.forget("a")  # restarted: what it was computing is gone with it
    assert index.matched("a", DOC) == 0
    index.unpin("a", DOC, now=1.0)  # the request through it ends afterwards
    assert index.matched("a", DOC) == 0


# --- the fleet's shared tier (KV events' EXTERNAL medium) -------------------------------------------------------
def _folded(digests: list[bytes]) -> list[int]:
    return [fold(d) for d in digests]


def test_a_page_in_the_shared_tier_is_reachable_from_every_replica_and_counted_apart() -> None:
    """a published the document's first 6 pages to the shared tier; b holds the first 3 itself. Every replica,
    even one that announced nothing, can reuse 6 pages; what only the shared tier holds is counted apart (it
    costs a fetch), and it is nobody's local page."""
    index = PrefixIndex()
    index.events_stored("a", _folded(DOC[:6]), SHARED_MEDIUM)
    index.events_stored("b", DOC[:3], "GPU")  # whole digests: the same pages as their low 64 bits
    assert index.match("a", DOC) == Match(pages=6, shared=6)
    assert index.match("c", DOC) == Match(pages=6, shared=6)
    assert index.match("b", DOC) == Match(pages=6, shared=3)
    assert index.matched("c", DOC) == 6
    assert index.pages("a") == 0 and index.pages("b") == 3 and index.shared() == 6
    # a run stops at the first page neither the replica nor the shared tier holds
    index.events_stored("b", DOC[7:9], "CPU")
    assert index.match("b", DOC) == Match(pages=6, shared=3)


def test_a_page_removed_from_the_shared_tier_is_gone_for_every_replica_and_only_there() -> None:
    index = PrefixIndex()
    index.events_stored("a", _folded(DOC[:6]), SHARED_MEDIUM)
    index.events_stored("b", _folded(DOC[:4]), SHARED_MEDIUM)  # b published them too
    index.events_stored("b", _folded(DOC[:4]), "GPU")
    # c, which announced none of them, fetched page 3 and missed: the store evicted it
    index.events_removed("c", _folded(DOC[3:4]), SHARED_MEDIUM)
    assert index.match("a", DOC) == Match(pages=3, shared=3)
    assert index.match("c", DOC) == Match(pages=3, shared=3)
    assert index.match("b", DOC) == Match(pages=6, shared=2)  # its own copy of page 3 is untouched
    assert index.shared() == 5
    index.events_removed("b", _folded(DOC[:2]), "GPU")  # gone from b's GPU: the shared copies stay
    assert index.match("b", DOC) == Match(pages=6, shared=4)
    assert index.match("c", DOC) == Match(pages=3, shared=3)


def test_a_replica_that_leaves_withdraws_only_its_own_shared_announcements() -> None:
    """A shared page stays while some replica's announcement of it stands: a and b both announced the first 4
    pages, c the next 2. a leaving, or b starting its events over, keeps what another replica announced."""
    index = PrefixIndex()
    index.events_stored("a", _folded(DOC[:4]), SHARED_MEDIUM)
    index.events_stored("b", _folded(DOC[:4]), SHARED_MEDIUM)
    index.events_stored("c", _folded(DOC[4:6]), SHARED_MEDIUM)
    index.forget("a")
    assert index.match("x", DOC) == Match(pages=6, shared=6)
    index.forget("c")  # the only one that announced pages 4 and 5
    assert index.match("x", DOC) == Match(pages=4, shared=4)
    index.events_cleared("b")  # a new life of b: it announces what it publishes from now on
    assert index.match("x", DOC) == Match(pages=0, shared=0) and index.shared() == 0


def test_the_shared_pages_remembered_are_bounded_the_oldest_announced_forgotten_first() -> None:
    index = PrefixIndex(shared_pages=3)
    index.events_stored("a", _folded(DOC[:3]), SHARED_MEDIUM)
    index.events_stored("b", _folded(DOC[:1]), SHARED_MEDIUM)  # announced again: now the newest
    index.events_stored("a", _folded(DOC[3:4]), SHARED_MEDIUM)  # a fourth: the oldest, page 1, goes
    assert index.shared() == 3
    assert index.match("x", DOC) == Match(pages=1, shared=1)
    assert index.match("x", DOC[2:]) == Match(pages=2, shared=2)
