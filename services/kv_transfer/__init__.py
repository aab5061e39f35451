"""KV-transfer service: the /kv/v1 aiohttp app inside every prefill and decode worker.

One concept per module; "prefill"/"decode" in a name say which side of a transfer it serves:
- `app`: the aiohttp app, its routes and `start_server`;
- `service`: `KVTransferService`, the object a worker keeps (`.pull` / `.push`, each with its
  `.prefill` and `.decode` side; the wrong mode is a 409);
- `context`: the state a transfer mode works in (`KVContext`), the mode base, metrics;
- `handshake`: the handshake, both sides: compat hash, negotiation, layer coverage, the
  handshaken peers (server side) and `PeerClient`, which handshakes with and sends every
  (signed) request to another KV service (client side);
- `auth`: who may call: signed requests (timestamp, nonce, replay cache) with a secret,
  loopback peers only without one;
- `lease`: the prefill's leases on finished blocks (pull mode);
- `store`: the engine's block store (`EngineBlockStore`, `InMemoryBlockStore`), gather/scatter;
- `codec`: chunking, staging buffers, digests and placement of blocks on the wire;
- `pull`: pull mode, both sides; `push`: push mode, both sides;
  `push_prefill_stream`: one push transfer on the prefill, overlapping compute;
- `config`: `KVTransferConfig` (+ `add_arguments`).
Errors are services.common.errors. services/worker/kv_link.py builds the service.

Transport security: with the worker's `--tls-cert/--tls-key` the listener serves TLS (the same
files as the worker's API; `--kv-require-client-cert` adds mTLS against `--tls-ca`), and the
endpoint says so wherever it is advertised (`kv_endpoint.tls`, `remote_tls`, `kv_tls`): a peer
address is `host:port` (plain) or `https://host:port` (shared.protocol.messages.kv_address).
`PeerClient` verifies TLS peers against `--tls-ca` with hostname checks, so a certificate must
name the advertised host; a TLS failure is a 502 `kv_peer_tls` naming the fix. The contexts
come from services/common/tls.py; the HMAC secret (`PDMESH_KV_SECRET`) is independent of TLS.
"""
