"""what both sides of the verifier share at the bottom: the child's event lines (events), the environment shims (shims), the child's environment (environ).
May import: the stdlib only; nothing else of patcher.
"""
