"""`pdmesh bench`: a load generator and report for any OpenAI-compatible server.

Modules: config (BenchConfig and flag parsing), tokenizer (server or local token ids),
datasets (prompts), client (one streamed request -> RequestRecord), runner (arrivals,
concurrency, progress, SIGINT), metrics (records -> BenchResult), report (table, JSON, plot).
"""
