"""Admission under `max_loras`: a step never holds more distinct adapters than the
workers have slots.

Every running request is in every step (its decode row, or its next prompt chunk), so
the bound is on the running requests plus those a step admits. Waiting requests whose
adapter would be one too many are passed over and keep their place in the queue, as
vLLM's scheduler does; base-model requests and those of adapters already running pass.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenserve.core.request import Request


def running_adapters(running: Iterable[Request]) -> set[int]:
    return {r.lora_request.lora_int_id for r in running if r.lora_request is not None}


def admissible_by_adapter(
    candidates: Iterable[Request], running: Iterable[Request], max_loras: int
) -> Iterable[Request]:
    """The candidates, in order, that fit `max_loras` together with the running requests
    and the candidates before them (counted as admitted: never more than the bound)."""
    adapters = running_adapters(running)
    for request in candidates:
        lora = request.lora_request
        if lora is None or lora.lora_int_id in adapters:
            yield request
        elif len(adapters) < max_loras:
            adapters.add(lora.lora_int_id)
            yield request
