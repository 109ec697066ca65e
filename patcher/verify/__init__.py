"""verify: run a patched tree's own decoders in a child process and judge them against the target (runner: the parent; worker, models, binding, checks, oracle, presets: the child).
May import: patcher.results (runner only); the child's modules import only each other, the stdlib, torch and transformers, never ``patcher``.
"""
