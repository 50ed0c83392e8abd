"""Routing policy of `onecopy serve --replicas`, without a cluster: conversation affinity, the replica
board behind /health and /metrics, and the router's ranking."""

from prometheus_client import CollectorRegistry, generate_latest

from onecopy.replicas.affinity import ConversationAffinity, message_chain
from onecopy.replicas.board import ReplicaBoard, ReplicaReport
from onecopy.replicas.router import rank_replicas

SYSTEM = {"role": "system", "content": "You are terse."}


def _turns(question, reply="Paris.", follow="And Germany?"):
    first = [SYSTEM, {"role": "user", "content": question}]
    return first, first + [{"role": "assistant", "content": reply}, {"role": "user", "content": follow}]


def test_a_follow_up_turn_finds_the_replica_of_its_first_turn_and_new_conversations_find_none():
    aff = ConversationAffinity()
    first, second = _turns("Capital of France?")
    assert aff.replica_for(first) is None  # nothing remembered yet
    aff.remember(first, "r1")
    assert aff.replica_for(second) == "r1"
    aff.remember(second, "r1")
    third = second + [{"role": "assistant", "content": "Berlin."}, {"role": "user", "content": "Larger?"}]
    assert aff.replica_for(third) == "r1"
    # Same system prompt, new question: a new conversation, routed by load (no replica named).
    other_first, other_second = _turns("Capital of Spain?")
    assert aff.replica_for(other_first) is None and aff.replica_for(other_second) is None
    # An edited history is another conversation.
    assert aff.replica_for(_turns("Capital of France?!")[1]) is None
    assert aff.forget_replica("r1") == 2 and aff.replica_for(third) is None


def test_affinity_entries_expire_and_are_bounded():
    aff = ConversationAffinity(ttl_s=0.0, max_entries=2)
    first, second = _turns("q")
    aff.remember(first, "r1")
    assert aff.replica_for(second) is None  # expired at once
    for i in range(5):
        aff.remember([{"role": "user", "content": str(i)}], "r2")
    assert len(aff) == 2
    assert message_chain(first)[0] == message_chain([SYSTEM])[0] != message_chain(first)[1]


def _report(rid, status="ok", free=3, running=1):
    return ReplicaReport(replica=rid, status=status, rows_total=4, rows_free=free, running=running, waiting=0,
                         conversations=0, device_memory_used_bytes=1 << 20, device="cpu")


def test_the_board_lists_replicas_marks_silent_ones_and_exports_labelled_gauges():
    board = ReplicaBoard(stale_s=60, forget_s=120)
    board.report(_report("a"))
    board.report(_report("b", status="failed", free=0))
    status, body = board.health()
    assert status == 200 and body["status"] == "degraded"
    assert [(r["replica"], r["status"]) for r in body["replicas"]] == [("a", "ok"), ("b", "failed")]
    assert body["rows_free"] == 3  # only live replicas count
    registry = CollectorRegistry()
    registry.register(board)
    text = generate_latest(registry).decode()
    assert 'onecopy_replica_rows_free{replica="a"} 3.0' in text and 'onecopy_replica_up{replica="b"} 0.0' in text
    board.remove("a")
    assert board.health()[0] == 503 and board.health()[1]["status"] == "unavailable"
    silent = ReplicaBoard(stale_s=0.0, forget_s=60)
    silent.report(_report("c"))
    assert silent.replicas()[0]["status"] == "unresponsive" and silent.health()[0] == 503


def test_the_router_ranks_the_conversation_replica_first_then_by_load_and_skips_full_ones():
    ids = ["a", "b", "c"]
    load = {"a": 3, "b": 1, "c": 2}
    assert rank_replicas(ids, None, set(), load) == ["b", "c", "a"]
    assert rank_replicas(ids, "a", set(), load) == ["a", "b", "c"]  # the conversation's replica, however loaded
    assert rank_replicas(ids, "a", {"a", "b"}, load) == ["c"]  # 429 from a and b: the rest only
    assert sorted(rank_replicas(ids, None, set(ids), load)) == ids  # all full: offered again (the ingress stops)
    assert rank_replicas(ids, "gone", set(), load)[0] == "b"  # a dead replica's conversation goes by load
    firsts = {rank_replicas(ids, None, set(), {})[0] for _ in range(200)}
    assert firsts == set(ids)  # equal loads favour none
