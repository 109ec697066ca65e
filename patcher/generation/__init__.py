"""generation: transformers' own speculative generate() made exact on stateful models (context: ``lossless``; probe: the behaviour check on entry; roles: target and drafter recordings).
May import: patcher.runtime (and transformers, torch); ``patcher.lossless`` is its public face, and nothing else of patcher imports it.
"""
