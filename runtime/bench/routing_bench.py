"""Prefix-aware routing against round-robin: real replicas of ``kvdrive serve`` behind ``kvdrive route``.

Each run starts ``replicas`` fresh demo-model replicas (small tiers, their own SSD directories, one compute
thread each) and a router with the run's policy, then drives ``clients`` streaming clients for ``seconds``
with the same requests (``routing_workload``). Measured per run: client TTFT (all, and per kind), errors,
completion tokens/s, and from the replicas' own counters the prompt tokens received, the pages reused and
so the prefill tokens computed; from the router, its decisions by reason.

With ``kv_events`` one more prefix run has the replicas publish KV events, which the router follows instead
of polling their page lists (``kvdrive.router.kv_event_feed``): its reuse is compared with the polling run's.

The fault run repeats the prefix run and, during it, kills one replica (SIGKILL: its in-flight requests
are lost), restarts it, then kills and restarts the router; it reports the requests lost, how long the
router kept the dead replica in service, when it rejoined, and how soon prefix hits resumed after the
router's restart.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

from kvdrive.runtime.bench.routing_fleet import Counters, Fleet, metrics_of
from kvdrive.runtime.bench.routing_workload import Sample, Workload, percentiles, run_clients

PAGE = 16


@dataclass(frozen=True)
class RunResult:
    policy: str
    seconds: float
    requests: int
    errors: int
    completion_tokens: int
    tokens_per_s: float
    ttft_ms: dict[str, float]
    ttft_ms_by_kind: dict[str, dict[str, float]]
    prompt_tokens: int  # received by the replicas
    prefix_pages_reused: int
    prefill_tokens_computed: int
    decisions: dict[str, float]
    per_replica_prompt_tokens: list[int]
    faults: dict[str, object] = field(default_factory=dict)
    # per answered request ("c{client}-{n}", the same prompt in every run): prompt tokens it computed
    # (its prompt minus usage.prompt_tokens_details.cached_tokens), to compare runs on the same requests
    computed_by_request: dict[str, int] = field(default_factory=dict)


@dataclass
class RoutingBenchResult:
    replicas: int
    clients: int
    seconds: float
    workload: dict[str, object]
    runs: list[RunResult] = field(default_factory=list)
    host: str = ""
    replica_ssd: str = "1GiB"  # each replica's --ssd-budget
    affinity_share: float = 0.5  # the prefix router's --affinity-share


def _summary(policy: str, samples: list[Sample], fleet: Fleet, counters: Counters) -> RunResult:
    ok = [s for s in samples if s.error is None]
    seconds = max((s.end for s in samples), default=1.0)  # the last answer's end: in-flight ones are waited for
    prompt = [int(counters.of(r, "kvdrive_prompt_tokens_total")) for r in fleet.replicas]
    hits = [int(counters.of(r, "kvdrive_prefix_hit_pages_total")) for r in fleet.replicas]
    kinds = sorted({s.kind for s in ok})
    return RunResult(
        policy, seconds, len(samples), len(samples) - len(ok), sum(s.tokens for s in ok),
        sum(s.tokens for s in ok) / seconds, percentiles([s.ttft for s in ok if s.ttft is not None]),
        {k: percentiles([s.ttft for s in ok if s.kind == k and s.ttft is not None]) for k in kinds},
        sum(prompt), sum(hits), sum(prompt) - PAGE * sum(hits),
        counters.labelled(fleet.router, "kvdrive_router_decisions_total", "reason"), prompt,
        computed_by_request={s.request: s.prompt_tokens - s.cached_tokens for s in ok if s.cached_tokens is not None})


def _decisions(router_url: str) -> dict[str, float]:
    m = metrics_of(router_url)
    return {k.split('reason="')[1].rstrip('"}'): v for k, v in m.items() if k.startswith("kvdrive_router_decisions")}


async def _fault_script(fleet: Fleet, seconds: float, log: dict[str, object]) -> None:
    """Kill a replica at 30% of the run, restart it at 50%, restart the router at 70%."""
    loop = asyncio.get_running_loop()
    began = loop.time()
    victim = fleet.replicas[1]

    async def at(frac: float) -> None:
        await asyncio.sleep(max(0.0, began + frac * seconds - loop.time()))

    def up() -> float:
        return metrics_of(fleet.router.url).get(f'kvdrive_router_backend_up{{backend="{victim.url}"}}', 0.0)

    await at(0.3)
    victim.kill()
    t_kill = loop.time()
    log["replica_killed_at_s"] = round(t_kill - began, 1)
    while await asyncio.to_thread(up) and loop.time() - t_kill < 30:
        await asyncio.sleep(0.1)
    log["router_took_it_out_after_s"] = round(loop.time() - t_kill, 2)
    await at(0.5)
    t_restart = loop.time()
    await asyncio.to_thread(victim.start)
    while not await asyncio.to_thread(up) and loop.time() - t_restart < 60:
        await asyncio.sleep(0.1)
    log["replica_restarted_at_s"] = round(t_restart - began, 1)
    log["rejoined_after_restart_s"] = round(loop.time() - t_restart, 2)
    await at(0.7)
    fleet.router.kill()
    t_router = loop.time()
    log["router_killed_at_s"] = round(t_router - began, 1)
    await asyncio.to_thread(fleet.router.start)
    log["router_back_after_s"] = round(loop.time() - t_router, 2)
    base = (await asyncio.to_thread(_decisions, fleet.router.url)).get("prefix", 0.0)
    while (await asyncio.to_thread(_decisions, fleet.router.url)).get("prefix", 0.0) <= base \
            and loop.time() - t_router < 60:
        await asyncio.sleep(0.2)
    log["first_prefix_hit_after_router_restart_s"] = round(loop.time() - t_router, 2)


def _run(root: Path, policy: str, args: RunArgs, seconds: float, with_faults: bool,
         kv_events: bool = False) -> RunResult:
    fleet = Fleet(root, args.replicas, policy, args.threads, args.ssd_budget,
                  ("--affinity-share", str(args.affinity_share)), kv_events=kv_events)
    try:
        fleet.start()
        bar = tqdm(desc=f"{policy}{' + faults' if with_faults else ''}: requests", unit="req")
        faults: dict[str, object] = {}

        async def go() -> list[Sample]:
            clients = run_clients(fleet.router.url, "demo", args.workload, args.clients, seconds, {},
                                  lambda n: bar.update(1))
            if not with_faults:
                return await clients
            samples, _ = await asyncio.gather(clients, _fault_script(fleet, seconds, faults))
            return samples

        with Counters([*fleet.replicas, fleet.router], ("kvdrive_prompt_tokens", "kvdrive_prefix_hit_pages",
                                                        "kvdrive_router_decisions")) as counters:
            samples = asyncio.run(go())
        bar.close()
        result = _summary(policy + (" + kv events" if kv_events else ""), samples, fleet, counters)
        if with_faults:
            faults.update(_fault_counts(samples, faults))
            result = RunResult(**{**asdict(result), "faults": faults})
        return result
    finally:
        fleet.stop()


def _fault_counts(samples: list[Sample], log: dict[str, object]) -> dict[str, object]:
    """Errors by cause: requests in flight on the killed replica when it died, requests in flight through
    the router when it was killed or sent while it was down, and any other."""
    killed = float(log.get("replica_killed_at_s", -1))
    router_at = float(log.get("router_killed_at_s", -1))
    router_back = router_at + float(log.get("router_back_after_s", 0))
    failed = [s for s in samples if s.error]
    lost = [s for s in failed if s.start < killed <= s.end]
    through = [s for s in failed if s not in lost and s.start < router_at <= s.end]
    refused = [s for s in failed if s not in lost and s not in through and router_at <= s.start <= router_back + 1]
    return {"errors": len(failed), "lost_in_flight_on_the_killed_replica": len(lost),
            "lost_in_flight_through_the_killed_router": len(through),
            "refused_while_the_router_was_down (clients retry every 0.5 s)": len(refused),
            "other_errors": len(failed) - len(lost) - len(through) - len(refused),
            "error_examples": sorted({(s.error or "")[:100] for s in failed})[:5]}


@dataclass(frozen=True)
class RunArgs:
    replicas: int
    clients: int
    threads: int
    workload: Workload
    ssd_budget: str = "1GiB"
    affinity_share: float = 0.5  # the prefix router's --affinity-share (above 1: by cost alone)


def run_routing_bench(work_dir: str, replicas: int = 3, clients: int = 16, seconds: float = 120.0,
                      threads: int = 1, faults: bool = True, seed: int = 0,
                      fault_seconds: float = 120.0, ssd_budget: str = "1GiB",
                      affinity_share: float = 0.5, kv_events: bool = False,
                      policies: tuple[str, ...] = ("round-robin", "prefix")) -> RoutingBenchResult:
    """``kv_events``: one more prefix run whose replicas publish KV events (the router follows them)."""
    args = RunArgs(replicas, clients, threads, Workload(seed=seed), ssd_budget, affinity_share)
    root = Path(work_dir) / f"run-{int(time.time())}"
    out = RoutingBenchResult(replicas, clients, seconds, asdict(args.workload), host=os.uname().nodename,
                             replica_ssd=ssd_budget, affinity_share=affinity_share)
    for policy in policies:
        out.runs.append(_run(root / policy, policy, args, seconds, with_faults=False))
    if kv_events:
        out.runs.append(_run(root / "prefix-events", "prefix", args, seconds, with_faults=False, kv_events=True))
    if faults:
        out.runs.append(_run(root / "prefix-faults", "prefix", args, fault_seconds, with_faults=True))
    return out
