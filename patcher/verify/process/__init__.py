"""the verifier's parent, in the CLI's process: starts a child and reads its events (runner), tells how it died (exitstatus), the settings it passes (settings).
May import: child, judge, subjects, models, plumbing (and patcher.results and patcher.errors: it is the parent).
"""
