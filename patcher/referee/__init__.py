"""referee: a serving engine (llama.cpp, vLLM, SGLang) beside ddpatch's reference: its clients and counters (engines, http, counters), the reference counted as engines count (reference), the verdict (run).
May import: patcher.verify (the reference decoders, inside functions), patcher.errors, patcher.results and the stdlib; never torch at module level, nor the engine, report, api or cli.
"""
