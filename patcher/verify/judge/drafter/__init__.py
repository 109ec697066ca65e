"""the drafter oracle: recorder (the drafter's calls, its calibration, the from-scratch drafter forward) and verdict (one decode's verdict, the drafter: METHOD and drafter class NAME rows).
May import: the rest of judge (calibration, logits, routers), models, plumbing and check, relatively; the stdlib, torch and transformers.
"""
