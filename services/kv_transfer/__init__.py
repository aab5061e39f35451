"""KV-transfer service: the /kv/v1 aiohttp app inside every prefill and decode worker.

Entry points for a worker: `config.KVTransferConfig` (+ `config.add_arguments`),
`service.KVTransferService` (`.pull.prefill.offer/fetch/abort/track/untrack/decline`,
`.push.send/receive/decline_send/decline_receive`), `app.create_app` / `app.start_server`,
and `store.EngineBlockStore` over its AsyncEngine. services/worker/handoff.py is the user.
"""
