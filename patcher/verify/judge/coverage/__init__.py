"""the coverage oracle: runs (the child's line coverage around each decode, the mode parameters' own runs) and rows (the parent's coverage: LABEL rows, the rule for an unrun branch).
May import: the rest of judge (logits, tokens, neartie), subjects, models, plumbing and check, relatively; the stdlib, torch and transformers.
"""
