"""The gateway's model catalog: which names clients may send as "model", and each one's tokenizer.

The coordinator serves every model that has live workers (coordinator/models.py); its STATUS lists
them (`served_models`) with each one's checkpoint folder (`models`). The catalog reads that list
again when a request names a model it does not know (one just joined), so /v1/models and routing
follow the workers. `--served-model-name` renames the coordinator's default model for clients;
`--model` gives that model's folder when the coordinator's path is not readable here. A tokenizer
(for the text deltas) is loaded per model on its first request, off the event loop, and so is the
pixel budget its image processor gives a document's page (common/documents.py, page_budget).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Awaitable, Callable

from mserve.common.documents import PageBudget, model_page_budget
from mserve.gateway.openai_api import ApiError


class ModelCatalog:
    def __init__(self, status: Callable[[], Awaitable[dict[str, Any]]], served_model_name: str | None,
                 default_folder: str | None) -> None:
        self._status = status  # the coordinator's STATUS (AsyncClient.status)
        self._alias = served_model_name
        self._default_folder = default_folder
        self.default: str | None = None  # the coordinator's default model, as it names it
        self._folders: dict[str, str] = {}  # coordinator name -> checkpoint folder
        self._served: list[str] = []  # coordinator names
        self._tokenizers: dict[str, Any] = {}  # folder -> tokenizer
        self._page_budgets: dict[str, PageBudget | None] = {}  # folder -> model_page_budget
        self._groups: dict[str, list[str]] = {}  # variant group -> its variants (--variant-groups)
        self._verification: dict[str, str | None] = {}  # coordinator name -> "tested" / "verified at load"
        self._modalities: dict[str, list[str]] = {}  # coordinator name -> ["text", "image", "video", "audio"]

    async def refresh(self) -> None:
        status = await self._status()
        self.default = status.get("model")
        per_model = status.get("models") or {}
        folders = {name: str(m.get("model_path") or name) for name, m in per_model.items()}
        if self.default and self.default not in folders:  # a coordinator older than several models
            folders[self.default] = str(status.get("model_path") or self.default)
        if self.default and self._default_folder:
            folders[self.default] = self._default_folder
        self._folders = folders
        self._served = list(status.get("served_models") or ([self.default] if self.default else []))
        self._verification = {name: m.get("verification") for name, m in per_model.items()}
        self._modalities = {name: list(m["modalities"]) for name, m in per_model.items() if m.get("modalities")}
        self._groups = dict(status.get("variant_groups") or {})

    def is_group(self, name: str) -> bool:
        """A variant group's name: the coordinator picks the variant, whose tokenizer reads the answer."""
        return name in self._groups

    def public(self, name: str) -> str:
        """How clients see a coordinator name (the default one under --served-model-name)."""
        return self._alias if self._alias and name == self.default else name

    def verification(self, public_name: str) -> str | None:
        """"tested" (a family with tests here) or "verified at load" (proven by its workers' probe); None
        from a coordinator that does not say."""
        name = self.default if self._alias and public_name == self._alias else public_name
        return self._verification.get(name)

    def modalities(self, public_name: str) -> list[str] | None:
        """What a request to this model may hold; None from a coordinator that does not say."""
        name = self.default if self._alias and public_name == self._alias else public_name
        return self._modalities.get(name)

    def names(self) -> list[str]:
        """The names /v1/models lists, the default model first."""
        order = sorted(self._served, key=lambda n: (n != self.default, n))
        return [self.public(n) for n in order]

    async def resolve(self, requested: str) -> str:
        """The coordinator's name for a client's "model"; 404 naming the served ones when none matches."""
        for attempt in range(2):
            if self._alias and requested == self._alias and self.default:
                return self.default
            if requested in self._served:
                return requested
            if attempt == 0:
                await self.refresh()  # a model whose workers just joined
        served = ", ".join(repr(n) for n in self.names()) or "none"
        raise ApiError(404, f"the model {requested!r} does not exist; this server serves {served}",
                       param="model", code="model_not_found")

    async def tokenizer(self, name: str) -> Any:
        """The tokenizer of a coordinator model name, loaded from its folder the first time."""
        if name not in self._folders:
            await self.refresh()  # a variant that answered before this catalog saw it join
        folder = self._folders.get(name)
        if folder is None or not Path(folder).is_dir():
            raise RuntimeError(f"the gateway needs the checkpoint folder of model {name!r} for its tokenizer: "
                               f"{folder!r} is not a folder here (pass --model for the default model, or run the "
                               "gateway where the workers' checkpoint folders are)")
        if folder not in self._tokenizers:
            from transformers import AutoTokenizer

            self._tokenizers[folder] = await asyncio.to_thread(AutoTokenizer.from_pretrained, folder)
        return self._tokenizers[folder]

    async def page_budget(self, name: str) -> PageBudget | None:
        """The pixels a document page gets for a coordinator model name; None where its folder is not readable
        here (a variant group, a remote checkpoint) or it has no image processor settings."""
        folder = self._folders.get(name)
        if folder is None or not Path(folder).is_dir():
            return None
        if folder not in self._page_budgets:
            self._page_budgets[folder] = await asyncio.to_thread(model_page_budget, folder)
        return self._page_budgets[folder]
