"""the verifier's processes: the parent that starts and reads a child (runner, exitstatus), the child's entry (worker) and the warm verifier that forks children (warm).
May import: judge, subjects, models, plumbing (runner also patcher.results and patcher.errors: it is the parent).
"""
