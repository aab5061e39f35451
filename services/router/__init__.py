"""The pdmesh router: OpenAI front door, worker registry, P/D pairing, policies, reliability."""
