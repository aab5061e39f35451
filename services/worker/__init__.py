"""The pdmesh worker: an OpenAI-compatible aiohttp server around one engine."""
