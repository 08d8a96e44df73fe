"""Engine logprobs (per position: token id → Logprob) in the two OpenAI shapes.

/v1/completions lists tokens, their logprobs, their top alternatives as {token: logprob}
and each token's character offset in the text. /v1/chat/completions lists one entry per
token with its bytes and its `top_logprobs` most likely alternatives.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tokenserve.entrypoints.openai.protocol import (
    ChatCompletionLogProbs,
    ChatLogProb,
    ChatLogProbsContent,
    CompletionLogProbs,
)
from tokenserve.outputs import Logprob, LogprobsDict

DecodeToken = Callable[[int], str]


def _token_text(token_id: int, logprob: Logprob | None, decode: DecodeToken) -> str:
    if logprob is not None and logprob.decoded_token is not None:
        return logprob.decoded_token
    return decode(token_id)


def _by_rank(position: LogprobsDict) -> list[tuple[int, Logprob]]:
    return sorted(position.items(), key=lambda item: item[1].rank or 0)


def completion_logprobs(
    token_ids: Sequence[int],
    positions: Sequence[LogprobsDict | None],
    decode: DecodeToken,
    initial_text_offset: int = 0,
) -> CompletionLogProbs:
    """`positions[i]` belongs to `token_ids[i]`; None (a prompt's first token) has no logprob."""
    result = CompletionLogProbs()
    offset = initial_text_offset
    for token_id, position in zip(token_ids, positions):
        chosen = position.get(token_id) if position is not None else None
        token = _token_text(token_id, chosen, decode)
        result.tokens.append(token)
        result.token_logprobs.append(chosen.logprob if chosen is not None else None)
        top: dict[str, float] | None = None
        if position is not None:
            top = {}
            for top_id, top_logprob in _by_rank(position):
                # Tokens can share a text (e.g. partial UTF-8 bytes); the likeliest one wins.
                top.setdefault(_token_text(top_id, top_logprob, decode), top_logprob.logprob)
        result.top_logprobs.append(top)
        result.text_offset.append(offset)
        offset += len(token)
    return result


def chat_logprobs(
    token_ids: Sequence[int],
    positions: Sequence[LogprobsDict | None],
    num_top_logprobs: int,
    decode: DecodeToken,
) -> ChatCompletionLogProbs:
    content = []
    for token_id, position in zip(token_ids, positions):
        if position is None:
            continue
        chosen = position.get(token_id)
        token = _token_text(token_id, chosen, decode)
        top = [
            _chat_logprob(_token_text(tid, lp, decode), lp.logprob)
            for tid, lp in _by_rank(position)[:num_top_logprobs]
        ]
        entry = _chat_logprob(token, chosen.logprob if chosen is not None else float("-inf"))
        content.append(ChatLogProbsContent(**entry.model_dump(), top_logprobs=top))
    return ChatCompletionLogProbs(content=content)


def _chat_logprob(token: str, logprob: float) -> ChatLogProb:
    # -inf is not JSON; OpenAI reports the least possible logprob as -9999.0.
    return ChatLogProb(
        token=token, logprob=max(logprob, -9999.0), bytes=list(token.encode("utf-8"))
    )
