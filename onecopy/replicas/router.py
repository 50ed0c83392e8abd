"""Ray Serve request router of the engine replicas: a conversation's replica first, else the least loaded.

Serve calls `choose_replicas` with the live replicas and the pending request and takes the ranks it
returns in order, the first replica of a rank that still accepts a request (Serve's own cap on
requests in flight). The ingress names its preferences in the request's keyword arguments:
``onecopy_prefer`` (the replica that holds the conversation), ``onecopy_avoid`` (replicas that just
answered 429) and ``onecopy_load`` (each replica's rows in use plus waiting requests, from the
replicas' reports and the requests routed since). A preferred replica that died is simply not among
the candidates, so its conversation goes to the least loaded live one.
"""

from __future__ import annotations

import random

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

PREFER, AVOID, LOAD = "onecopy_prefer", "onecopy_avoid", "onecopy_load"


def rank_replicas(replica_ids: list[str], prefer: str | None, avoid: set[str], load: dict[str, float]) -> list[str]:
    """The order to try replicas in: the preferred one, then by load (ties in random order); avoided
    ones are left out unless all are (then the ingress sees a repeat and answers 429)."""
    usable = [r for r in replica_ids if r not in avoid] or list(replica_ids)
    random.shuffle(usable)  # sorted() is stable: equal loads keep a random order, favouring none
    usable.sort(key=lambda r: load.get(r, 0.0))
    if prefer in usable:
        usable.remove(prefer)
        usable.insert(0, prefer)
    return usable


class SessionAffinityRouter(RequestRouter):
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        kwargs = pending_request.kwargs if pending_request is not None else {}
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        order = rank_replicas(list(by_id), kwargs.get(PREFER), set(kwargs.get(AVOID) or ()), kwargs.get(LOAD) or {})
        return [[by_id[r]] for r in order]
