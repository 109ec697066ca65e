"""report: render the plain result objects of ``patcher.results`` as text, JSON, JUnit and SARIF, and diffs of patch reports.
May import: patcher.results, patcher.__version__, the stdlib, rich and click; never the engine, verify, ci, api or cli.
"""
