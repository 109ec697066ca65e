"""referee: ask a running serving engine (llama.cpp, vLLM, SGLang) for one greedy decode with its own acceptance counters (engines, http) and convert them to one definition (counters).
May import: patcher.errors, patcher.results and the stdlib only (urllib, http.client, json); never torch at module level, nor the engine, verify, report, api or cli.
"""
