"""verify: run a patched tree's own decoders in a child process and judge them; floors, top down: process (parent and child), judge, then subjects and models side by side, then plumbing.
May import: patcher.results and patcher.errors (process.runner, the parent, only); the child's modules import only each other, the stdlib, torch and transformers, never the rest of ``patcher``.
"""
