"""The responses kept for `previous_response_id` and `GET /v1/responses/{id}`: in memory.

A response created with `store` (OpenAI's default) is kept with the conversation it ended
(its input messages, then its output as an assistant turn), so that a later request can
continue from it. The store is bounded: past `max_responses` the least recently used is
forgotten. Nothing is written to disk: a restarted server knows none of them. With API
keys, a response belongs to its key: another key's lookups find nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from tokenserve.entrypoints.openai.protocol import ChatMessage
from tokenserve.entrypoints.openai.responses_protocol import ResponseObject

DEFAULT_MAX_STORED_RESPONSES = 1024


@dataclass
class StoredResponse:
    response: ResponseObject
    # The conversation up to and including this response's output, without instructions
    # (OpenAI does not carry a response's instructions into the next one).
    messages: list[ChatMessage]
    owner: str | None  # the API key's tenant, when the server has keys


class ResponseStore:
    def __init__(self, max_responses: int = DEFAULT_MAX_STORED_RESPONSES) -> None:
        if max_responses < 1:
            raise ValueError(f"The response store must hold at least 1, got {max_responses}.")
        self.max_responses = max_responses
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._responses)

    def put(self, stored: StoredResponse) -> None:
        self._responses[stored.response.id] = stored
        self._responses.move_to_end(stored.response.id)
        while len(self._responses) > self.max_responses:
            self._responses.popitem(last=False)

    def get(self, response_id: str, owner: str | None) -> StoredResponse | None:
        stored = self._responses.get(response_id)
        if stored is None or stored.owner != owner:
            return None
        self._responses.move_to_end(response_id)
        return stored

    def delete(self, response_id: str, owner: str | None) -> bool:
        if self.get(response_id, owner) is None:
            return False
        del self._responses[response_id]
        return True
