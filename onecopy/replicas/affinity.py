"""Which replica holds each conversation, so a follow-up turn goes where its session is kept.

A chat request carries its whole history. Each request's message list is hashed message by message
(a hash chain, so a prefix of messages has one key); after a turn is answered, the key of its full
message list points at the replica that answered it. The next turn's messages start with exactly
those, followed by the reply and the new question: its longest remembered prefix names the replica.
Only a history that holds an assistant turn is a continuation; a new conversation is routed by load,
even when its system prompt matches another's (one prompt shared by every user must not pin them all
to one replica). A Responses API turn names its conversation itself: the replica that answered a
response id (its `RESPONSE_ID_HEADER`) takes the turns on it and its reads.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import OrderedDict
from typing import Any


def message_chain(messages: list[Any]) -> list[bytes]:
    """Key of each prefix of ``messages``: key[i] stands for messages[: i + 1]."""
    keys, h = [], b""
    for m in messages:
        h = hashlib.blake2b(h + json.dumps(m, sort_keys=True, separators=(",", ":")).encode(), digest_size=16).digest()
        keys.append(h)
    return keys


def response_route(path: str, body: Any) -> str | None:
    """The response id a Responses API request continues or reads (``previous_response_id``, or the id in
    ``/v1/responses/{id}...``), to route it where that turn was answered; None otherwise."""
    if path == "/v1/responses":
        prev = body.get("previous_response_id") if isinstance(body, dict) else None
        return prev if isinstance(prev, str) and prev else None
    parts = path.split("/")
    return parts[3] if len(parts) >= 4 and parts[:3] == ["", "v1", "responses"] and parts[3] else None


def chat_messages(body: Any) -> list[Any] | None:
    """The message list of a chat request body, or None when there is none to route by."""
    if not isinstance(body, dict) or not isinstance(body.get("messages"), list) or not body["messages"]:
        return None
    return body["messages"]


class ConversationAffinity:
    """Conversation key -> replica id, least recently used first; entries live ``ttl_s`` (the replicas'
    conversation TTL) and at most ``max_entries`` are kept."""

    def __init__(self, ttl_s: float = 600.0, max_entries: int = 100_000) -> None:
        self.ttl_s, self.max_entries = ttl_s, max_entries
        self._where: OrderedDict[bytes, tuple[str, float]] = OrderedDict()
        self._responses: OrderedDict[str, str] = OrderedDict()  # response id -> the replica that stores it

    def __len__(self) -> int:
        return len(self._where)

    def replica_for(self, messages: list[Any]) -> str | None:
        """The replica that answered this conversation's latest remembered turn, if it continues one."""
        roles = [m.get("role") if isinstance(m, dict) else None for m in messages]
        if "assistant" not in roles:
            return None
        first_turn = roles.index("assistant") - 1  # the shortest history remembered: the first turn's request
        keys, now = message_chain(messages), time.monotonic()
        for i in range(len(keys) - 1, max(first_turn, 0) - 1, -1):
            hit = self._where.get(keys[i])
            if hit is not None and now - hit[1] <= self.ttl_s:
                self._where.move_to_end(keys[i])
                return hit[0]
        return None

    def remember(self, messages: list[Any], replica: str) -> None:
        """``replica`` answered the turn whose request held ``messages``."""
        key = message_chain(messages)[-1]
        self._where[key] = (replica, time.monotonic())
        self._where.move_to_end(key)
        while len(self._where) > self.max_entries:
            self._where.popitem(last=False)

    def replica_of_response(self, response_id: str) -> str | None:
        """The replica that answered the turn ``response_id`` names (the only one that stores it, unless they
        share a --state-dir), if remembered. No TTL: a stored response lives until deleted or evicted there."""
        replica = self._responses.get(response_id)
        if replica is not None:
            self._responses.move_to_end(response_id)
        return replica

    def remember_response(self, response_id: str, replica: str) -> None:
        """``replica`` answered the Responses API turn ``response_id``."""
        self._responses[response_id] = replica
        self._responses.move_to_end(response_id)
        while len(self._responses) > self.max_entries:
            self._responses.popitem(last=False)

    def forget_replica(self, replica: str) -> int:
        """Drop every conversation of a replica that is gone; how many."""
        gone = [k for k, (r, _) in self._where.items() if r == replica]
        for k in gone:
            del self._where[k]
        ids = [k for k, r in self._responses.items() if r == replica]
        for k in ids:
            del self._responses[k]
        return len(gone) + len(ids)
