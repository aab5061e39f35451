"""aiohttp building blocks shared by every pdmesh service (worker, router, KV transfer)."""
