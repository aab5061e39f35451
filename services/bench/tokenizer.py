"""Token ids for building prompts: from the server under test, or from a local tokenizer.

The server route keeps the bench usable against any OpenAI-compatible server without a copy
of its tokenizer. Three wire dialects exist in the wild and are probed in order:
vLLM and pdmesh (`/tokenize {"prompt"}`, `/detokenize -> {"prompt"}`), llama.cpp's own server
(`/tokenize {"content"}`, `/detokenize -> {"content"}`) and llama-cpp-python
(`/extras/tokenize {"input"}`, `/extras/detokenize -> {"text"}`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import aiohttp


class TokenCodec(Protocol):
    """Anything that turns text into token ids and back (no special tokens added)."""

    source: str

    async def encode(self, text: str) -> list[int]: ...

    async def decode(self, ids: list[int]) -> str: ...


@dataclass(frozen=True)
class Dialect:
    name: str
    tokenize_path: str
    detokenize_path: str
    text_field: str  # request field that carries the text to tokenize
    decoded_field: str  # response field that carries the detokenized text


DIALECTS = (
    Dialect("vllm", "/tokenize", "/detokenize", "prompt", "prompt"),
    Dialect("llama.cpp", "/tokenize", "/detokenize", "content", "content"),
    Dialect("llama-cpp-python", "/extras/tokenize", "/extras/detokenize", "input", "text"),
)


class TokenizerError(RuntimeError):
    pass


class ServerTokenizer:
    """Tokenizes through the server's own endpoints in one dialect (see the module docstring)."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, model: str,
                 dialect: Dialect, headers: dict[str, str]) -> None:
        self._session = session
        self._base = base_url.rstrip("/")
        self._model = model
        self._dialect = dialect
        self._headers = headers
        self.source = f"server:{dialect.name}"

    async def encode(self, text: str) -> list[int]:
        body = {"model": self._model, self._dialect.text_field: text,
                "add_special_tokens": False, "add_special": False}
        data = await self._post(self._dialect.tokenize_path, body)
        tokens = data.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise TokenizerError(f"{self._dialect.tokenize_path} returned no token list")
        return tokens

    async def decode(self, ids: list[int]) -> str:
        data = await self._post(self._dialect.detokenize_path, {"model": self._model, "tokens": ids})
        text = data.get(self._dialect.decoded_field)
        if not isinstance(text, str):
            raise TokenizerError(f"{self._dialect.detokenize_path} returned no text")
        return text

    async def _post(self, path: str, body: dict[str, object]) -> dict[str, object]:
        async with self._session.post(self._base + path, json=body, headers=self._headers) as resp:
            if resp.status != 200:
                raise TokenizerError(f"{path}: HTTP {resp.status}")
            data = await resp.json(content_type=None)
        if not isinstance(data, dict):
            raise TokenizerError(f"{path}: expected a JSON object")
        return data


class LocalTokenizer:
    """A HF `tokenizers` tokenizer.json, found from a file, a directory or a pdmesh model name."""

    def __init__(self, name_or_path: str) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(_tokenizer_json(name_or_path)))
        self.source = f"local:{name_or_path}"

    async def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    async def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)


def _tokenizer_json(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if not path.exists():
        # A model name: pdmesh's registry knows where its converted HF directory lives.
        from shared.model.registry import resolve_model

        resolved = resolve_model(name_or_path)
        path = Path(getattr(resolved, "path", resolved))
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise TokenizerError(f"no tokenizer.json for {name_or_path!r} (looked at {path})")
    return path


async def probe_server(session: aiohttp.ClientSession, base_url: str, model: str,
                       headers: dict[str, str]) -> ServerTokenizer | None:
    """The first dialect whose tokenize/detokenize round trip works, else None."""
    for dialect in DIALECTS:
        tok = ServerTokenizer(session, base_url, model, dialect, headers)
        try:
            ids = await tok.encode("hello world")
            if ids:
                await tok.decode(ids)
                return tok
        except (TimeoutError, TokenizerError, aiohttp.ClientError, ValueError):
            continue
    return None


async def connect(session: aiohttp.ClientSession, base_url: str, model: str,
                  headers: dict[str, str], local: str | None) -> TokenCodec | None:
    """The local tokenizer when one is named, else the server's, else None (word prompts)."""
    if local:
        return LocalTokenizer(local)
    return await probe_server(session, base_url, model, headers)
