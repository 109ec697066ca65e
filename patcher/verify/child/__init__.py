"""the verifier's child: its entry (worker, started by path, which loads patcher/verify as a private package) and the warm verifier that forks children (warm).
May import: judge, subjects, models, plumbing and check, relatively (the child imports nothing of patcher outside patcher/verify).
"""
