"""ci: re-check a recipe over an upstream's git history (git, history, hunks), keep the lock file (lock), and the scheduled workflow (workflow).
May import: patcher.engine, patcher.verify.process.runner, patcher.results, patcher.errors and the stdlib; never report, api or cli.
"""

#: Ranges longer than this are bisected per step instead of evaluated commit by commit.
BISECT_THRESHOLD = 8
#: Lines of upstream diff shown per finding.
HUNK_LINES = 60
