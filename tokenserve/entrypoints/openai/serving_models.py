"""The models a server answers to: its base model names and its LoRA adapters.

`--lora-modules name=path` (or vLLM's JSON form `{"name": .., "path": ..,
"base_model_name": ..}`) registers adapters at start; a request's `model` picks the base
model or an adapter (404 for neither); /v1/models lists the adapters with their `parent`.
With `--allow-runtime-lora-updating` (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING, here a flag)
/v1/load_lora_adapter and /v1/unload_lora_adapter add and remove adapters while serving.
Every adapter is validated here, in the API process, before it is listed (files, rank,
target shapes against the base: 400); the engine core loads it on its first request.
Each registration gets a fresh `lora_int_id`, so an adapter removed and loaded again under
the same name never meets the KV blocks or slot of the old one.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass

from tokenserve.engine.async_llm import AsyncLLM
from tokenserve.entrypoints.openai.errors import OpenAIError
from tokenserve.entrypoints.openai.protocol import ModelCard, ModelList
from tokenserve.lora.request import LoRARequest


@dataclass(frozen=True)
class LoRAModulePath:
    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(value: str) -> LoRAModulePath:
    """One `--lora-modules` value: `name=path` or a JSON object with name, path and
    optionally base_model_name."""
    text = value.strip()
    if text.startswith("{"):
        try:
            fields = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"--lora-modules {value!r} is not valid JSON: {error}.") from None
        if not isinstance(fields, dict) or not {"name", "path"} <= set(fields):
            raise ValueError(f"--lora-modules {value!r}: the JSON form needs 'name' and 'path'.")
        unknown = set(fields) - {"name", "path", "base_model_name"}
        if unknown:
            raise ValueError(f"--lora-modules {value!r}: unknown key(s) {sorted(unknown)}.")
        name, path, base = fields["name"], fields["path"], fields.get("base_model_name")
    else:
        name, sep, path = text.partition("=")
        if not sep:
            raise ValueError(f"--lora-modules {value!r}: expected name=path or a JSON object.")
        base = None
    if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
        raise ValueError(f"--lora-modules {value!r}: name and path must be non-empty strings.")
    return LoRAModulePath(name, path, base)


class OpenAIServingModels:
    def __init__(
        self,
        engine: AsyncLLM,
        base_model_names: list[str],
        lora_modules: list[LoRAModulePath] | None = None,
        allow_runtime_lora_updating: bool = False,
    ) -> None:
        self.engine = engine
        self.base_model_names = list(base_model_names)
        self.allow_runtime_lora_updating = allow_runtime_lora_updating
        self.lora_requests: dict[str, LoRARequest] = {}
        self._next_id = itertools.count(1)
        if (lora_modules or allow_runtime_lora_updating) and engine.config.lora_config is None:
            raise ValueError("--lora-modules and --allow-runtime-lora-updating need --enable-lora.")
        for module in lora_modules or []:
            self.add_lora(module.name, module.path, module.base_model_name)

    def check_model(self, model: str | None) -> str:
        """The name to answer with; 404 for a model or adapter this server does not serve."""
        if model is None:
            return self.base_model_names[0]
        if model not in self.base_model_names and model not in self.lora_requests:
            raise OpenAIError(
                404, f"The model `{model}` does not exist.", param="model", code="model_not_found"
            )
        return model

    def lora_request(self, model_name: str) -> LoRARequest | None:
        return self.lora_requests.get(model_name)

    def model_list(self) -> ModelList:
        root = self.engine.config.model_config.model
        max_model_len = self.engine.config.model_config.max_model_len
        cards = [
            ModelCard(id=name, root=root, max_model_len=max_model_len)
            for name in self.base_model_names
        ]
        cards += [
            ModelCard(
                id=name,
                root=lora.lora_path,
                parent=lora.base_model_name or self.base_model_names[0],
                max_model_len=max_model_len,
            )
            for name, lora in self.lora_requests.items()
        ]
        return ModelList(data=cards)

    def model_card(self, model_id: str) -> ModelCard:
        """One served model or adapter (GET /v1/models/{id}); 404 for any other id."""
        for card in self.model_list().data:
            if card.id == model_id:
                return card
        raise OpenAIError(
            404, f"The model `{model_id}` does not exist.", param="model", code="model_not_found"
        )

    def add_lora(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Register an adapter after validating it against the base model (ValueError)."""
        if name in self.base_model_names or name in self.lora_requests:
            raise ValueError(f"The lora adapter '{name}' has already been loaded.")
        lora_request = LoRARequest(name, next(self._next_id), path, base_model_name)
        self.engine.processor.check_lora_request(lora_request)
        self.lora_requests[name] = lora_request
        return lora_request

    def load_lora_adapter(self, name: str, path: str) -> str:
        if not name or not path:
            raise OpenAIError(400, "Both 'lora_name' and 'lora_path' must be given.")
        if name in self.lora_requests or name in self.base_model_names:
            raise OpenAIError(
                400, f"The lora adapter '{name}' has already been loaded.", param="lora_name"
            )
        try:
            self.add_lora(name, path)
        except ValueError as error:
            raise OpenAIError(400, str(error), param="lora_path") from None
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload_lora_adapter(self, name: str) -> str:
        if name not in self.lora_requests:
            raise OpenAIError(
                404, f"The lora adapter '{name}' cannot be found.", param="lora_name",
                code="model_not_found",
            )
        del self.lora_requests[name]
        return f"Success: LoRA adapter '{name}' removed successfully."
