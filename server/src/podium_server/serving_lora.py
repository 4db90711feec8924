"""LoRA adapters on the server (vLLM's endpoints): ``POST /v1/load_lora_adapter`` and
``POST /v1/unload_lora_adapter`` with vLLM's bodies (``lora_name``, ``lora_path``), and the model
cards ``/v1/models`` lists for them (``parent``: the base model).

A loaded adapter is a model name: a request whose ``model`` names it runs with it
(``ServingBase.check_model``). Loading reads and checks the folder in the engine (a bad folder, a
rank above ``--max-lora-rank``, a name already loaded: 400 naming it); unloading an adapter that is
not loaded is 404. Requests already running with an adapter finish with it.
"""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import PlainTextResponse, Response

from podium.errors import PodiumError

from .errors import APIError, from_engine_error
from .protocol import LoadLoRAAdapterRequest, ModelCard, UnloadLoRAAdapterRequest
from .serving_base import ServingBase


class LoRAAdaptersHandler(ServingBase):
    async def load(self, request: Request) -> Response:
        req = await self.parse(request, LoadLoRAAdapterRequest)
        self._check_enabled()
        if req.lora_name == self.ctx.model_name or req.lora_name in self.ctx.model_aliases:
            raise APIError(400, f"The LoRA adapter name `{req.lora_name}` is the base model's; choose another",
                           param="lora_name")
        await self._update(req.lora_name, req.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    async def unload(self, request: Request) -> Response:
        req = await self.parse(request, UnloadLoRAAdapterRequest)
        self._check_enabled()
        await self._update(req.lora_name, None)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    def cards(self) -> list[ModelCard]:
        """One card per loaded adapter, its base model as ``parent``."""
        return [ModelCard(id=a.name, root=a.path, parent=self.ctx.model_name, max_model_len=self.ctx.max_model_len)
                for a in self.ctx.engine.lora_adapters.values()]

    async def _update(self, name: str, path: str | None) -> None:
        try:
            await self.ctx.engine.update_lora(name, path)
        except PodiumError as exc:
            raise from_engine_error(exc) from None

    def _check_enabled(self) -> None:
        if not self.ctx.engine.info.lora_enabled:
            raise APIError(400, "this server serves no LoRA adapters; start it with --enable-lora",
                           code="lora_not_enabled")
