"""The KV-transfer wire protocol: messages, the msgpack codec, tensors on the wire, compat hash."""
