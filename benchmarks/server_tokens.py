"""The server's own tokenizer, over HTTP: `POST /tokenize` counts a prompt's tokens and
`POST /detokenize` spells token ids as text (both vLLM and pdserve answer them), so `pdserve bench`
needs no tokenizer of its own and counts as the server does."""

from __future__ import annotations

import httpx


class ServerTokens:
    def __init__(self, base_url: str, api_key: str | None = None) -> None:
        self.base_url = base_url
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def count(self, text: str) -> int:
        return self._post("/tokenize", {"prompt": text})["count"]

    def text(self, token_ids: list[int]) -> str:
        return self._post("/detokenize", {"tokens": token_ids})["prompt"]

    def _post(self, path: str, body: dict) -> dict:
        url = self.base_url + path
        try:
            response = httpx.post(url, json=body, headers=self.headers, timeout=60)
        except httpx.HTTPError as error:
            raise RuntimeError(f"{url}: {error}") from None
        if response.status_code != 200:
            raise RuntimeError(f"{url} answered {response.status_code} (the dataset needs the server's "
                               f"/tokenize and /detokenize): {response.text[:200]}")
        return response.json()
