"""what a verify decodes with: the models and prompts (load, presets, trained, prompts), the scripted draft (script) and the decode context (context).
May import: plumbing; the stdlib, torch and transformers; never judge, subjects or process.
"""
