"""Whether a request's new tokens end it: EOS, stop token ids, its grammar, max_tokens and
max_model_len, checked after every token, so that a step that brings several new tokens
(accepted drafts) ends the request at the first stop among them.
"""

from __future__ import annotations

from tokenserve.core.request import Request, RequestStatus


def append_until_stop(request: Request, token_ids: list[int], max_model_len: int) -> list[int]:
    """Append `token_ids` one at a time (advancing the request's grammar too), checking the
    stop conditions after each; those after the first stop are not appended. Returns the
    tokens that were."""
    for num_appended, token_id in enumerate(token_ids, 1):
        request.append_output_token_ids([token_id])
        if request.structured_output_request is not None:
            request.structured_output_request.accept_tokens(
                request.request_id, request.output_token_ids, 1
            )
        check_stop(request, max_model_len)
        if request.is_finished:
            return token_ids[:num_appended]
    return token_ids


def check_stop(request: Request, max_model_len: int) -> None:
    """Whether the request's last token ends it: if so its status (and stop_reason) say how."""
    params = request.sampling_params
    last_token = request.output_token_ids[-1]
    if request.num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and last_token == request.eos_token_id:
            request.status = RequestStatus.FINISHED_STOPPED
            return
        if last_token in (params.stop_token_ids or ()):
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last_token
            return
    if request.structured_output_request is not None and (
        request.structured_output_request.is_terminated()
    ):
        # The grammar is complete and accepted its stop token (even with ignore_eos).
        request.status = RequestStatus.FINISHED_STOPPED
        return
    if (params.max_tokens is not None and request.num_output_tokens >= params.max_tokens) or (
        request.num_tokens >= max_model_len
    ):
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
